"""Streaming detokenization: UTF-8 split across tokens, special tokens, stop strings across deltas."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kjarni.detokenizer import StopStrings, StreamingDetokenizer
from kjarni.errors import InvalidConfigurationError


class ByteTokenizer:
    """Token i < 256 is the single byte i; 256 is a special token; 257+ are multi-byte pieces."""

    SPECIAL = 256

    def __init__(self, pieces: list[bytes] = ()) -> None:
        self.pieces = list(pieces)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes([token_id])
        if token_id == self.SPECIAL:
            return b"<|eot|>"
        return self.pieces[token_id - 257]

    def is_special(self, token_id: int) -> bool:
        return token_id == self.SPECIAL


def _stream(tokenizer, ids) -> list[str]:
    detok = StreamingDetokenizer(tokenizer)
    return [detok.add(i) for i in ids] + [detok.flush()]


def test_emoji_split_across_byte_tokens_is_held_back_until_complete():
    deltas = _stream(ByteTokenizer(), list("hi 🙂!".encode()))
    assert deltas == ["h", "i", " ", "", "", "", "🙂", "!", ""]


def test_cjk_split_across_multi_byte_tokens():
    text = "日本語"
    raw = text.encode()  # 9 bytes; tokens cut inside characters
    tokenizer = ByteTokenizer([raw[0:2], raw[2:4], raw[4:8], raw[8:9]])
    deltas = _stream(tokenizer, [257, 258, 259, 260])
    assert deltas == ["", "日", "本", "語", ""]


def test_special_tokens_yield_no_text():
    assert "".join(_stream(ByteTokenizer(), [ord("a"), 256, ord("b")])) == "ab"


def test_invalid_leftover_bytes_become_replacement_at_the_end():
    deltas = _stream(ByteTokenizer(), [ord("a"), 0xE6, 0x97])  # truncated 3-byte character
    assert deltas[:3] == ["a", "", ""]
    assert deltas[-1] == "\ufffd"


@given(st.lists(st.integers(0, 256), max_size=40))
def test_streamed_text_equals_one_shot_decode(ids):
    tokenizer = ByteTokenizer()
    one_shot = b"".join(tokenizer.token_bytes(i) for i in ids if i != 256).decode("utf-8", "replace")
    assert "".join(_stream(tokenizer, ids)) == one_shot


@given(st.text(max_size=30), st.lists(st.integers(1, 4), max_size=40))
def test_valid_text_in_any_byte_split_round_trips(text, cuts):
    raw, pieces, pos = text.encode(), [], 0
    for size in cuts:
        if pos < len(raw):
            pieces.append(raw[pos : pos + size])
            pos += size
    pieces.append(raw[pos:])
    tokenizer = ByteTokenizer(pieces)
    deltas = _stream(tokenizer, [257 + i for i in range(len(pieces))])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


# ---------------------------------------------------------------- stop strings


def _feed_all(stops, deltas):
    s = StopStrings(stops)
    out, stopped_at = [], None
    for i, delta in enumerate(deltas):
        text, stopped = s.feed(delta)
        out.append(text)
        if stopped:
            stopped_at = i
            break
    else:
        out.append(s.flush())
    return out, stopped_at


def test_stop_string_across_token_boundaries_emits_only_the_text_before_it():
    out, stopped_at = _feed_all(["</s>"], ["Hello <", "/", "s> world"])
    assert "".join(out) == "Hello "
    assert stopped_at == 2
    assert out[0] == "Hello "  # "<" could start the stop string: held back


def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop():
    out, stopped_at = _feed_all(["</s>"], ["a <", "b", "c"])
    assert stopped_at is None
    assert out == ["a ", "<b", "c", ""]


def test_held_back_text_is_flushed_at_the_end():
    out, _ = _feed_all(["STOP"], ["xx ST"])
    assert out == ["xx ", "ST"]


def test_earliest_completing_stop_wins():
    out, _ = _feed_all(["abcd", "bc"], ["abcd"])
    assert "".join(out) == "a"


def test_feed_after_stop_emits_nothing():
    s = StopStrings(["x"])
    assert s.feed("ax") == ("a", True)
    assert s.feed("more") == ("", True)
    assert s.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidConfigurationError, match="stop string"):
        StopStrings([""])


def _one_shot_cut(text: str, stops: list[str]) -> str:
    """Cut before the occurrence that completes first (then starts first): char by char."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)]
    return text


@given(
    st.lists(st.text("ab<>/", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.text("ab<>/", max_size=5), max_size=12),
)
def test_stop_strings_match_a_one_shot_cut_for_any_split(stops, deltas):
    out, _ = _feed_all(stops, deltas)
    assert "".join(out) == _one_shot_cut("".join(deltas), stops)
