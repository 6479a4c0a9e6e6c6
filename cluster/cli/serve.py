"""`specserve serve`, `gateway`, `config` and `manifests`: running and describing the Serve app. Ray, the Serve app
and the TLS gateway are imported inside the command that runs them."""

from __future__ import annotations

import argparse

from specserve.workers.errors import SpecServeError


def add_parsers(sub, common: list[argparse.ArgumentParser]) -> None:
    _add_serve(sub, common)
    _add_gateway(sub, common)
    _add_config(sub, common)
    _add_drain(sub, common)
    _add_manifests(sub, common)


def _add_serve(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", parents=common,
                       help="run the Serve app locally: gRPC + OpenAI-compatible HTTP (Ctrl-C stops it)")  # fmt: skip
    p.add_argument("--config", help="a Serve config file (YAML) with specserve's app args (default: --model's)")
    p.add_argument(
        "--model",
        help="the model to serve when no --config is given: a known name, a .gguf file, a "
        "Hugging Face directory or repo id org/name[@revision], or 'demo' (default: smollm2-135m-instruct)",
    )
    p.add_argument(
        "--draft",
        help="with --model: a draft model, an EAGLE-3 head directory or 'eagle', 'ngram' or 'none' (default: the "
        "target's packaged EAGLE-3 head if its measured acceptance pays, else ngram; the demo's draft for --model "
        "demo)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="with --model: where the workers run (default "
                   "auto: cuda when available)")  # fmt: skip
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="with --model: weights' dtype (default auto: bfloat16 on CUDA, float32 on a CPU)")  # fmt: skip
    p.add_argument("--enforce-eager", action="store_true", help="with --model: no CUDA graphs, every forward pass "
                   "eager (vLLM's flag)")  # fmt: skip
    p.add_argument("--tensor-parallel-size", type=int, metavar="N", help="with --model: target ranks per replica")
    p.add_argument("--k", help="with --model: tokens drafted per round, 1..16, or 'auto' (the default)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        metavar="F",
        help="with --model: the share of each GPU "
        "a worker may use; its KV cache gets what is left after the weights and activations (default 0.9)",
    )
    p.add_argument("--kv-cache-memory-bytes", type=int, metavar="N",
                   help="with --model: each worker's KV cache budget in bytes, on any device")  # fmt: skip
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="with --model: reuse cached prompt prefixes across requests (default: on)")  # fmt: skip
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --model: prefill long prompts in chunks (of --max-num-batched-tokens, 256 by default) between "
        "other requests' rounds (default: on; --no-enable-chunked-prefill: one call)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="with --model: chunked prefill's chunk, in tokens (turns it on)")  # fmt: skip
    p.add_argument("--num-scheduler-steps", type=int, metavar="N",
                   help="with --model: speculation off, the most decoding steps a call runs (default 32)")  # fmt: skip
    p.add_argument("--speculative-config", metavar="JSON",
                   help="with --model: vLLM's speculative config, e.g. '{\"method\": \"eagle3\", "
                   "\"num_speculative_tokens\": 3}' (docs/speculative-config.md)")  # fmt: skip
    p.add_argument("--host", default=None, help="address the gRPC and HTTP proxies and the TLS gateway listen on "
                                                "(default: the config's http_options.host, else 127.0.0.1: this "
                                                "machine only; 0.0.0.0 for every interface, with SPECSERVE_API_KEY "
                                                "set)")  # fmt: skip
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC proxy port (default: the config's, 9000)")
    p.add_argument("--http-port", type=int, default=None, help="HTTP proxy port (default: the config's, 8000)")
    p.add_argument("--metrics-port", type=int, default=8080, help="Ray's Prometheus metrics port")
    p.add_argument("--grpc-tls-cert", help="PEM certificate: also serve gRPC over TLS (a gateway to the proxy)")
    p.add_argument("--grpc-tls-key", help="PEM private key of --grpc-tls-cert")
    p.add_argument("--grpc-tls-client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--grpc-tls-port", type=int, default=9443, help="port of the TLS gRPC endpoint (default 9443)")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from specserve.cluster.serve.server import serve_forever

    tls = None
    if args.grpc_tls_cert or args.grpc_tls_key or args.grpc_tls_client_ca:
        # The gateway listens on the proxies' host (set once the config is read).
        tls = _gateway_config(listen=f"127.0.0.1:{args.grpc_tls_port}", certfile=args.grpc_tls_cert,
                              keyfile=args.grpc_tls_key, client_ca=args.grpc_tls_client_ca)  # fmt: skip
    overrides = _model_overrides(args)
    if args.config and (args.model or args.draft or overrides):
        raise SpecServeError("--model, --draft and the model's flags (--device, --dtype, --tensor-parallel-size, --k, "
                             "--speculative-config, the KV cache's and chunked prefill's) apply without --config "
                             "(the config names its models)")  # fmt: skip
    return serve_forever(args.config, args.grpc_port, args.http_port, args.metrics_port, grpc_tls=tls,
                         model=args.model, draft=args.draft, host=args.host, overrides=overrides)  # fmt: skip


def _model_overrides(args: argparse.Namespace) -> dict:
    """The served model's fields that `serve`'s flags set (validated with the rest of the model's config)."""
    import json

    out: dict = {}
    for flag in ("device", "dtype"):
        if getattr(args, flag) is not None:
            out[flag] = getattr(args, flag)
    if args.enforce_eager:
        out["enforce_eager"] = True
    named = {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "prefix_caching": args.enable_prefix_caching,
    }
    kv = {key: value for key, value in named.items() if value is not None}
    if kv:
        out["target_pool"], out["draft_pool"] = {"kv_cache": kv}, {"kv_cache": dict(kv)}
    if args.tensor_parallel_size is not None:
        out.setdefault("target_pool", {})["tensor_parallel_size"] = args.tensor_parallel_size
    if args.enable_chunked_prefill is False:
        out["prefill_chunk_tokens"] = None
    elif args.max_num_batched_tokens is not None or args.enable_chunked_prefill:
        out["prefill_chunk_tokens"] = args.max_num_batched_tokens or 256
    if args.num_scheduler_steps is not None:
        out["decode_steps"] = args.num_scheduler_steps
    if args.k is not None:
        out["k"] = args.k if args.k == "auto" else _int_flag("--k", args.k)
    if args.speculative_config is not None:
        try:
            out["speculative_config"] = json.loads(args.speculative_config)
        except ValueError as err:
            raise SpecServeError(f"--speculative-config: not JSON ({err})") from None
    return out


def _int_flag(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecServeError(f"{flag}: {value!r} is not an integer or 'auto'") from None


def _gateway_config(**fields):
    from specserve.cluster.serve.tls_gateway import GatewayConfig
    from specserve.workers.config.strict import validate

    return validate(GatewayConfig, {k: v for k, v in fields.items() if v is not None})


def _add_gateway(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gateway", parents=common,
                       help="terminate TLS for the public gRPC API in front of Serve's gRPC proxy")  # fmt: skip
    p.add_argument("--cert", required=True, help="PEM certificate chain to present")
    p.add_argument("--key", required=True, help="PEM private key of the certificate")
    p.add_argument("--client-ca", help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    p.add_argument("--listen", default="0.0.0.0:9443", help="address to serve TLS on (default 0.0.0.0:9443)")
    p.add_argument("--upstream", default="127.0.0.1:9000", help="Serve's gRPC proxy (default 127.0.0.1:9000)")
    p.add_argument("--app", default=None, help="Serve application for calls that name none (default specserve)")
    p.set_defaults(func=_gateway)


def _gateway(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from specserve.cluster.serve.tls_gateway import serve_gateway

    config = _gateway_config(listen=args.listen, upstream=args.upstream, certfile=args.cert, keyfile=args.key,
                             client_ca=args.client_ca, app_name=args.app)  # fmt: skip

    async def run() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await serve_gateway(config, stop)

    asyncio.run(run())
    return 0


def _add_drain(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("drain", parents=common, help="stop admitting requests to a running app and wait for the "
                       "running ones to finish (a Kubernetes preStop hook; `serve` does it on SIGTERM)")  # fmt: skip
    p.add_argument("--app", default="specserve", help="the Serve application (default specserve)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait at most (default 60)")
    p.add_argument("--address", default="auto", help="the Ray cluster (default auto: the one on this node)")
    p.set_defaults(func=_drain)


def _drain(args: argparse.Namespace) -> int:
    import ray

    from specserve.cluster.serve.drain import drain

    ray.init(address=args.address, namespace="specserve", configure_logging=False, log_to_driver=False)
    try:
        left = drain(args.app, args.timeout)
    finally:
        ray.shutdown()
    print("drained" if not left else f"{left} requests still running after {args.timeout:g} s", flush=True)
    return 0


def _add_config(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", parents=common, help="print the default Serve config file (YAML) to start from")
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.set_defaults(func=_config)


def _config(args: argparse.Namespace) -> int:
    import yaml

    from specserve.cluster.app_config import serve_config

    print(yaml.safe_dump(serve_config(grpc_port=args.grpc_port, http_port=args.http_port), sort_keys=False), end="")
    return 0


def _add_manifests(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("manifests", help="KubeRay manifests rendered from manifests/serve-*.yaml")
    msub = p.add_subparsers(dest="manifests_command", required=True)
    render = msub.add_parser("render", parents=common, help="write manifests/rayservice-{gpu,cpu}.yaml")
    render.set_defaults(func=_render_manifests)


def _render_manifests(args: argparse.Namespace) -> int:
    from specserve.cluster.serve.manifests import write_all

    for path in write_all():
        print(path)
    return 0
