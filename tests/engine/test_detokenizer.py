"""``IncrementalDetokenizer`` with a tiny byte-level fake tokenizer (no model, no downloads)."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer

BOS = 0
VOCAB: dict[int, bytes] = {
    BOS: b"<s>",
    1: b"Hello",
    2: b" wor",
    3: b"ld",
    4: b" ST",
    5: b"OP",
    6: b" more",
    7: b"\xc3",        # first byte of "é" (U+00E9)
    8: b"\xa9",        # second byte of "é"
    9: b"!",
    10: b" S",
    11: b"T",
    12: b"\xe2\x82",   # first two bytes of "€" (U+20AC)
    13: b"\xac",
}
SPECIAL = {BOS}


class FakeTokenizer:
    """Byte-level decode like a BPE tokenizer: invalid UTF-8 tails decode to "\\ufffd"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = b"".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))
        return data.decode("utf-8", errors="replace")


def stream(token_ids: list[int], stop: tuple[str, ...] = (), prompt: list[int] | None = None,
           ) -> tuple[list[str], IncrementalDetokenizer]:
    """Feeds tokens one at a time, the last with finished=True (unless a stop string matched)."""
    detok = IncrementalDetokenizer(FakeTokenizer(), prompt if prompt is not None else [BOS], stop)
    deltas = []
    for k, tid in enumerate(token_ids):
        deltas.append(detok.add_tokens([tid], finished=k == len(token_ids) - 1))
        if detok.stopped_by is not None:
            break
    return deltas, detok


def test_deltas_concatenate_to_full_text() -> None:
    tokens = [1, 2, 3, 9, 6]
    deltas, detok = stream(tokens)
    assert deltas == ["Hello", " wor", "ld", "!", " more"]
    assert "".join(deltas) == detok.text == "Hello world! more"
    assert detok.text == FakeTokenizer().decode(tokens)
    assert detok.stopped_by is None


def test_prompt_tail_is_context_not_output() -> None:
    deltas, detok = stream([2, 3], prompt=[BOS, 1])
    assert deltas == [" wor", "ld"]
    assert detok.text == " world"


def test_batch_add_equals_one_at_a_time() -> None:
    detok = IncrementalDetokenizer(FakeTokenizer(), [BOS])
    assert detok.add_tokens([1, 2, 7], finished=False) == "Hello wor"
    assert detok.add_tokens([8, 3], finished=True) == "éld"
    assert detok.text == "Hello woréld"


def test_stop_string_spanning_two_tokens_is_truncated() -> None:
    deltas, detok = stream([1, 2, 3, 4, 5, 6], stop=("STOP",))
    assert detok.stopped_by == "STOP"
    assert detok.text == "Hello world "
    assert "".join(deltas) == "Hello world "
    assert len(deltas) == 5, "no token after the stop string is consumed"
    # Hold-back of len("STOP") - 1 = 3 characters while streaming.
    assert deltas == ["He", "llo ", "wo", "rld", " "]


def test_stop_string_inside_one_batch_ignores_later_tokens() -> None:
    detok = IncrementalDetokenizer(FakeTokenizer(), [BOS], ("STOP",))
    assert detok.add_tokens([1, 2, 3, 4, 5, 6], finished=False) == "Hello world "
    assert detok.stopped_by == "STOP"
    assert detok.text == "Hello world "


def test_partial_stop_string_is_held_back_then_released() -> None:
    # " S" + "T" + "!" looks like the start of "STOP" and then is not.
    detok = IncrementalDetokenizer(FakeTokenizer(), [BOS], ("STOP",))
    assert detok.add_tokens([1], finished=False) == "He"
    assert detok.add_tokens([2, 3], finished=False) == "llo wo"
    assert detok.add_tokens([10], finished=False) == "rl"
    assert detok.add_tokens([11], finished=False) == "d"           # held: " ST"
    assert detok.add_tokens([9], finished=False) == " "            # held: "ST!"
    assert detok.add_tokens([6], finished=True) == "ST! more"      # flushed at finish
    assert detok.stopped_by is None
    assert detok.text == "Hello world ST! more"


def test_finish_flushes_held_back_text() -> None:
    detok = IncrementalDetokenizer(FakeTokenizer(), [BOS], ("STOP",))
    assert detok.add_tokens([1, 2], finished=False) == "Hello "
    assert detok.add_tokens([], finished=True) == "wor"
    assert detok.add_tokens([], finished=True) == ""


def test_several_stop_strings_earliest_match_wins() -> None:
    deltas, detok = stream([1, 2, 3, 10, 11, 12], stop=("ST", "world!"))
    assert detok.stopped_by == "ST"
    assert detok.text == "Hello world "
    assert "".join(deltas) == "Hello world "


def test_incomplete_utf8_is_withheld() -> None:
    deltas, detok = stream([1, 7, 8, 9])
    assert deltas == ["Hello", "", "é", "!"]
    assert "\ufffd" not in "".join(deltas)
    deltas, detok = stream([12, 13, 1])
    assert deltas == ["", "€", "Hello"]
    assert detok.text == "€Hello"


def test_incomplete_utf8_with_stop_hold_back() -> None:
    deltas, detok = stream([1, 7, 8, 4, 5], stop=("STOP",))
    assert detok.stopped_by == "STOP"
    assert "".join(deltas) == detok.text == "Helloé "


def test_special_tokens_skipped() -> None:
    deltas, detok = stream([1, BOS, 9])
    assert "".join(deltas) == "Hello!"
    detok = IncrementalDetokenizer(FakeTokenizer(), [], skip_special_tokens=False)
    assert detok.add_tokens([BOS, 1], finished=True) == "<s>Hello"
