"""`specserve generate`: against a running server over gRPC (the default), or on this machine with --local.

The remote path imports only the gRPC client (no torch, transformers or Ray), so it starts in a fraction of a second;
the local path imports the engine inside the command."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specserve.workers.errors import SpecServeError
from specserve.workers.models.chat import conversation


def _k_value(text: str) -> int | str:
    """'auto' or an integer; anything else is passed on for validation to reject with a clear message."""
    try:
        return int(text)
    except ValueError:
        return text


def add_parser(sub, common: list[argparse.ArgumentParser]) -> None:
    from specserve.cluster.app_config import DEFAULT_MODEL

    p = sub.add_parser("generate", parents=common,
                       help="generate a completion for PROMPT (or a chat answer to it, with --chat)")  # fmt: skip
    p.add_argument("prompt", help="prompt text; with --chat, the user's message")
    p.add_argument(
        "--chat",
        action="store_true",
        help="PROMPT is a user message: apply the model's chat template and stop at its end of turn",
    )
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
    p.add_argument("--target",
                   help=f"target model: a known name (`specserve models list`), a .gguf file, a Hugging Face "
                        f"directory or repo id org/name[@revision], or 'demo' for the demo family (default: "
                        f"{DEFAULT_MODEL})")  # fmt: skip
    draft = p.add_mutually_exclusive_group()
    draft.add_argument(
        "--draft",
        help=(
            "a draft model (name, .gguf file, directory or repo id), 'eagle' (the EAGLE-3 head packaged for the "
            "target) or an EAGLE-3 head directory (the head's chain or prompt lookup's, whichever is expected to "
            "accept more), or 'ngram' for prompt-lookup drafting (default: the demo family's draft with --target "
            "demo, else the target's packaged head when its measured acceptance pays, else ngram)"
        ),
    )
    draft.add_argument("--no-spec", action="store_true", help="target-only decoding, no speculation")
    p.add_argument("--k", type=_k_value, default=None, help="tokens drafted per round (1..16), or 'auto' (the default)")
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
    from specserve.cluster.cli.local import generate_local

    if args.k is None:
        args.k = 4
    _print_result(generate_local(args).to_dict(), args.json)
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


def _remote_kwargs(args: argparse.Namespace) -> dict:
    """SpecServeClient.generate's keyword arguments from the flags; flags that need --local are refused."""
    if args.target or args.draft:
        raise SpecServeError("--target and --draft apply to --local; a server has its models")
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
    return kw


def _generate_remote(args: argparse.Namespace) -> int:
    """Call a running server's SpecServe gRPC service; same output contract as --local."""
    import grpc

    from specserve.client import SpecServeClient

    kw = _remote_kwargs(args)
    prompt = None if args.chat else args.prompt
    try:
        with SpecServeClient(args.address, timeout_s=args.timeout, token=args.api_key, tls=args.tls,
                             ca_file=args.ca_file, client_cert_file=args.client_cert,
                             client_key_file=args.client_key) as client:  # fmt: skip
            if args.stream:
                _stream(client, prompt, kw, args.json)
            else:
                _print_result(client.generate(prompt, **kw), args.json)
            return 0
    except grpc.RpcError as e:
        raise SpecServeError(f"{args.address}: {e.code().name}: {e.details()}") from None


def _stream(client, prompt: str | None, kw: dict, as_json: bool) -> None:
    """Print each round's chunk as it arrives (one JSON object a line with --json), then the stats."""
    out = {"text": "", "token_ids": [], "finish_reason": None, "stats": {}}
    for chunk in client.generate_stream(prompt, **kw):
        if as_json:
            print(json.dumps(chunk), flush=True)
        else:
            print(chunk["text"], end="", flush=True)
        out["text"] += chunk["text"]
        out["token_ids"] += chunk["token_ids"]
        out["finish_reason"], out["stats"] = chunk["finish_reason"], chunk["stats"]
    if not as_json and out["stats"]:
        print()
        _print_stats(out)
