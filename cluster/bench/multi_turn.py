"""The multi-turn workload of `specserve bench --load multi-turn`: conversations whose history grows, served with
prefix caching on and off.

Each conversation opens with a document (about `history_tokens` tokens of prose, traffic.document) and a request to
summarize it, then asks `turns - 1` follow-up questions, each turn's prompt the whole conversation so far through the
chat template (the answers as the client got them back, decoded), as a chat client sends it. One stream, greedy, the
model's default drafting and k. The arms are two Serve apps, one with `kv_cache.prefix_caching` on (the default) and
one with it off on every pool, started afresh for each of `pairs` pairs in ABBA order (on off, off on), so that a
drift of this machine's speed favours neither; everything else is the same.

Reported per arm and turn: time to first token, the turn's latency and tokens per round; per mode: a conversation's
throughput (tokens over the time its turns took), the second turn's TTFT against the first's, and whether every turn
gave the same tokens with and without caching (greedy: it must).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass

from specserve.cluster.bench.traffic import Timed, document, served, timed_stream
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids

ON, OFF = "cache on", "cache off"
FOLLOW_UPS = (
    "Which two points of that text matter most to someone who runs the system, and why?",
    "What could go wrong there, and how does the text say it is handled?",
    "Say your last answer again in one sentence.",
    "Which single word best describes the design? Explain briefly.",
)


@dataclass(frozen=True)
class MultiTurnConfig:
    conversations: int = 4
    turns: int = 4
    history_tokens: int = 1300  # the first turn's document; with the template and question ~1.4K tokens
    new_tokens: int = 64  # max_tokens of each turn
    pairs: int = 2  # pairs of arms (a Serve app each)


QUICK_MULTI_TURN = MultiTurnConfig(conversations=2, turns=3, pairs=1)


@dataclass
class Turn:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    tokens: int
    tokens_per_round: float
    token_ids: list[int]


def _conversation(client, tokenizer, c: int, cfg: MultiTurnConfig) -> list[Turn]:
    doc = document(tokenizer, cfg.history_tokens, start=5 * c + 1)
    messages = [ChatMessage("user", f"{doc}\n\nSummarize the text above in a few sentences.")]
    turns = []
    for t in range(cfg.turns):
        prompt = chat_prompt_ids(tokenizer, messages)
        timed: Timed = timed_stream(client, prompt, cfg.new_tokens)
        turns.append(Turn(c, t + 1, len(prompt), timed.ttft_s, timed.latency_s, len(timed.token_ids),
                          1 + timed.accepted / max(1, timed.rounds), timed.token_ids))  # fmt: skip
        answer = tokenizer.decode(timed.token_ids, skip_special_tokens=True).strip()
        messages += [ChatMessage("assistant", answer), ChatMessage("user", FOLLOW_UPS[t % len(FOLLOW_UPS)])]
    return turns


def _arm(target: str, draft: str | None, device: str, dtype: str, tokenizer, cfg: MultiTurnConfig,
         caching: bool) -> list[Turn]:  # fmt: skip
    pools = {"kv_cache": {"prefix_caching": caching}}
    with served(target, draft, device, dtype, target_pool=pools, draft_pool=pools) as client:
        for tokens in (300, cfg.history_tokens):  # unmeasured: the workers' cost measurement, the buffers' growth
            doc = document(tokenizer, tokens, start=97)
            timed_stream(client, chat_prompt_ids(tokenizer, [ChatMessage("user", doc + "\n\nWhy?")]), 16)
        return [turn for c in range(cfg.conversations) for turn in _conversation(client, tokenizer, c, cfg)]


def run_multi_turn(target: str, draft: str | None, device: str, dtype: str, tokenizer,
                   cfg: MultiTurnConfig = MultiTurnConfig(), progress: bool = True) -> dict:  # fmt: skip
    """Every arm in ABBA order; the JSON entry (meta['multi_turn'])."""
    order = [m for i in range(cfg.pairs) for m in ((ON, OFF) if i % 2 == 0 else (OFF, ON))]
    arms: dict[str, list[list[Turn]]] = {ON: [], OFF: []}
    for i, mode in enumerate(order):
        if progress:
            print(f"multi-turn: arm {i + 1} of {len(order)} ({mode})", file=sys.stderr, flush=True)
        arms[mode].append(_arm(target, draft, device, dtype, tokenizer, cfg, mode == ON))
    return {"config": asdict(cfg), "order": order, **summary(arms, cfg),
            "arms": {m: [[asdict(t) for t in run] for run in runs] for m, runs in arms.items()}}  # fmt: skip


def summary(arms: dict[str, list[list[Turn]]], cfg: MultiTurnConfig) -> dict:
    """Per mode: mean TTFT, latency and tokens per round by turn; conversation throughput; and the ratios."""
    by_mode = {}
    for mode, runs in arms.items():
        turns = [t for run in runs for t in run]
        per_turn = {}
        for n in range(1, cfg.turns + 1):
            these = [t for t in turns if t.turn == n]
            per_turn[n] = {"ttft_s": statistics.fmean(t.ttft_s for t in these),
                           "latency_s": statistics.fmean(t.latency_s for t in these),
                           "prompt_tokens": statistics.fmean(t.prompt_tokens for t in these),
                           "tokens_per_round": statistics.fmean(t.tokens_per_round for t in these)}  # fmt: skip
        later = [t for t in turns if t.turn > 1]
        by_mode[mode] = {
            "by_turn": per_turn,
            "tokens_per_s": sum(t.tokens for t in turns) / sum(t.latency_s for t in turns),
            "later_turns_tokens_per_round": sum(t.tokens_per_round for t in later) / max(1, len(later)),
            "second_turn_ttft_speedup": per_turn[1]["ttft_s"] / per_turn[min(2, cfg.turns)]["ttft_s"],
        }
    on, off = by_mode[ON], by_mode[OFF]
    outputs = {mode: [[t.token_ids for t in run] for run in runs] for mode, runs in arms.items()}
    every = [o for runs in outputs.values() for o in runs]
    return {
        "modes": by_mode,
        "throughput_vs_off": on["tokens_per_s"] / off["tokens_per_s"],
        "later_turns_tokens_per_round_vs_off": on["later_turns_tokens_per_round"] / off["later_turns_tokens_per_round"],
        "identical": all(run == every[0] for run in every),
    }


def format_multi_turn(entry: dict) -> str:
    lines = [f"{'mode':<10} {'turn':>4} {'prompt':>7} {'TTFT s':>8} {'latency s':>9} {'tok/round':>9}"]
    for mode, m in entry["modes"].items():
        for n, t in m["by_turn"].items():
            lines.append(f"{mode:<10} {n:>4} {t['prompt_tokens']:>7.0f} {t['ttft_s']:>8.2f} {t['latency_s']:>9.2f} "
                         f"{t['tokens_per_round']:>9.2f}")  # fmt: skip
    on, off = entry["modes"][ON], entry["modes"][OFF]
    lines.append(
        f"second turn reaches its first token {on['second_turn_ttft_speedup']:.1f}x faster than the first with caching "
        f"({off['second_turn_ttft_speedup']:.2f}x without); conversation throughput {on['tokens_per_s']:.1f} tok/s "
        f"with caching, {off['tokens_per_s']:.1f} without ({entry['throughput_vs_off']:.2f}x); later turns' tokens per "
        f"round {entry['later_turns_tokens_per_round_vs_off']:.3f}x cache-off's; identical: {entry['identical']}"
    )
    return "\n".join(lines)
