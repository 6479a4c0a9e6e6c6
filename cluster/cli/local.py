"""`specserve generate --local`: validate the CLI's arguments into configs and run the in-process engine. (Draft and
target workers apart, over gRPC: `specserve serve`, then `specserve generate` against it.)"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from specserve.cluster.app_config import DEFAULT_MODEL, DEMO
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.config.strict import validate
from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models.chat import chat_prompt_ids, conversation
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import GenerationResult, SpecEngine
from specserve.workers.speculation.methods import HEAD_DEFAULT, LOOKUP_DEFAULT, MODEL_DEFAULT, NONE


@dataclass(frozen=True)
class LocalModels:
    """The directories a local run loads: the target's, and a draft model's or an EAGLE-3 head's (neither: n-gram
    drafting or --no-spec)."""

    target: str
    draft: str | None = None
    eagle_head: str | None = None


def request_params(args: argparse.Namespace, models: LocalModels) -> tuple[SamplingParams, SpecParams]:
    sampling = validate(
        SamplingParams,
        {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
        },
    )
    if args.no_spec:
        method = NONE
    elif models.eagle_head is not None:  # as serving does by default: the head's chain or prompt lookup's
        method = HEAD_DEFAULT
    else:
        method = MODEL_DEFAULT if models.draft is not None else LOOKUP_DEFAULT
    return sampling, validate(SpecParams, {"method": method, "k": args.k})


def _target(args: argparse.Namespace) -> str:
    return args.target or DEFAULT_MODEL


def _resolve(flag: str, ref: str) -> str:
    """resolve_model, its error naming the flag that gave the reference (a missing path says which of --target and
    --draft it came from)."""
    from specserve.workers.models.catalog import resolve_model

    try:
        return resolve_model(ref)
    except ModelLoadError as e:
        raise ModelLoadError(f"{flag}: {e}") from None


def local_models(args: argparse.Namespace) -> LocalModels:
    """The target, and what drafts for it: names and .gguf files resolved (pulled and converted on first use); the
    demo family's pair for `--target demo`; --draft 'eagle' (the head packaged for the target) or an EAGLE-3 head
    directory; no --draft: the demo family's draft, else the target's packaged head when it has one, else n-gram
    drafting (no directory)."""
    from specserve.workers.models.packaged_heads import default_head_for
    from specserve.workers.speculation.eagle.config import resolve_eagle_head

    target = _target(args)
    if target == DEMO:
        from specserve.workers.models.demo import ensure_demo_family

        family = ensure_demo_family()
        target_dir, default_draft = family.target, family.draft
    else:
        target_dir, default_draft = _resolve("--target", target), None
    if args.no_spec or args.draft == "ngram":
        return LocalModels(target_dir)
    if args.draft is None:
        head = None if default_draft else default_head_for(target_dir)
        return LocalModels(target_dir, default_draft, str(head) if head else None)
    if args.draft == DEMO:
        raise InvalidRequestError("draft", "'demo' drafts only for --target demo")
    try:
        head = resolve_eagle_head(args.draft, target_dir)
    except ModelLoadError as e:
        raise ModelLoadError(f"--draft: {e}") from None
    if head is not None:
        return LocalModels(target_dir, eagle_head=head)
    return LocalModels(target_dir, _resolve("--draft", args.draft))


def prompt_ids_or_text(args: argparse.Namespace, tokenizer) -> str | list[int]:
    """--chat: the user's message in the model's chat template (token ids); else the raw prompt text."""
    if args.system and not args.chat:
        raise InvalidRequestError("system", "--system needs --chat")
    if args.chat:
        return chat_prompt_ids(tokenizer, conversation(args.prompt, args.system))
    return args.prompt


def generate_local(args: argparse.Namespace) -> GenerationResult:
    models = local_models(args)
    sampling, spec = request_params(args, models)
    target = load_model(validate(ModelConfig, {"path": models.target, "dtype": args.dtype, "device": args.device}))
    draft = None
    if models.draft is not None:
        draft = load_model(validate(ModelConfig, {"path": models.draft, "dtype": args.dtype, "device": args.device}))
    engine = SpecEngine(target, draft, eagle_head=models.eagle_head)
    return engine.generate(prompt_ids_or_text(args, target.tokenizer), sampling, spec)
