"""The scheduler's chunked prefill alone (no I/O): a prompt longer than the chunk goes to its target worker in calls
of the chunk's size before its first round, each told only its new tokens; short prompts, a request that asks for its
prompt's logprobs and a scheduler without chunking send the prompt with the first round."""

import asyncio
import collections

import pytest

from specserve.cluster.scheduling.prefill import Prefill
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.results import ProposeResult, VerifyResult

SPEC = SpecParams(method="ngram", k=3)


def _chunks(s: Scheduler, req) -> list[tuple[int, int]]:
    out = []
    while (call := s.plan_prefill_chunk(req)) is not None:
        out.append((call.committed_len, len(call.new_tokens)))
        assert call.drafted == [] and not call.want_features
        assert call.expected_len == req.state.prompt_len  # its worker sizes the prompt's KV run once, never moves it
    return out


def test_a_long_prompt_goes_in_chunks_and_the_first_round_sends_the_rest():
    s = Scheduler([], ["t1"], prefill_chunk=32)
    req = s.add(list(range(3, 103)), SamplingParams(max_new_tokens=4), SPEC, frozenset())  # 100 tokens
    assert _chunks(s, req) == [(32, 32), (64, 32), (96, 32)]  # 4 left: the first round's call takes them
    first = s.plan_verify(req, [], b"")
    assert first.committed_len == 100 and len(first.new_tokens) == 4


def test_short_prompts_prompt_logprobs_and_no_chunking_send_the_prompt_with_the_first_round():
    s = Scheduler([], ["t1"], prefill_chunk=32)
    assert _chunks(s, s.add(list(range(3, 35)), SamplingParams(max_new_tokens=4), SPEC, frozenset())) == []
    logprobs = SamplingParams(max_new_tokens=4, prompt_logprobs=2)
    assert _chunks(s, s.add(list(range(3, 103)), logprobs, SPEC, frozenset())) == []
    plain = Scheduler([], ["t1"])
    assert _chunks(plain, plain.add(list(range(3, 103)), SamplingParams(max_new_tokens=4), SPEC, frozenset())) == []


