"""Prefix caching over real gRPC workers: a conversation's second turn (its history, the first answer, a new
question) takes the first turn's caches over on the target worker and on the draft worker (a draft model's KV, an
EAGLE-3 head's cache), computes only what follows, and decodes exactly what target-only decoding does. The head is
not hurt by the hit: its turn drafts and accepts as with no cache at all (the sglang #31600 failure: a target prefix
hit without the head's cache)."""

import asyncio

import pytest

from specserve.cluster.scheduling.worker_clients import TargetClient
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.runtime.kv_cache import RETAIN_LESS
from tests.helpers.eagle_disaggregated import build_pairs, prompts_of, sample_disaggregated
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.marks import slow_unless
from tests.helpers.pipelines import generate_all, generate_beside, generate_in_turns
from tests.helpers.sampling_oracle import NEW, PROMPT, chi2_pvalue, exact_joint, marginal_tv
from tests.helpers.workers import LocalWorkers, load_pair

N = 24


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, device) -> dict:
    return build_pairs(tmp_path_factory.mktemp("prefix_pairs"), device)


async def _two_turns(w: LocalWorkers, prompt: list[int], spec: SpecParams, prefill_chunk: int | None = None):
    """Turn 1, then turn 2 over turn 1's history and answer plus a question; returns (turn 1, turn 2) requests."""
    (first,), _ = await generate_all(w, [(prompt, SamplingParams(max_new_tokens=N), spec)], prefill_chunk=prefill_chunk)
    history = prompt + first.state.generated + [ord(c) + 3 for c in "\nand then?"]  # byte tokens: ids are bytes + 3
    (second,), _ = await generate_all(w, [(history, SamplingParams(max_new_tokens=N), spec)],
                                      prefill_chunk=prefill_chunk)  # fmt: skip
    return first, second


def test_a_second_turn_reuses_the_first_on_target_and_draft_model(models_dir, tiny_target, device):
    target, draft = load_pair(tiny_target, models_dir, device, "prefix_draft")
    prompt = target.tokenizer("def fibonacci(n):\n    if n < 2:")["input_ids"]

    async def main():
        async with LocalWorkers(target, [draft]) as w:
            first, second = await _two_turns(w, prompt, SpecParams(method="draft", k=3))
            health = await TargetClient(w.target_addresses["target-0"]).health()  # over gRPC, as operators see it
            return first, second, w.targets["target-0"].verifier.runner.store, w.drafts["draft-0"].store, health

    first, second, target_store, draft_store, health = asyncio.run(main())
    assert (health.prefix_cache_hits, health.prefix_cache_queries) == (target_store.prefix_hits,
                                                                      target_store.prefix_queries)  # fmt: skip
    assert 0 < health.prefix_cache_hits < health.prefix_cache_queries
    for req in (first, second):
        assert req.state.generated == own_greedy_loop(target.model, req.state.tokens[: req.state.prompt_len], N, set())
    # turn 1's cache: its prompt and answer, less the last token (never fed back), less what release leaves out
    kept = len(prompt) + N - 1 - RETAIN_LESS
    assert kept >= 16 and target_store.prefix_hits >= kept - 4 and draft_store.prefix_hits >= kept - 4
    assert second.state.stats.drafted > 0


def test_a_heads_second_turn_takes_its_first_turns_cache_and_drafts_as_without_caching(pairs):
    target, head_dir = pairs["byte"]
    prompt = prompts_of(target, "byte")[2]  # the longest prompt

    async def turns(prefix_caching: bool):
        async with LocalWorkers(target, [], eagle_head=head_dir, prefix_caching=prefix_caching) as w:
            first, second = await _two_turns(w, prompt, SpecParams(method="eagle", k=3))
            return first, second, w.targets["target-0"].verifier.runner.store, w.drafts["draft-0"].drafter

    first, second, store, head = asyncio.run(turns(True))
    _, second_off, store_off, head_off = asyncio.run(turns(False))
    history = second.state.prompt_len
    assert (
        second.state.generated
        == second_off.state.generated
        == own_greedy_loop(target.model, second.state.tokens[:history], N, set())
    )
    assert store.prefix_hits > len(prompt) - RETAIN_LESS and store_off.prefix_hits == 0
    assert head.prefix_hits == store.prefix_hits and head_off.prefix_hits == 0  # the head's cache came along
    # the head drafted and accepted on turn 2 exactly as when everything was computed again
    on, off = second.state.stats, second_off.state.stats
    assert (on.rounds, on.drafted, on.accepted) == (off.rounds, off.drafted, off.accepted)
    # only the new tokens' features travelled on turn 2
    assert second.features.traffic.received_bytes < second_off.features.traffic.received_bytes / 2


