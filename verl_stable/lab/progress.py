"""The sweep's progress line on stderr, drawn by tqdm: ``[#####.....] 12/40 steps | run 2/6 minirl N=4 | 1m05s``.

tqdm renders the line (:meth:`tqdm.tqdm.format_meter`: bar, counts, elapsed time) and, on a terminal, redraws it in
place (:meth:`tqdm.tqdm.status_printer`, which also blanks what a longer previous line left behind). A stream that is
not a terminal (a log file, a CI console) gets one line per change of the step count or the label instead, so a log
is not filled with carriage returns or with a line per elapsed second.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

# tqdm draws the bar with the last character for filled cells and the first for empty ones
_BAR_CHARS = ".#"


def _minutes_seconds(seconds: float) -> str:
    """``65.3`` -> ``"1m05s"``."""
    whole = int(seconds)
    return f"{whole // 60}m{whole % 60:02d}s"


class ProgressBar:
    """``[#####.....] 12/40 steps | run 2/6 minirl N=4 | 1m05s``, redrawn in place on a terminal.

    Args:
        total: total units (training steps over all runs).
        stream: where to draw (stderr by default); a non-TTY stream gets one line per update instead of ``\\r``.
        width: characters of the bar.

    Raises:
        ValueError: ``total`` is negative.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.monotonic()
        # tqdm's bar_format fields; the bar's width is part of its field
        self._format = f"[{{bar:{width}}}] {{n}}/{{total}} steps | {{desc}} | {{minutes_seconds}}"
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._draw: Callable[[str], None] | None = tqdm.status_printer(self.stream) if self._tty else None
        self._last: object = None

    def render(self, label: str = "") -> str:
        """The line for the current state."""
        elapsed = time.monotonic() - self.start
        return tqdm.format_meter(
            self.done,
            self.total,
            elapsed,
            prefix=label,
            ascii=_BAR_CHARS,
            bar_format=self._format,
            minutes_seconds=_minutes_seconds(elapsed),
        )

    def update(self, done: int, label: str = "") -> None:
        """Set the number of finished units and redraw if anything changed."""
        self.done = max(0, min(done, self.total))
        text = self.render(label)
        # a log file gets a line only when the count or the label changes, not every elapsed second
        key = text if self._tty else (self.done, label)
        if key == self._last:
            return
        self._last = key
        if self._draw is not None:
            self._draw(text)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the line."""
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
