"""Stop sequences and stop token ids over committed tokens, one token at a time (pure, with a toy detokenizer):
cut at the first stop wherever a round's tokens end, held back only while a stop could still begin."""

from specserve.cluster.scheduling.stops import StopMatcher, StopSpec

# A toy vocabulary: token i decodes to TEXT[i].
TEXT = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: " E", 7: "ND", 8: "<eot>", 9: "\n\n"}


def text_of(tokens: list[int], final: bool) -> str:
    return TEXT[tokens[-1]]


def run(spec: StopSpec, rounds: list[list[int]], finished_after: int | None = None):
    """Feed the rounds; returns (chunks of text, token ids kept, stopped)."""
    matcher, generated, texts, kept = StopMatcher(spec, text_of), [], [], []
    for i, new in enumerate(rounds):
        generated += new
        cut = matcher.feed(generated, len(new), final=i == finished_after)
        texts.append(cut.text)
        kept += new[: cut.tokens]
        if cut.stopped:
            return texts, kept, True
    return texts, kept, False


def test_a_stop_that_straddles_rounds_cuts_there_and_drops_the_rest_of_its_round():
    texts, kept, stopped = run(StopSpec(("world",)), [[1, 2, 3], [4, 5, 6]])
    assert stopped and "".join(texts) == "Hello " and kept == [1, 2, 3, 4]  # ids up to the token completing it
    assert texts == ["Hello ", ""]  # "wor" was held back: it could begin "world"


def test_include_stop_str_in_output_keeps_it_and_the_earliest_stop_wins():
    texts, kept, _ = run(StopSpec(("ld!", "wor"), include_in_output=True), [[1, 2, 3, 4, 5]])
    assert "".join(texts) == "Hello wor" and kept == [1, 2, 3]
    texts, kept, _ = run(StopSpec(("lo", "ello")), [[1, 2]])
    assert "".join(texts) == "H" and kept == [1, 2]  # "ello" starts first


def test_held_text_is_released_when_it_stops_being_a_prefix_and_when_the_request_ends():
    texts, kept, stopped = run(StopSpec(("ENDX",)), [[1, 6], [7], [5]], finished_after=2)
    assert not stopped and texts == ["Hel ", "", "END!"] and kept == [1, 6, 7, 5]
    texts, _, _ = run(StopSpec(("ENDX",)), [[1, 6, 7]], finished_after=0)
    assert texts == ["Hel END"]  # the last round flushes what it held


def test_a_stop_token_id_ends_like_eos_even_as_a_rounds_bonus_token():
    texts, kept, stopped = run(StopSpec(token_ids=frozenset({8})), [[1, 2], [3, 8, 4]])
    assert stopped and "".join(texts) == "Hello wor" and kept == [1, 2, 3, 8]
    texts, _, _ = run(StopSpec(token_ids=frozenset({8}), include_in_output=True), [[1, 8]])
    assert "".join(texts) == "Hel<eot>"


def test_without_a_stop_nothing_is_held_or_cut():
    texts, kept, stopped = run(StopSpec(("xyz",)), [[1, 2], [3, 4]], finished_after=1)
    assert not stopped and texts == ["Hello", " world"] and kept == [1, 2, 3, 4]


def test_no_stop_string_ends_an_output_shorter_than_min_tokens():
    texts, kept, stopped = run(StopSpec(("lo",), min_tokens=3), [[1, 2, 3], [4, 1, 2]])
    assert stopped and "".join(texts) == "Hello world" + "Hel" and kept == [1, 2, 3, 4, 1, 2]
    texts, kept, stopped = run(StopSpec(("lo",), min_tokens=2), [[1, 2, 3]])
    assert stopped and "".join(texts) == "Hel" and kept == [1, 2]  # the second token may end it
