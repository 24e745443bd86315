"""A plain-text progress bar on stderr for the lab's sweep (no terminal control beyond ``\\r``)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``[#####.....] 12/40 steps | run 2/6 minirl N=4 | 1m05s``, redrawn in place.

    Args:
        total: total units (training steps over all runs).
        stream: where to draw (stderr by default); a non-TTY stream gets one line per update instead of ``\\r``.
        width: characters of the bar.
    """

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.monotonic()
        self._last: object = None

    def render(self, label: str = "") -> str:
        """The bar as text for the current state."""
        frac = 1.0 if self.total == 0 else min(self.done / self.total, 1.0)
        filled = int(round(frac * self.width))
        elapsed = int(time.monotonic() - self.start)
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {self.done}/{self.total} steps | {label} | {elapsed // 60}m{elapsed % 60:02d}s"

    def update(self, done: int, label: str = "") -> None:
        """Set the number of finished units and redraw if anything changed."""
        self.done = max(0, min(done, self.total))
        text = self.render(label)
        tty = getattr(self.stream, "isatty", lambda: False)()
        # a log file gets a line only when the count or the label changes, not every elapsed second
        key = text if tty else (self.done, label)
        if key == self._last:
            return
        self._last = key
        self.stream.write(("\r" + text) if tty else (text + "\n"))
        self.stream.flush()

    def close(self) -> None:
        """End the line."""
        if getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
            self.stream.flush()
