"""`specserve generate --local`: validate the CLI's arguments into configs and run the in-process engine."""

from __future__ import annotations

import argparse

from specserve.workers.config import ModelConfig, SamplingParams, SpecParams, validate
from specserve.workers.engine import GenerationResult, SpecEngine
from specserve.workers.errors import InvalidRequestError
from specserve.workers.loading import load_model


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
    elif args.draft == "ngram":
        method = "ngram"
    else:
        method = "draft"
    return sampling, validate(SpecParams, {"method": method, "k": args.k})


def model_paths(args: argparse.Namespace) -> tuple[str, str | None]:
    """Target and draft model paths; the demo family when no target is named."""
    default_draft = None
    if args.target:
        target = args.target
    else:
        from specserve.workers.demo import ensure_demo_family

        family = ensure_demo_family()
        target, default_draft = family.target, family.draft
    if args.no_spec or args.draft == "ngram":
        return target, None
    if args.draft:
        return target, args.draft
    if default_draft is None:
        raise InvalidRequestError("draft", "with --target, name a --draft PATH, --draft ngram, or --no-spec")
    return target, default_draft


def generate_distributed(args: argparse.Namespace) -> dict:
    """Run one request through a local Ray cluster: a target worker actor, a draft worker actor and the scheduler
    actor, talking over gRPC. Returns the same JSON contract as the in-process path."""
    import ray

    from specserve.cluster.builders import deploy
    from specserve.cluster.config import local_config

    sampling, spec = request_params(args)
    target_path, draft_path = model_paths(args)
    config = local_config(target_path, draft_path, device=args.device, dtype=args.dtype)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    deployment = deploy(config)
    try:
        out = ray.get(deployment.scheduler.generate.remote(args.prompt, sampling.model_dump(), spec.model_dump()))
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
    return engine.generate(args.prompt, sampling, spec)
