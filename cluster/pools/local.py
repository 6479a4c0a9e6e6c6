"""`specserve generate --local`: validate the CLI's arguments into configs and run the in-process engine."""

from __future__ import annotations

import argparse

from specserve.cluster.app_config import DEFAULT_MODEL, DEMO
from specserve.workers.config import ModelConfig, SamplingParams, SpecParams, validate
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import chat_prompt_ids, conversation
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import GenerationResult, SpecEngine


def request_params(args: argparse.Namespace) -> tuple[SamplingParams, SpecParams]:
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
        method = "none"
    elif args.draft == "ngram" or (args.draft is None and _target(args) != DEMO):
        method = "ngram"
    else:
        method = "draft"
    return sampling, validate(SpecParams, {"method": method, "k": args.k})


def _target(args: argparse.Namespace) -> str:
    return args.target or DEFAULT_MODEL


def model_paths(args: argparse.Namespace) -> tuple[str, str | None]:
    """Target and draft model directories: names and .gguf files resolved (pulled and converted on first use); the
    demo family's pair for `--target demo`; no draft directory for n-gram drafting or --no-spec."""
    from specserve.workers.models.catalog import resolve_model

    target = _target(args)
    if target == DEMO:
        from specserve.workers.models.demo import ensure_demo_family

        family = ensure_demo_family()
        target_dir, default_draft = family.target, family.draft
    else:
        target_dir, default_draft = resolve_model(target), None
    if args.no_spec or args.draft == "ngram" or (args.draft is None and default_draft is None):
        return target_dir, None
    if args.draft == DEMO:
        raise InvalidRequestError("draft", "'demo' drafts only for --target demo")
    return target_dir, default_draft if args.draft is None else resolve_model(args.draft)


def prompt_ids_or_text(args: argparse.Namespace, tokenizer) -> str | list[int]:
    """--chat: the user's message in the model's chat template (token ids); else the raw prompt text."""
    if args.system and not args.chat:
        raise InvalidRequestError("system", "--system needs --chat")
    if args.chat:
        return chat_prompt_ids(tokenizer, conversation(args.prompt, args.system))
    return args.prompt


def generate_distributed(args: argparse.Namespace) -> dict:
    """Run one request through a local Ray cluster: a target worker actor, a draft worker actor and the scheduler
    actor, talking over gRPC. Returns the same JSON contract as the in-process path."""
    import ray
    from transformers import AutoTokenizer

    from specserve.cluster.config import local_config
    from specserve.cluster.pools.builders import deploy

    sampling, spec = request_params(args)
    target_path, draft_path = model_paths(args)
    prompt = prompt_ids_or_text(args, AutoTokenizer.from_pretrained(target_path, local_files_only=True))
    config = local_config(target_path, draft_path, device=args.device, dtype=args.dtype)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    deployment = deploy(config)
    try:
        out = ray.get(deployment.scheduler.generate.remote(prompt, sampling.model_dump(), spec.model_dump()))
    finally:
        deployment.shutdown()
        if started_ray:
            ray.shutdown()
    out.pop("scheduling", None)
    return out


def generate_local(args: argparse.Namespace) -> GenerationResult:
    sampling, spec = request_params(args)
    target_path, draft_path = model_paths(args)
    target = load_model(validate(ModelConfig, {"path": target_path, "dtype": args.dtype, "device": args.device}))
    draft = None
    if draft_path is not None:
        draft = load_model(validate(ModelConfig, {"path": draft_path, "dtype": args.dtype, "device": args.device}))
    engine = SpecEngine(target, draft)
    return engine.generate(prompt_ids_or_text(args, target.tokenizer), sampling, spec)