def test_a_chunked_second_turn_keeps_its_whole_cached_history_and_the_heads(pairs):
    """Chunks of 24 over a cached history: the first chunk takes the history over and each later one holds its spare
    positions again (kv_cache.py), computing only its last position; decoding and drafting as without caching."""
    target, head_dir = pairs["byte"]
    prompt = prompts_of(target, "byte")[2]

    async def turns(prefix_caching: bool):
        async with LocalWorkers(target, [], eagle_head=head_dir, prefix_caching=prefix_caching) as w:
            runner = w.targets["target-0"].verifier.runner
            spec = SpecParams(method="eagle", k=3)
            (first,), _ = await generate_all(w, [(prompt, SamplingParams(max_new_tokens=N), spec)], prefill_chunk=24)
            history = prompt + first.state.generated + [ord(c) + 3 for c in "\nand then?"]
            before = runner.forward_positions
            (second,), _ = await generate_all(w, [(history, SamplingParams(max_new_tokens=N), spec)], prefill_chunk=24)
            return second, runner.forward_positions - before, runner.store.prefix_hits

    second, computed, hits = asyncio.run(turns(True))
    second_off, computed_off, _ = asyncio.run(turns(False))
    assert second.state.prompt_len > 3 * 24
    assert (
        second.state.generated
        == second_off.state.generated
        == own_greedy_loop(target.model, second.state.tokens[: second.state.prompt_len], N, set())
    )
    assert hits >= len(prompt) - RETAIN_LESS  # the whole kept history, not the first chunk's share of it
    assert computed < computed_off - hits + second.state.prompt_len // 24 + 1
    on, off = second.state.stats, second_off.state.stats
    assert (on.rounds, on.drafted, on.accepted) == (off.rounds, off.drafted, off.accepted)


@pytest.mark.parametrize("method", slow_unless(["draft", "eagle"], ["eagle"]))  # draft: in CI
def test_a_request_beside_a_running_one_with_its_prompt_copies_it_on_target_and_drafter(pairs, models_dir, tiny_target,
                                                                                       device, method):  # fmt: skip
    """Two requests with one long prompt (a system prompt, a document), the second sent while the first decodes: the
    second copies the first's cached prompt on the target worker and on the draft worker (a draft model's KV, the
    head's entries), computes only its own question, and both decode exactly as target-only decoding does. The head's
    request drafts from the copied entries: it drafts and accepts as with prefix caching off."""
    if method == "draft":
        target, draft = load_pair(tiny_target, models_dir, device, "prefix_draft")
        prompt, drafts, head_dir = target.tokenizer("def fibonacci(n):\n    if n < 2:" * 3)["input_ids"], [draft], None
    else:
        (target, head_dir), drafts = pairs["byte"], []
        prompt = prompts_of(target, "byte")[2]
    spec, long = SpecParams(method=method, k=3), SamplingParams(max_new_tokens=8 * N)
    question = [ord(c) + 3 for c in "\nand then?"] if method == "eagle" else target.tokenizer(" # why")["input_ids"]

    async def beside(prefix_caching: bool):
        async with LocalWorkers(target, drafts, eagle_head=head_dir, prefix_caching=prefix_caching) as w:
            runner = w.targets["target-0"].verifier.runner
            before = runner.forward_positions
            joining = (prompt + question, SamplingParams(max_new_tokens=N), spec)
            first, second = await generate_beside(w, (prompt, long, spec), joining)
            drafter = w.drafts["draft-0"]
            drafter_store = drafter.drafter if method == "eagle" else drafter.store
            return first, second, runner.store, drafter_store, runner.forward_positions - before

    first, second, store, drafter_store, computed = asyncio.run(beside(True))
    _, second_off, _, _, computed_off = asyncio.run(beside(False))
    assert first.state.generated[:N] == own_greedy_loop(target.model, prompt, N, set())
    assert second.state.generated == second_off.state.generated == own_greedy_loop(target.model, prompt + question,
                                                                                    N, set())  # fmt: skip
    assert not first.state.finished or first.state.stats.rounds > second.state.stats.rounds  # it ran beside
    shared = len(prompt) - 17  # the prompt's whole blocks less the one position a head cannot give (prefixes.py)
    assert store.prefix_copies == 1 and store.prefix_hits >= shared
    assert computed <= computed_off - shared
    assert drafter_store.prefix_hits >= shared  # the drafter's copy too
    if method == "eagle":
        on, off = second.state.stats, second_off.state.stats
        assert (on.rounds, on.drafted, on.accepted) == (off.rounds, off.drafted, off.accepted)
    else:
        assert drafter_store.prefix_copies == 1


