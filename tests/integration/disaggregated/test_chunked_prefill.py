"""Chunked prefill over real gRPC workers: a long prompt reaches the target in chunks, each its own call that
batches with other requests' rounds, and decodes exactly what target-only decoding does, with a draft model, with
prompt lookup and with an EAGLE-3 head (which reads the prompt's features from every chunk)."""

import asyncio

import pytest

from specserve.cluster.scheduling import features
from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.workers.config.request import SamplingParams, SpecParams
from tests.helpers.eagle_disaggregated import build_pairs
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.workers import LocalWorkers, load_pair

CHUNK, N = 32, 16
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2


async def _generate(w: LocalWorkers, requests, drafted: list | None = None, decode_steps: int = 1,
                    new_tokens: int = N) -> tuple[list, list[int]]:  # fmt: skip
    """Every (ids, spec) at once on a pipeline that chunks prefills; returns the requests and the new tokens of each
    target call, in order; `drafted` gets each draft call's (request id, k, new tokens)."""
    fed = []
    for worker in w.targets.values():
        verify_batch = worker.verify_batch
        worker.verify_batch = lambda calls, v=verify_batch: fed.extend(len(c.new_tokens) for c in calls) or v(calls)
    for worker in w.drafts.values() if drafted is not None else ():
        propose_batch = worker.propose_batch
        worker.propose_batch = lambda calls, p=propose_batch: drafted.extend(
            (c.request_id, c.k, len(c.new_tokens)) for c in calls) or p(calls)  # fmt: skip
    drafts = {n: DraftClient(a) for n, a in w.draft_addresses.items()}
    targets = {n: TargetClient(a) for n, a in w.target_addresses.items()}
    scheduler = Scheduler(list(drafts), list(targets), prefill_chunk=CHUNK, decode_steps=decode_steps)
    pipeline = Pipeline(scheduler, drafts, targets)
    reqs = await asyncio.gather(*(pipeline.generate(ids, SamplingParams(max_new_tokens=new_tokens), spec, frozenset())
                                  for ids, spec in requests))  # fmt: skip
    await pipeline.drain_releases()
    return reqs, fed


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_long_prompt_prefills_in_chunks_beside_a_short_one_and_decodes_as_target_only(
    models_dir, tiny_target, device, method
):
    target, draft = load_pair(tiny_target, models_dir, device, "chunked_draft")
    long, short = target.tokenizer(LONG)["input_ids"], target.tokenizer("import json")["input_ids"]
    assert len(long) > 4 * CHUNK

    drafted = []

    async def main():
        async with LocalWorkers(target, [draft]) as w:
            requests = [(long, SpecParams(method=method, k=3)), (short, SpecParams(method=method, k=3))]
            return await _generate(w, requests, drafted)

    reqs, fed = asyncio.run(main())
    for req in reqs:
        assert req.state.generated == own_greedy_loop(target.model, req.state.tokens[: req.state.prompt_len], N, set())
    assert max(fed) <= CHUNK + 4 and fed.count(CHUNK) >= len(long) // CHUNK - 1  # no call took the whole prompt
    if method == "draft":  # the draft model cached each chunk as it came (k = 0), and its first draft took the rest
        calls = [(k, n) for rid, k, n in drafted if rid == reqs[0].request_id]
        first = next(i for i, (k, _) in enumerate(calls) if k > 0)
        assert first >= len(long) // CHUNK - 1 and all(k == 0 for k, _ in calls[:first])
        assert max(n for _, n in calls[: first + 1]) <= CHUNK + 4 and reqs[0].state.stats.drafted > 0


