"""The `specserve` command line: the parser and the dispatch. Each command lives in its own module (generate, serve,
models, bench, draft, wheelhouse) and imports what it runs (torch, transformers, Ray, the Serve app) inside the
command, so `--help`, `models list` and `generate` against a server start without them."""

from __future__ import annotations

import argparse
import logging
import sys

from specserve.cluster.cli import bench, draft, generate, models, serve, wheelhouse
from specserve.workers.errors import SpecServeError

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Long-running commands report progress in their logs; the others print results, with warnings only.
_INFO_COMMANDS = ("serve", "gateway", "draft")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_level_parent(default: str | None) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--log-level", type=str.upper, choices=LEVELS, default=default,
                        help="level of specserve's own logs on stderr (default: INFO for serve and gateway, "
                             "WARNING otherwise; other libraries log at WARNING)")  # fmt: skip
    return parent


def build_parser() -> argparse.ArgumentParser:
    # --log-level is taken before or after the command; the command's copy leaves an earlier value alone.
    parser = argparse.ArgumentParser(prog="specserve", description="Disaggregated speculative decoding on Ray Serve",
                                     parents=[_log_level_parent(None)])  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_log_level_parent(argparse.SUPPRESS)]
    generate.add_parser(sub, common)
    serve.add_parsers(sub, common)
    bench.add_parser(sub, common)
    bench.add_gpu_check_parser(sub, common)
    models.add_parser(sub, common)
    draft.add_parser(sub, common)
    wheelhouse.add_parser(sub, common)
    return parser


def configure_logging(command: str, level: str | None) -> None:
    """Log to stderr once per process; a program that set up logging itself (or pytest) keeps its own setup."""
    if logging.getLogger().handlers:
        return
    logging.basicConfig(level=logging.WARNING, format=_LOG_FORMAT)
    logging.getLogger("specserve").setLevel(level or ("INFO" if command in _INFO_COMMANDS else "WARNING"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.command, args.log_level)
    try:
        return args.func(args)
    except SpecServeError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