def test_a_resent_chunk_carries_its_whole_prefix():
    s = Scheduler([], ["t1"], prefill_chunk=32)
    req = s.add(list(range(3, 103)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    s.plan_prefill_chunk(req)
    second = s.plan_prefill_chunk(req)
    again = s.resend(req, second)  # the worker lost the request (evicted, restarted)
    assert again.committed_len == 64 and again.new_tokens == list(range(3, 67))


def test_a_later_turn_takes_its_cached_history_over_in_one_call_and_chunks_only_what_is_new():
    """A conversation's next turn: its target worker kept the last turn's cache (prefix caching), as the scheduler
    recorded when that request ended; the first chunk reaches past that history instead of re-sending it a chunk at
    a time, and what is new goes in chunks as before. Another worker's history does not count."""
    s = Scheduler([], ["t1"], prefill_chunk=32)
    first = s.add(list(range(3, 103)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    _chunks(s, first)
    s.plan_verify(first, [], b"")
    s.release(first)  # t1 holds the 100 tokens
    turn = s.add(list(range(3, 103)) + list(range(200, 280)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    assert _chunks(s, turn) == [(128, 128), (160, 32)]  # 96 held (whole 16-token blocks) + 32, then the new rest
    other = Scheduler([], ["t1", "t2"], prefill_chunk=32)
    elsewhere = other.add(list(range(3, 103)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    elsewhere.target_worker = "t2"
    assert _chunks(other, elsewhere)[0] == (32, 32)  # nothing recorded: from the start


def test_two_long_prompts_on_one_worker_prefill_first_come_first_served():
    """The pipeline's Prefill over a real scheduler; the worker calls are stand-ins that take 10 ms. Taking turns chunk
    by chunk, two prompts that overlap each wait about both prompts' time; first come, first served, the first
    finishes in its own and the second in both (vLLM's FCFS). A short prompt never waits behind them: the first
    form of this queued every new request for the worker, and chat streams stalled for a long prompt's prefill."""
    s = Scheduler([], ["t1"], prefill_chunk=32)
    order: list[str] = []

    async def verify(req, call):
        order.append(req.request_id)
        await asyncio.sleep(0.01)
        return VerifyResult(accepted=0, next_token=5, batch_rows=1, batch_tokens=1, batch_seconds=0.01)

    async def propose(req, call):
        return ProposeResult(drafted=[])

    async def main():
        prefill = Prefill(s, None, verify, propose, collections.defaultdict(asyncio.Lock))
        a = s.add(list(range(3, 131)), SamplingParams(max_new_tokens=4), SPEC, frozenset())  # 4 chunks of 32
        b = s.add(list(range(5, 133)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
        first = asyncio.ensure_future(prefill.run(a))
        await asyncio.sleep(0.015)  # b arrives while a's second chunk runs
        second = asyncio.ensure_future(prefill.run(b))
        chat = s.add(list(range(3, 23)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
        await asyncio.wait_for(prefill.run(chat), 0.005)  # a short prompt has no chunk to queue for
        await asyncio.gather(first, second)
        return a.request_id, b.request_id

    a, b = asyncio.run(main())
    assert order == [a] * 3 + [b] * 3, order  # the fourth chunk of each goes with its first round


def test_the_next_chunk_is_at_the_worker_before_the_one_ahead_is_answered_and_each_feed_follows_its_chunk():
    """One chunk ahead: each chunk's call is made while the one before it runs, never two ahead, in order; each
    chunk's feed to the draft worker goes once that chunk is answered, and the prefill returns with every chunk
    answered and fed."""
    s = Scheduler(["d1"], ["t1"], prefill_chunk=32)
    in_flight, most, events = [0], [0], []
    passes = None

    async def verify(req, call):  # the worker runs one pass at a time
        nonlocal passes
        passes = passes or asyncio.Lock()
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        events.append(("sent", call.committed_len))
        async with passes:
            await asyncio.sleep(0.01)
        in_flight[0] -= 1
        events.append(("answered", call.committed_len))
        return VerifyResult(accepted=0, next_token=5, batch_rows=1, batch_tokens=32, batch_seconds=0.01)

    async def propose(req, call):
        events.append(("fed", call.committed_len - 1))
        return ProposeResult(drafted=[])

    async def main():
        prefill = Prefill(s, None, verify, propose, collections.defaultdict(asyncio.Lock))
        req = s.add(list(range(3, 131)), SamplingParams(max_new_tokens=4), SpecParams(method="draft", k=3),
                    frozenset())  # fmt: skip
        await prefill.run(req)

    asyncio.run(main())
    assert most[0] == 2
    sent = [n for kind, n in events if kind == "sent"]
    assert sent == [32, 64, 96]  # the 32 left go with the first round
    assert events.index(("sent", 64)) < events.index(("answered", 32))
    assert events.index(("sent", 96)) < events.index(("answered", 64))
    for n in sent:
        assert events.index(("answered", n)) < events.index(("fed", n))
    assert events[-1] == ("fed", 96)


def test_a_chunk_that_fails_fails_the_prefill_and_the_chunk_sent_after_it_is_dropped():
    """A chunk's error that is not a lost worker (a full cache after its wait, say) ends the request's prefill with it;
    the next chunk, already sent, is cancelled rather than left running with an error nobody reads."""
    from specserve.workers.errors import KVCapacityError

    s = Scheduler([], ["t1"], prefill_chunk=32)
    cancelled = []

    async def verify(req, call):
        if call.committed_len == 32:
            await asyncio.sleep(0.01)
            raise KVCapacityError("no room")
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append(call.committed_len)
            raise

    async def propose(req, call):
        return ProposeResult(drafted=[])

    async def main():
        prefill = Prefill(s, None, verify, propose, collections.defaultdict(asyncio.Lock))
        req = s.add(list(range(3, 131)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
        with pytest.raises(KVCapacityError):
            await asyncio.wait_for(prefill.run(req), 2)
        assert cancelled == [64]  # by the time the prefill's error is raised

    asyncio.run(main())


def test_decoding_rounds_beside_a_prompts_chunks_draft_only_what_beats_the_chunks_positions():
    """k='auto' chains on a worker where a long prompt prefills: their plan counts its next chunk in the pass (its
    positions as tokens, its fitted seconds), so beside a chunk whose positions cost 2 ms each they draft less than
    alone; once the prompt's first round is in they draft as before."""
    from specserve.workers.speculation.planner.acceptance import PositionAcceptance
    from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts
    from tests.helpers.cost_surfaces import cpu_surface

    s = Scheduler(["d1"], ["t1"], prefill_chunk=128)
    s.planner_costs = PlannerCosts(cpu_surface(), draft=DraftCost(step_s=0.003, fixed_s=0.002))
    auto = SpecParams(method="draft", k="auto")
    chats = [s.add(list(range(3, 23)), SamplingParams(max_new_tokens=200), auto, frozenset()) for _ in range(4)]
    for chat in chats:
        chat.planner.draft = PositionAcceptance((0.7, 0.6, 0.5, 0.4))
    for _ in range(3):  # the prompt's round, the drafter's catch-up, then a steady round of 0.1 s each
        for chat in chats:
            k = s.plan_round(chat).k
            s.apply_round(chat, chat.round, VerifyResult(0, 7), [3] * k, round_s=0.1)
    alone = [s.plan_round(chat).k for chat in chats]
    assert min(alone) > 0
    long = s.add(list(range(3, 1003)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    for _ in range(3):  # chunks whose positions cost 2 ms each beside a 50 ms fixed part
        call = s.plan_prefill_chunk(long)
        n = len(call.new_tokens)
        s.prefilled(long, call, VerifyResult(0, 5, batch_rows=5, batch_tokens=n, batch_seconds=0.05 + 0.002 * n))
    beside = [s.plan_round(chat).k for chat in chats]
    assert max(beside) < min(alone), (alone, beside)
    long.told["t1"] = list(long.state.tokens)
    s.apply_round(long, s.plan_round(long), VerifyResult(0, 7), [], round_s=0.5)  # its first round: prefill over
    assert [s.plan_round(chat).k for chat in chats] == alone


def test_head_trees_that_would_not_pay_beside_a_prompts_chunk_are_not_drafted_and_stream_plain_rounds():
    """eagle-tree k='auto' chats on a worker where a long prompt prefills: a tree like their latest would be pruned to
    nothing beside its chunk, so they draft none (the drafting would hold the chunk's pass for a plain step) and run
    plain rounds from one Decode call (`plain_steps`), without backing off: once the prompt's first round is in they
    draft trees again at once."""
    import math

    import torch

    from specserve.workers.runtime.tree_rows import ROOT
    from specserve.workers.speculation.codec import feature_block
    from specserve.workers.speculation.draft_tree import DraftTree
    from specserve.workers.speculation.planner.costs import PlannerCosts
    from tests.helpers.cost_surfaces import cpu_surface

    s = Scheduler(["d1"], ["t1"], prefill_chunk=128, decode_steps=8)
    s.planner_costs = PlannerCosts(cpu_surface())
    auto = SpecParams(method="eagle-tree", k="auto")
    chats = [s.add(list(range(3, 23)), SamplingParams(max_new_tokens=200), auto, frozenset()) for _ in range(4)]
    tree = DraftTree([10, 11, 12], [ROOT, 0, 1], [math.log(0.5), math.log(0.3), math.log(0.15)])
    drafted = []

    def round_(chat) -> int:
        """One round as the pipeline runs it: the head's features in, the plan, a tree drafted and pruned."""
        chat.features.received(feature_block(0, torch.zeros(len(chat.state.tokens), 6)).encode())
        plan = s.plan_round(chat)
        pruned = s.prune_tree(chat, tree) if plan.nodes else None
        drafted.append(bool(plan.nodes))
        s.apply_round(chat, plan, VerifyResult(0, 7, path=[]), tree=pruned, round_s=0.1)
        return len(pruned.tokens) if pruned is not None else 0

    for _ in range(3):  # the prompts' rounds, then trees that keep nodes
        kept = [round_(chat) for chat in chats]
    assert min(kept) > 0
    long = s.add(list(range(3, 1003)), SamplingParams(max_new_tokens=4), SpecParams(method="ngram", k=3), frozenset())
    for _ in range(3):  # chunks whose positions cost 2 ms each beside a 50 ms fixed part: cheap to displace
        call = s.plan_prefill_chunk(long)
        n = len(call.new_tokens)
        s.prefilled(long, call, VerifyResult(0, 5, batch_rows=5, batch_tokens=n, batch_seconds=0.05 + 0.002 * n))
    drafted.clear()
    for _ in range(3):
        assert [round_(chat) for chat in chats] == [0] * 4
        assert [chat.round.k for chat in chats] == [0] * 4  # no lookup's round breaks the stream either
        assert [s.plain_steps(chat, chat.round) for chat in chats] == [8] * 4  # one Decode call each
    assert not any(drafted) and all(chat.pruning.plain_rounds == 0 for chat in chats)
    long.told["t1"] = list(long.state.tokens)
    s.apply_round(long, s.plan_round(long), VerifyResult(0, 7), [], round_s=0.5)  # its first round: prefill over
    assert all(s.plan_round(chat).nodes for chat in chats)
    assert [s.plain_steps(chat, chat.round) for chat in chats] == [1] * 4


def test_while_a_heads_rounds_are_plain_beside_a_chunk_no_lookup_round_breaks_their_stream(monkeypatch):
    """eagle-tree+ngram: a prompt lookup's continuation that would pay beside a dear chunk is not verified while the
    head's trees are plain there (the judgement forced: `TreePruning.pays_beside`, tested above), or backed off:
    ending the plain steps' stream for it costs the request a whole pass. Without the chunk the lookup goes as
    before."""
    import torch

    from specserve.workers.speculation.codec import feature_block
    from specserve.workers.speculation.planner.costs import PlannerCosts
    from specserve.workers.speculation.planner.tree import TreePruning
    from tests.helpers.cost_surfaces import cpu_surface

    monkeypatch.setattr(TreePruning, "wants_tree", lambda self: True)
    monkeypatch.setattr(TreePruning, "pays_beside", lambda self, *a: False)
    s = Scheduler(["d1"], ["t1"], prefill_chunk=128, decode_steps=8)
    s.planner_costs = PlannerCosts(cpu_surface())
    auto = SpecParams(method="eagle-tree+ngram", k="auto")
    chat = s.add([3, 4, 5, 6] * 3 + list(range(10, 20)), SamplingParams(max_new_tokens=200), auto, frozenset())

    def plan():
        chat.features.received(feature_block(0, torch.zeros(len(chat.state.tokens), 6)).encode())
        return s.plan_round(chat)

    for token in (3, 4, 5):  # its history ends "3 4 5": the prompt continues it with "6 3 4 5 ..."
        s.apply_round(chat, plan(), VerifyResult(0, token), round_s=0.1)
    assert plan().drafted  # alone: the lookup's round
    long = s.add(list(range(3, 1003)), SamplingParams(max_new_tokens=4), SpecParams(method="ngram", k=3), frozenset())
    for _ in range(3):  # chunks whose positions cost 100 ms each: a lookup's tokens would pay beside them
        call = s.plan_prefill_chunk(long)
        n = len(call.new_tokens)
        s.prefilled(long, call, VerifyResult(0, 5, batch_rows=2, batch_tokens=n, batch_seconds=0.05 + 0.1 * n))
    beside = plan()
    assert beside.k == 0 and chat.pruning.plain_beside and s.plain_steps(chat, beside) == 8
    monkeypatch.setattr(TreePruning, "wants_tree", lambda self: False)  # backed off: the same beside the chunk
    beside = plan()
    assert beside.k == 0 and chat.pruning.plain_beside and s.plain_steps(chat, beside) == 8
    long.told["t1"] = list(long.state.tokens)
    s.apply_round(long, s.plan_round(long), VerifyResult(0, 7), [], round_s=0.5)  # its first round: prefill over
    assert plan().drafted and not chat.pruning.plain_beside  # backed off alone: the lookup goes as before
