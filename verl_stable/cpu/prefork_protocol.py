"""The prefork server's wire protocol, the server's side: one request per connection, one line per answer.

A client (:mod:`verl_stable.cpu.prefork_client`, which encodes the request itself: it imports the standard library
only) connects to the server's unix socket and sends a 4-byte big-endian length with four descriptors attached
(``SCM_RIGHTS``: its stdin, stdout, stderr and the read end of its lifeline pipe), then that many bytes of JSON:
``{"argv": [...], "env": {...}, "cwd": "..."}`` (:class:`Request`). The server answers with lines (:func:`send_line`):
``pid <n>`` when it forked the child, then ``exit <code>`` when the child exits (negative: killed by that signal);
or ``refused <reason>`` and nothing more. A malformed request gets no answer: the connection is closed.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """What a client asks for: the process's arguments (after the interpreter), environment and working directory."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def target(self) -> tuple[str, str]:
        """``("module", name)`` for ``-m name ...``, else ``("script", path)``.

        Raises:
            ValueError: interpreter options or ``-c`` the server does not run (the client then starts Python).
        """
        if self.argv[:1] == ["-m"] and len(self.argv) >= 2:
            return "module", self.argv[1]
        if not self.argv or self.argv[0].startswith("-"):
            raise ValueError(f"only a script or -m module is forked, got {self.argv[:2]}")
        return "script", self.argv[0]


def receive_request(conn: socket.socket) -> tuple[Request, list[int]]:
    """Read one request and the descriptors sent with it (stdin, stdout, stderr, the lifeline)."""
    fds = array.array("i")
    head, ancillary, _flags, _addr = conn.recvmsg(4, socket.CMSG_SPACE(8 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if len(head) != 4 or len(fds) != 4:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"malformed request ({len(head)} header bytes, {len(fds)} descriptors)")
    try:
        (size,) = struct.unpack("!I", head)
        body = bytearray()
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("the client closed the connection mid-request")
            body += chunk
        payload = json.loads(body)
        argv, env, cwd = payload["argv"], payload["env"], payload["cwd"]
        if not (isinstance(argv, list) and isinstance(env, dict) and isinstance(cwd, str)):
            raise TypeError(f"argv {type(argv).__name__}, env {type(env).__name__}, cwd {type(cwd).__name__}")
        request = Request([str(a) for a in argv], {str(k): str(v) for k, v in env.items()}, cwd)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"malformed request: {type(exc).__name__}: {exc}") from exc
    return request, list(fds)


def send_line(conn: socket.socket, line: str) -> None:
    """Send one answer line; a client that is gone is not an error."""
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass  # the client is gone; its child dies with its lifeline
