"""Third-party output of a command into a log file, the command's own lines on the terminal.

Importing verl, vLLM and transformers on a CPU machine prints a dozen expected warnings (no accelerator, engines
that are not installed, Triton, torchvision) from Python's ``warnings``, from loggers and from C++ code, on stdout
and stderr. :func:`divert_output` sends everything written to file descriptors 1 and 2 in this process and its
children to a log, for its duration, and hands the caller a stream to the terminal's stdout for its own lines.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


def _real_fd(stream: TextIO) -> int | None:
    """The descriptor behind ``stream`` when it writes to one (None when something replaced it, e.g. a test's
    capture, which then keeps receiving the caller's lines)."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


@contextlib.contextmanager
def divert_output(log: str | os.PathLike) -> Iterator[TextIO]:
    """Write descriptors 1 and 2 to ``log`` (appended) inside the block; yield a stream to the original stdout.

    The original descriptors are restored on exit, also after an exception (whose traceback is then printed by the
    interpreter on the restored stderr).
    """
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    own_fd = _real_fd(sys.stdout)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log, "ab") as sink:
        for fd in (1, 2):
            os.dup2(sink.fileno(), fd)
    own = os.fdopen(os.dup(saved[1]), "w", buffering=1) if own_fd == 1 else sys.stdout
    try:
        yield own
    finally:
        for stream in (sys.stdout, sys.stderr, own):
            with contextlib.suppress(ValueError, OSError):
                stream.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        if own is not sys.stdout:
            own.close()
