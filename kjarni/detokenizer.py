"""Streaming text out of token ids: UTF-8 held back until complete, stop strings held back until decided.

A token may end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK across
tokens) and a stop string may span several tokens. Both streams below emit text as early as it is
certain, so that everything they emit, concatenated, equals what a one-shot decode produces
(cut before the first stop string).
"""

from __future__ import annotations

import codecs
from typing import Iterable, Protocol

from kjarni.errors import InvalidConfigurationError


class _TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class StreamingDetokenizer:
    """Turns token ids into text deltas, one token at a time.

    Text is the UTF-8 decoding of the concatenated ``tokenizer.token_bytes`` of the non-special
    tokens, with invalid bytes replaced by U+FFFD exactly where a one-shot
    ``bytes.decode("utf-8", "replace")`` would put them. Special tokens (eos, chat markers)
    produce no text.
    """

    def __init__(self, tokenizer: _TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text that ``token_id`` completes; incomplete UTF-8 sequences wait for more bytes."""
        if self._tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The end of the stream: bytes still waiting become U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopStrings:
    """Cuts a text stream before the first stop string, even one that spans several deltas.

    Text that could be the beginning of a stop string is held back until it either completes one
    (then only the text before it is emitted and the stream is stopped) or cannot (then it is
    emitted). "First" means the occurrence that completes earliest, and among those the one that
    starts earliest, which makes the result independent of how the text was split into deltas.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        for stop in self.stops:
            if not isinstance(stop, str) or not stop:
                raise InvalidConfigurationError(f"stop string {stop!r} is invalid: stop strings must be non-empty text")
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; returns ``(text safe to emit, whether a stop string completed)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._pending + delta
        cut = self._first_stop(text)
        if cut is not None:
            self._pending = ""
            self.stopped = True
            return text[:cut], True
        hold = self._held_back(text)
        self._pending = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """The end of the stream: text held back as a possible stop-string start is emitted."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _first_stop(self, text: str) -> int | None:
        best: tuple[int, int] | None = None  # (end, start) of the earliest-completing occurrence
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start)
                if best is None or candidate < best:
                    best = candidate
        return None if best is None else best[1]

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
