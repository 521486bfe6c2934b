"""kjarni's one progress bar, on stderr (never stdout: stdout carries generated text), of bytes
(downloads, checksums) or of other counts (``unit="steps"``: ``kjarni parity``).

On a terminal the bar redraws in place with a carriage return, at most ``MAX_REDRAWS_PER_S`` times
a second. When stderr is a file or a pipe (CI logs, captured output) carriage returns would pile up
into one enormous line, so it prints a plain line at every tenth of the total instead (at most one a
second, so fast copies stay short in logs). ``quiet=True``
prints nothing at all.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

MAX_REDRAWS_PER_S = 10
MIN_LOG_LINE_INTERVAL_S = 1.0
BAR_WIDTH = 24


def format_bytes(n: float) -> str:
    """``n`` bytes as a short decimal size: ``'812 B'``, ``'93.8 MB'``, ``'1.12 GB'``."""
    if n < 1e3:
        return f"{n:.0f} B"
    if n < 1e6:
        return f"{n / 1e3:.1f} kB"
    if n < 1e9:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e9:.2f} GB"


def format_duration(seconds: float) -> str:
    """Whole seconds as ``m:ss`` or ``h:mm:ss``."""
    seconds = round(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Progress of a byte count toward ``total`` (``None`` when unknown), drawn on stderr.

    Use as a context manager, or call ``close()``; ``update(n)`` adds ``n`` bytes. The final line
    (with the average speed) is printed on ``close()``.
    """

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        quiet: bool = False,
        *,
        stream: TextIO | None = None,
        unit: str = "B",
    ) -> None:
        self.total = total if total and total > 0 else None
        self.unit = unit
        self._format = format_bytes if unit == "B" else (lambda n: f"{n:.0f} {unit}")
        self.desc = desc
        self.quiet = quiet
        self.done = 0
        # Looked up now rather than at import so pytest's capsys and redirected stderr are honoured.
        self._stream = stream if stream is not None else sys.stderr
        self._tty = _is_tty(self._stream)
        self._start = time.monotonic()
        self._last_draw = float("-inf")
        self._last_tenth = 0
        self._closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, n: int) -> None:
        """Record ``n`` more bytes and redraw if enough time (terminal) or progress (log) passed."""
        self.done += n
        if self.quiet or self._closed:
            return
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 1.0 / MAX_REDRAWS_PER_S:
                self._last_draw = now
                self._write("\r" + self._line(now) + "\x1b[K")
        elif self.total is not None:
            tenth = min(10, self.done * 10 // self.total)
            if self._last_tenth < tenth < 10 and now - self._last_draw >= MIN_LOG_LINE_INTERVAL_S:
                # (the 100 % line is close()'s)
                self._last_tenth = tenth
                self._last_draw = now
                self._write(self._line(now) + "\n")

    def close(self) -> None:
        """Print the final line (once)."""
        if self._closed:
            return
        self._closed = True
        if self.quiet:
            return
        now = time.monotonic()
        elapsed = max(now - self._start, 1e-9)
        line = f"{self.desc}  {self._format(self.done)} in {format_duration(elapsed)}"
        line += f" ({self._rate(self.done / elapsed)})"
        self._write(("\r" + line + "\x1b[K\n") if self._tty else (line + "\n"))

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        speed = self._rate(rate)
        if self.total is None:
            return f"{self.desc}  {self._format(self.done)}  {speed}"
        fraction = min(1.0, self.done / self.total)
        filled = int(fraction * BAR_WIDTH)
        bar = "=" * filled + (">" if filled < BAR_WIDTH else "") + " " * (BAR_WIDTH - filled - 1)
        eta = format_duration((self.total - self.done) / rate) if rate > 0 else "?"
        return (
            f"{self.desc} {fraction * 100:3.0f}% [{bar}] "
            f"{self._format(self.done)}/{self._format(self.total)}  {speed}  ETA {eta}"
        )

    def _rate(self, per_second: float) -> str:
        if self.unit == "B":
            return f"{format_bytes(per_second)}/s"
        return f"{per_second:.2f} {self.unit}/s"

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            # A closed or broken stderr must not abort a download.
            pass


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
