"""What every replica of the Serve app looks up for itself: its models' directories, its application's name, and a
loop that keeps a background duty (a heartbeat, a registry poll) going through failures."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ray import serve

from specserve.cluster.app_config import APP_NAME, DEMO, ModelPairConfig

log = logging.getLogger(__name__)


def use_serve_log_files(level: int = logging.INFO) -> None:
    """specserve's log lines into this replica's Serve log file (logs/serve/replica_*.log in the Ray session), where
    Serve's format adds the replica and the current request's id; INFO included there, while the terminal keeps
    WARNING and above only (the records still reach Python's last-resort stderr handler, as before)."""
    import logging.handlers

    ours = logging.getLogger("specserve")
    for handler in logging.getLogger("ray.serve").handlers:  # Serve's file handler sits behind a MemoryHandler
        to_file = isinstance(handler, logging.FileHandler | logging.handlers.MemoryHandler)
        if to_file and handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(min(ours.getEffectiveLevel(), level))


def resolve_paths(model: ModelPairConfig) -> tuple[str, str | None]:
    """(target directory, draft directory or None): 'demo' means the demo family, installed here from the packaged
    weights if missing (serving never trains); names and .gguf files are pulled and converted once per machine
    (cached under $SPECSERVE_HOME). The draft directory of a model served with an EAGLE-3 head is the head's ('eagle':
    the head packaged for the target)."""
    from specserve.workers.models.catalog import resolve_model
    from specserve.workers.speculation.eagle.config import resolve_eagle_head

    if model.target == DEMO:
        from specserve.workers.models.demo import ensure_demo_family

        family = ensure_demo_family()
        target, demo_draft = family.target, family.draft
    else:
        target, demo_draft = resolve_model(model.target), None
    if not model.drafts_with_model:
        return target, None
    head = resolve_eagle_head(model.draft, target)
    if head is not None:
        return target, head
    return target, demo_draft if model.draft == DEMO else resolve_model(model.draft)


def app_name() -> str:
    """The Serve application this replica belongs to (the default name outside a replica)."""
    try:
        return serve.get_replica_context().app_name or APP_NAME
    except Exception as e:  # noqa: BLE001 - Serve raises a plain exception outside a replica
        log.debug("no replica context (%s): application %r", e, APP_NAME)
        return APP_NAME


async def every(seconds: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """Run `step` every `seconds`, forever. A failing step (the registry restarting) is retried on the next tick;
    the first failure of a run of them is logged with its traceback, and the recovery."""
    failing = False
    while True:
        await asyncio.sleep(seconds)
        try:
            await step()
        except Exception:  # noqa: BLE001 - logged; the next tick retries
            log.log(logging.DEBUG if failing else logging.WARNING, "%s failed; retrying every %.0f s", what, seconds,
                    exc_info=not failing)  # fmt: skip
            failing = True
            continue
        if failing:
            log.info("%s works again", what)
        failing = False
