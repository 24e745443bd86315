"""The Python a preforked process is started with: ask the prefork server to fork it, else become Python itself.

Ray starts a worker as ``<py_executable> default_worker.py <args>`` and the CPU launcher starts verl's driver as
``<python> -m verl.trainer.main_ppo <args>``; with :mod:`verl_stable.cpu.prefork` on, the command in front of those
arguments is ``<python> -I -S <this file>``. This script (the standard library only, so it starts in ~20 ms) sends its
arguments, environment, working directory and standard streams (the request: :mod:`verl_stable.cpu.prefork_protocol`)
to the server named by ``VERL_STABLE_PREFORK_SOCKET`` and waits: on ``pid <n>`` a child of the server runs the
process, this one forwards the signals it receives to it and exits as the child exits; on a refusal, a missing or
silent server, anything unexpected, it ``exec``s ``<python> <args>`` -- the process Ray or the launcher would have
started without the server, in this same process. A fork never changes what runs, only where its imports come from.

The child dies with this process: it holds the read end of a pipe whose write end only this process has, and kills
itself when the pipe closes (this process exited, even by ``SIGKILL``).
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys
import time

ENV_SOCKET = "VERL_STABLE_PREFORK_SOCKET"
# the server answers once its imports are done (~5 s on a 2-core host); a server that has not answered by then is
# not worth waiting for: the plain start costs about the same
REPLY_TIMEOUT_S = 60.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def encode_request(argv: list[str], env: dict[str, str], cwd: str) -> bytes:
    """The request's payload: a 4-byte big-endian length, then the JSON of argv, environment and working directory."""
    body = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
    return struct.pack("!I", len(body)) + body


def plain_start(args: list[str], reason: str) -> None:
    """Replace this process by ``python <args>`` (never returns); ``reason`` goes to stderr when it is not routine."""
    if reason:
        sys.stderr.write(f"verl-stable prefork: {reason}; starting {args[:1]} without the prefork server\n")
        sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *args])


def _wait_for_exit(reader, child: int) -> int:  # noqa: ANN001 - a binary file object
    """The child's exit code from the server's ``exit <code>`` line; 1 if the server went away first."""
    line = reader.readline()
    if line.startswith(b"exit "):
        return int(line.split()[1])
    while True:  # the server died: the child lives on until its lifeline closes, which is when this process exits
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return 1
        time.sleep(0.5)


def main(args: list[str]) -> None:
    path = os.environ.get(ENV_SOCKET, "")
    if not path:
        plain_start(args, "")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError as exc:
        plain_start(args, f"no server at {path} ({exc.strerror or exc})")
    lifeline_r, lifeline_w = os.pipe()
    conn.settimeout(REPLY_TIMEOUT_S)
    try:
        payload = encode_request(list(args), dict(os.environ), os.getcwd())
        fds = array.array("i", [0, 1, 2, lifeline_r])
        conn.sendmsg([payload[:4]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        conn.sendall(payload[4:])
        reader = conn.makefile("rb")
        line = reader.readline()
    except OSError as exc:
        plain_start(args, f"the server did not answer ({exc})")
    os.close(lifeline_r)
    if not line.startswith(b"pid "):
        plain_start(args, line.decode(errors="replace").strip() or "the server closed the connection")
    child = int(line.split()[1])
    conn.settimeout(None)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    code = _wait_for_exit(reader, child)
    os.close(lifeline_w)
    if code < 0:  # killed by a signal: die of the same one, as the parent of a plain process would see it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
