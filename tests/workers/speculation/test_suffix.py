"""Suffix drafting's structure (pure): the longest earlier match wins, drafts follow its support, caches are bounded.
Identity with target-only: tests/workers/speculation/test_engine_greedy.py, test_engine_sampling.py and
tests/cluster/scheduling/test_pipeline.py."""

import pytest

from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.suffix import (
    SuffixCache,
    SuffixConfig,
    SuffixIndex,
    SuffixLookup,
    suffix_draft,
)


def draft(context, cache=None, limit=8, **config):
    config = SuffixConfig(**config)
    return suffix_draft(context, SuffixIndex(context), cache or SuffixCache(config), limit, config)


def test_the_longest_earlier_match_in_the_request_is_drafted_as_far_as_it_matched():
    # "1 2 3" occurred before, followed by 4 5 6; "9 2 3" too, followed by 7: the longer match wins
    context = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3]
    out = draft(context)
    assert (out.match, out.tokens) == (3, (4, 5, 6))  # at most 1.0 token per matched token
    assert draft(context, max_spec_factor=2.0).tokens == (4, 5, 6, 9, 2, 3)
    assert draft(context, limit=2).tokens == (4, 5)
    assert draft([1, 2, 3, 4]).match == 0  # nothing occurred before
    assert draft([5, 6, 5, 6], max_depth=2).match == 2  # the match is capped at max_depth


def test_a_draft_stops_where_the_occurrences_disagree_below_min_token_prob():
    cache = SuffixCache()
    for i, ending in enumerate([[7, 8, 9], [7, 8, 9], [7, 5, 5], [7, 8, 9]]):
        cache.remember(f"r{i}", [1, 2, 3, *ending])
    out = draft([0, 1, 2, 3], cache, max_spec_factor=2.0)
    assert out.tokens == (7, 8, 9) and out.shares == (1.0, 0.75, 1.0)
    assert draft([0, 1, 2, 3], cache, max_spec_factor=2.0, min_token_prob=0.8).tokens == (7,)


def test_the_cache_is_bounded_by_count_and_tokens_oldest_first_and_remembers_the_prompts_end():
    cache = SuffixCache(SuffixConfig(max_cached_requests=2, max_cached_tokens=10, max_depth=2))
    cache.remember("a", [1, 2, 3])
    cache.remember("b", [4, 5, 6])
    cache.remember("c", [7, 8, 9])
    assert len(cache) == 2 and cache.tokens == 6 and [i.tokens for i in cache.indexes()] == [[7, 8, 9], [4, 5, 6]]
    cache.remember("d", [1] * 8)  # 14 tokens would be over 10: the oldest go
    assert cache.tokens <= 10 and cache.indexes()[0].tokens == [1] * 8
    cache.remember_request("e", [9, 9, 9, 4, 4, 20, 21], prompt_len=5)  # the prompt's last max_depth tokens kept
    assert cache.indexes()[0].tokens == [4, 4, 20, 21]
    assert SuffixLookup(cache).draft([0, 4, 4], 4).tokens == (20, 21)
    cache.forget("e")
    assert all(i.tokens != [4, 4, 20, 21] for i in cache.indexes())
    with pytest.raises(InvalidRequestError, match="max_depth"):
        SuffixConfig(max_depth=0)