def test_a_heads_request_is_fed_every_chunks_features_as_it_comes(tmp_path_factory, device, monkeypatch):
    """Each chunk's features go to the head while the next chunk runs (prefill.py), from position 0 on, though one
    call carries at most 40 positions' features here (the wire's limit, MAX_FEATURE_BYTES: 910 of SmolLM2-135M), so
    the head reads the whole prompt, which one first draft call could not bring it."""
    target, head_dir = build_pairs(tmp_path_factory.mktemp("chunked_pairs"), device)["byte"]
    long = target.tokenizer(LONG)["input_ids"]
    monkeypatch.setattr(features, "MAX_FEATURE_BYTES", 40 * 3 * target.model.config.hidden_size * 2)  # float16

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:
            handed = []
            add = w.drafts["draft-0"].drafter.add_features
            w.drafts["draft-0"].drafter.add_features = lambda rid, start, f: (
                handed.append((start, len(f))) or add(rid, start, f)
            )
            (req,), fed = await _generate(w, [(long, SpecParams(method="eagle", k=3))])
            return req, fed, handed

    req, fed, handed = asyncio.run(main())
    assert req.state.generated == own_greedy_loop(target.model, long, N, set())
    assert max(fed) <= CHUNK + 4 and req.state.stats.drafted > 0
    ends = [start + n for start, n in handed]
    assert handed[0][0] == 0 and all(start == end for (start, _), end in zip(handed[1:], ends, strict=False))
    assert max(n for _, n in handed) <= CHUNK + 4 and len(handed) > len(long) // CHUNK  # chunk by chunk, no gap


def test_one_prefill_chunk_at_a_time_per_target_worker(models_dir, tiny_target, device):
    """Three long prompts at once: their chunks take turns on the target (vLLM's step budget admits one chunk's
    tokens of prefill at a time), so no target batch ever holds two chunks; every request decodes as target-only."""
    target, draft = load_pair(tiny_target, models_dir, device, "chunked_draft")
    longs = [target.tokenizer(f"# file {i}\n" + LONG)["input_ids"] for i in range(3)]
    chunks_per_batch = []

    async def main():
        async with LocalWorkers(target, [draft]) as w:
            worker = w.targets["target-0"]
            verify_batch = worker.verify_batch

            def counting(calls):
                chunks_per_batch.append(sum(len(c.new_tokens) == CHUNK for c in calls))
                return verify_batch(calls)

            worker.verify_batch = counting
            return await _generate(w, [(ids, SpecParams(method="ngram", k=3)) for ids in longs])

    reqs, _ = asyncio.run(main())
    for req in reqs:
        assert req.state.generated == own_greedy_loop(target.model, req.state.tokens[: req.state.prompt_len], N, set())
    assert sum(chunks_per_batch) >= 3 * (len(longs[0]) // CHUNK - 1) and max(chunks_per_batch) == 1


def test_head_trees_that_would_not_pay_beside_a_chunk_stream_plain_rounds_and_decode_as_target_only(
    tmp_path_factory, device, monkeypatch
):
    """eagle-tree k='auto' requests decoding while a long prompt prefills in chunks on their target: where a tree
    would be pruned to nothing beside the chunk (forced here: `TreePruning.pays_beside`'s judgement, unit-tested in
    tests/workers/speculation/planner/test_tree.py) they draft nothing and run plain rounds streamed from Decode
    calls; once the prompt is in, trees again. Every output is target-only's."""
    from specserve.cluster.scheduling.worker_clients import TargetClient
    from specserve.workers.speculation.planner.tree import TreePruning

    target, head_dir = build_pairs(tmp_path_factory.mktemp("chunked_tree_pairs"), device)["tiny_vocab"]
    asked = []
    monkeypatch.setattr(TreePruning, "pays_beside", lambda self, *a: asked.append(1) and False)
    steps = []
    decode = TargetClient.decode
    counted = lambda c, call, params, n, ends: steps.append(n) or decode(c, call, params, n, ends)  # noqa: E731
    monkeypatch.setattr(TargetClient, "decode", counted)
    long = [1] + [3 + i % 5 for i in range(12 * CHUNK)]
    chats = [[1, 3, 4, 3, 4, 3], [1, 5, 6], [1, 7, 3, 5, 4, 6, 7, 3, 4, 5, 6, 7, 5, 3]]

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:
            auto = SpecParams(method="eagle-tree", k="auto")
            return await _generate(w, [(ids, auto) for ids in chats + [long]], decode_steps=8, new_tokens=48)

    reqs, _ = asyncio.run(main())
    for req in reqs:
        prompt = req.state.tokens[: req.state.prompt_len]
        assert req.state.generated == own_greedy_loop(target.model, prompt, 48, set())
    assert asked and max(steps) > 1  # judged beside the chunks, and their plain rounds streamed
    assert sum(r.state.stats.drafted for r in reqs[:3]) > 0  # trees before and after the prompt's chunks