@pytest.mark.slow
def test_a_heads_turn_after_a_target_only_turn_drafts_as_without_caching(pairs):
    """Turn 1 decoded target-only leaves the target worker a cached history the head never saw; turn 2 with the head
    takes from it only what the draft worker's head holds (nothing: the scheduler's prefix_at_most), so the head
    reads the whole history and drafts and accepts exactly as with prefix caching off."""
    target, head_dir = pairs["tiny_vocab"]  # a head a third of whose drafts are accepted
    prompt = prompts_of(target, "tiny_vocab")[2] * 2  # 28 tokens: past PREFIX_MIN_TOKENS

    async def turns(prefix_caching: bool):
        def turns(done):
            if len(done) == 2:
                return None
            if not done:
                return prompt, SamplingParams(max_new_tokens=N), SpecParams(method="none")
            history = prompt + done[0].state.generated + [4, 6, 3]
            return history, SamplingParams(max_new_tokens=N), SpecParams(method="eagle", k=3)

        async with LocalWorkers(target, [], eagle_head=head_dir, prefix_caching=prefix_caching) as w:
            _, second = await generate_in_turns(w, turns)  # one scheduler: it saw turn 1 leave its history there
            return second, w.drafts["draft-0"].drafter

    second, head = asyncio.run(turns(True))
    second_off, _ = asyncio.run(turns(False))
    assert second.state.generated == second_off.state.generated
    on, off = second.state.stats, second_off.state.stats
    assert (on.rounds, on.drafted, on.accepted) == (off.rounds, off.drafted, off.accepted) and on.accepted > 0
    assert head.prefix_queries == 0  # the target served no position the head lacked


@pytest.mark.slow  # a statistical test of 17 s on 2 cores: the full suite runs it, the fast loop stays under 5 min
def test_sampling_with_prefix_hits_matches_the_targets_distribution(pairs):
    """2,000 seeded requests of one 56-token prompt, 64 at a time, through a head draft worker and a target: every
    request after the first batch takes a released one's cache over on both workers (hits), and the sampled next 3
    tokens still follow target-only sampling's exact joint (the chi-square test of test_engine_sampling.py)."""
    target, head_dir = pairs["tiny_vocab"]
    prompt = PROMPT + [3, 4, 5, 3, 4, 6, 7, 3] * 6 + [4, 3]  # repeats: prompt lookup and the head have something
    samples, stores = 2000, []
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, stop_at_eos=False)
    results = sample_disaggregated(target, head_dir, params, SpecParams(method="eagle", k=2), samples, prompt, stores)
    assert stores[0].prefix_hits > (samples - 64) * (len(prompt) - RETAIN_LESS)  # nearly every request hit
    outputs = [tuple(r.state.generated) for r in results]
    joint = exact_joint(target.model, params, target.model.config.vocab_size, prompt)
    assert sum(r.state.stats.accepted for r in results) > 0.1 * samples  # measured: 0.17 a request
    assert chi2_pvalue(outputs, joint) > 1e-3
    for pos in range(NEW):
        assert marginal_tv(outputs, joint, pos, target.model.config.vocab_size) <= 0.04
