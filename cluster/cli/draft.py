"""`specserve draft train` and `specserve draft eval`: an EAGLE-3 head from nothing but its target, and how well it
drafts on the bench's held-out chat questions. Training code is imported inside the command, never by serving."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("draft", help="train or evaluate an EAGLE-3 draft head")
    commands = p.add_subparsers(dest="draft_command", required=True)
    _add_train(commands, common)
    _add_eval(commands, common)


def _add_train(commands, common) -> None:
    p = commands.add_parser("train", parents=common,
                            help="generate training data from the target, then train a head on it (both resume)",
                            description="Data: the target answers its own Magpie-style questions and the training "
                            "half of the built-in chat questions (never the held-out half); its features are recorded. "
                            "Training: SpecForge's recipe (training-time test, loss against the target's distribution "
                            "on the draft vocabulary). Both stop and resume: run the same command again.")  # fmt: skip
    p.add_argument(
        "--target",
        required=True,
        metavar="NAME|PATH|ORG/NAME",
        help="known model name, .gguf file, directory or Hugging Face repo id org/name[@revision]",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the head's directory (checkpoints live there too)")
    p.add_argument("--data", metavar="DIR", help="training data directory (default $SPECSERVE_HOME/eagle-data/<id>)")
    p.add_argument("--answer-tokens", type=int, default=300_000, help="answer tokens of data to generate first")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (ignored with --steps)")
    p.add_argument("--steps", type=int, help="optimizer steps in all (instead of --epochs)")
    p.add_argument("--ttt-steps", type=int, default=4, help="drafting steps unrolled in training (training-time test)")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="tokens the head's lm_head covers")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=_train)


def _add_eval(commands, common) -> None:
    p = commands.add_parser("eval", parents=common,
                            help="per-position acceptance of a head on held-out chat questions (greedy)")  # fmt: skip
    p.add_argument("--target", required=True, metavar="NAME|PATH|ORG/NAME")
    p.add_argument("--head", default="eagle", metavar="DIR",
                   help="the head's directory (default: the head packaged for the target)")  # fmt: skip
    p.add_argument("-k", type=int, default=5, help="drafts per round")
    p.add_argument("--questions", type=int, default=12, help="how many held-out questions")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--record", action="store_true",
                   help="write the head's measured acceptance into its config.json (the k policy's prior)")  # fmt: skip
    p.set_defaults(func=_eval)


def _train(args: argparse.Namespace) -> int:
    import torch

    from specserve.workers.models.catalog import resolve_model
    from specserve.workers.models.identity import target_identity
    from specserve.workers.training.eagle_data import default_data_dir, generate_data
    from specserve.workers.training.eagle_train import train_head

    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_model(args.target)
    data = args.data or default_data_dir(target_identity(target))
    generate_data(target, data, args.answer_tokens, device=args.device)
    result = train_head(data, target, args.out, steps=args.steps, epochs=args.epochs, ttt_steps=args.ttt_steps,
                        draft_vocab_size=args.draft_vocab_size, lr=args.lr, batch_tokens=args.batch_tokens,
                        seed=args.seed, device=args.device, bf16=args.device == "cuda")  # fmt: skip
    accuracy = " ".join(f"{a:.3f}" for a in result.accuracy)
    print(f"head saved to {result.head_dir} after {result.steps} steps; accuracy by drafting step: {accuracy}")
    print(f"measure it: specserve draft eval --target {args.target} --head {result.head_dir}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from specserve.cluster.bench.head_eval import format_acceptance, held_out_acceptance
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.models.catalog import resolve_model
    from specserve.workers.models.packaged_heads import resolve_head
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.speculation.eagle.checkpoint import record_acceptance
    from specserve.workers.speculation.engine import SpecEngine

    target_path = resolve_model(args.target)
    head_dir = resolve_head(args.head, target_path)
    engine = SpecEngine(load_model(ModelConfig(path=target_path)), eagle_head=head_dir)
    rows = []
    for method in ("ngram", "eagle", "eagle+ngram"):
        rows.append(held_out_acceptance(engine, method, args.k, args.questions, args.max_new_tokens))
        print(f"{method}: done", file=sys.stderr)
    print(f"{head_dir} on {args.questions} held-out questions, greedy, {args.max_new_tokens} new tokens")
    print(format_acceptance(rows))
    given = " ".join(f"{a:.3f}" for a in rows[1].given)
    print(f"head acceptance given the previous position accepted: {given}")
    if args.record:
        record_acceptance(head_dir, rows[1].given)
        print(f"recorded in {head_dir / 'config.json'}")
    return 0
