"""OpenAI's `n` (HTTP `n`, gRPC GenerateRequest.n): several choices for one prompt, each its own request to the
scheduler (so each is exactly what a request alone would give, and they run in parallel), seeded `seed + index` when
the client seeded the request, so every choice is reproducible on its own; their streams merged as their rounds
arrive, each chunk with its `index`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from specserve.cluster.scheduling.prepared import Chunk, Prepared


def per_choice(prepared: Prepared, n: int) -> list[Prepared]:
    """The n requests: the same prompt and controls, choice i seeded seed + i (unseeded choices draw independently)."""
    out = []
    for i in range(n):
        seed = None if prepared.params.seed is None else prepared.params.seed + i
        params = prepared.params.model_copy(update={"seed": seed})
        out.append(dataclasses.replace(prepared, params=params, request_id=f"{prepared.request_id}.{i}"))
    return out


async def merged(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) from every stream as each comes; an error in one ends the merge with it (the others
    are closed)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    await queue.put((i, chunk))
            await queue.put((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def after(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """`first`, then the rest of the stream it came from (closed with this one: a client gone ends the request)."""
    async with contextlib.aclosing(rest):
        if first is None:
            return
        yield first
        async for chunk in rest:
            yield chunk


async def started(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """The choices' streams merged once each has sent its first chunk, so that a refusal (over capacity, no workers)
    is raised here, before a response has begun, as for one request."""
    firsts = await asyncio.gather(*(anext(s, None) for s in streams))
    return merged([after(f, s) for f, s in zip(firsts, streams, strict=True)])


async def indexed(chunks: AsyncIterator[Chunk]) -> AsyncIterator[tuple[int, Chunk]]:
    """One choice's stream as choice 0's (closed with this one)."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield 0, chunk
