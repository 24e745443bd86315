"""The prefork server's process: serve fork requests, and turn a forked child into the process its client stands for.

The server (started by :class:`verl_stable.cpu.prefork.ServerProcess`) preloads the heavy packages
(:func:`verl_stable.cpu.prefork_preload.preload`), then serves requests (:mod:`verl_stable.cpu.prefork_protocol`):
for each it compares the client's environment and working directory with what the preload saw, and forks a child or
refuses. A child's standard streams, environment, working directory and arguments are the client's (:func:`become`),
so it runs the script (``default_worker.py``) or module (``-m verl.trainer.main_ppo``) exactly as the plain process
would, in a session of its own, and dies with the client (a lifeline pipe). When Ray sets an actor's
``OMP_NUM_THREADS`` later, the child applies it (:func:`_apply_rays_thread_count`; in a plain worker that happens
before torch is imported).

    python -c 'import sys; from verl_stable.cpu.prefork_server import main; sys.exit(main(sys.argv[1:]))' \
        --socket PATH [--lifeline-fd N] [--modules a,b]                   # what ServerProcess starts
"""

from __future__ import annotations

import argparse
import io
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from verl_stable.cpu.prefork_preload import (
    PRELOAD,
    RAY_THREAD_SETTER,
    EnvReads,
    import_time_differences,
    preload,
)
from verl_stable.cpu.prefork_protocol import Request, receive_request, send_line


class PreforkServer:
    """The server's loop: accept a request, compare environments, fork or refuse, report each child's exit.

    Args:
        sock: a bound, listening unix socket.
        reads: what the preload read of the environment.
        server_env: the server's environment when the preload started (what native code saw at load).
        lifeline_fd: the read end of a pipe held by whoever started the server; when it closes the server accepts
            no more requests and exits once its children have (``-1``: none).
        log: where a line per request goes.
    """

    def __init__(
        self,
        sock: socket.socket,
        reads: EnvReads,
        server_env: Mapping[str, str],
        lifeline_fd: int = -1,
        log=None,  # noqa: ANN001 - a text stream; stderr by default
    ) -> None:
        self.sock = sock
        self.reads = reads
        self.server_env = dict(server_env)
        self.lifeline_fd = lifeline_fd
        self.log = sys.stderr if log is None else log
        self.children: dict[int, socket.socket] = {}
        self.counts = {"forked": 0, "refused": 0}

    def say(self, text: str) -> None:
        self.log.write(f"{time.strftime('%H:%M:%S')} prefork[{os.getpid()}]: {text}\n")
        self.log.flush()

    def serve(self) -> tuple[Request, list[int], list[str]] | None:
        """Serve until the lifeline closes or SIGTERM, and the children are gone (``None``).

        In a forked child it returns instead: the child's request, its descriptors and the thread variables to fix
        (:func:`become` takes them), with every descriptor of the server's own closed.
        """
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        stopping = False

        def stop(*_: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        # a terminal's Ctrl-C reaches the launcher's whole process group: the clients forward it to their children,
        # and the server must outlive them to report their exits
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ, "accept")
        selector.register(wake_r, selectors.EVENT_READ, "signal")
        if self.lifeline_fd >= 0:
            selector.register(self.lifeline_fd, selectors.EVENT_READ, "lifeline")
        while not (stopping and not self.children):
            for key, _ in selector.select(timeout=1.0):
                if key.data == "accept" and not stopping:
                    outcome = self._one_request()
                    if outcome is not None:  # the forked child: drop everything of the server's
                        signal.set_wakeup_fd(-1)
                        selector.close()
                        for fd in (wake_r, wake_w, self.lifeline_fd):
                            if fd >= 0:
                                os.close(fd)
                        self.sock.close()
                        for conn in self.children.values():
                            conn.close()
                        return outcome
                elif key.data == "signal":
                    os.read(wake_r, 512)
                elif key.data == "lifeline" and not os.read(self.lifeline_fd, 512):
                    stopping = True
                    selector.unregister(self.lifeline_fd)
                    if self.children:
                        self.say(f"the launcher is done; waiting for {len(self.children)} children")
            if stopping and self.sock.fileno() >= 0:
                selector.unregister(self.sock)
                self.sock.close()
            self._reap()
        signal.set_wakeup_fd(-1)
        selector.close()
        os.close(wake_r)
        os.close(wake_w)
        self.say(f"stopping: {self.counts['forked']} forked, {self.counts['refused']} refused")
        return None

    def _one_request(self) -> tuple[Request, list[int], list[str]] | None:
        conn, _ = self.sock.accept()
        conn.settimeout(10.0)
        try:
            request, fds = receive_request(conn)
        except (OSError, ValueError) as exc:
            self.say(f"bad request: {exc}")
            conn.close()
            return None
        try:
            refused, fixed = import_time_differences(self.reads, self.server_env, request.env)
            if refused:
                raise ValueError(f"import-time environment differs: {', '.join(refused)}")
            if self.reads.cwd is not None and os.path.realpath(request.cwd) != os.path.realpath(self.reads.cwd):
                raise ValueError(f"working directory {request.cwd} is not the preload's {self.reads.cwd}")
            kind, what = request.target()
        except ValueError as exc:
            self.counts["refused"] += 1
            self.say(f"refused {request.argv[:2]}: {exc}")
            send_line(conn, f"refused {exc}")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.close()  # the client's connection stays with the server; the child needs only the lifeline
            return request, fds, fixed
        for fd in fds:
            os.close(fd)
        self.counts["forked"] += 1
        self.children[pid] = conn
        note = f" (fixed: {', '.join(fixed)})" if fixed else ""
        self.say(f"forked {pid} for {kind} {Path(what).name}{note}")
        send_line(conn, f"pid {pid}")
        return None

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                send_line(conn, f"exit {os.waitstatus_to_exitcode(status)}")
                conn.close()


def _watch_lifeline(fd: int) -> None:
    """In the child: kill this process when the client's end of the lifeline closes."""

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 512):
                    break
            except InterruptedError:
                continue
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="prefork-lifeline", daemon=True).start()


def _reopen_standard_streams() -> None:
    """``sys.stdin``/``stdout``/``stderr`` over the new descriptors 0-2, buffered as Python's start-up buffers them.

    Line-buffered stdout on a terminal only, stderr always line-buffered (Python >= 3.9), write-through as the
    server's own streams are (``PYTHONUNBUFFERED`` is compared between server and child, so that is the child's too).
    """
    for name, fd, mode in (("stdin", 0, "r"), ("stdout", 1, "w"), ("stderr", 2, "w")):
        old = getattr(sys, name)
        if old is not None and mode == "w":
            old.flush()
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or ("backslashreplace" if name == "stderr" else "strict")
        line = name == "stderr" or (name == "stdout" and os.isatty(fd))
        unbuffered = bool(getattr(old, "write_through", False)) and mode == "w"
        raw = open(fd, mode + "b", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        setattr(sys, name, io.TextIOWrapper(raw, encoding, errors, line_buffering=line, write_through=unbuffered))


def _apply_rays_thread_count() -> None:
    """In the child: when Ray sets ``OMP_NUM_THREADS`` (``RAY_THREAD_SETTER``), apply it with ``torch.set_num_threads``.

    A plain worker imports torch only after Ray set the variable, so OpenMP starts with it; the child's torch was
    loaded in the server, so the setting is applied when it is made. Only Ray's own setting: in a plain process any
    later one comes after torch's load and changes nothing.
    """
    environ_cls = type(os.environ)
    setitem = environ_cls.__setitem__

    def setitem_applying_rays_threads(environ: os._Environ, key: str, value: str) -> None:
        setitem(environ, key, value)
        if key == "OMP_NUM_THREADS" and environ is os.environ and EnvReads._reader() == RAY_THREAD_SETTER:
            import torch

            torch.set_num_threads(int(value))

    # patch: prefork_ray_threads (verl_stable.compat.catalogue)
    environ_cls.__setitem__ = setitem_applying_rays_threads


def become(request: Request, fds: list[int], fixed: Sequence[str]) -> tuple[str, str]:
    """Turn the forked child into the process the client stands for; returns the target :meth:`Request.target` names.

    A session of its own (signals for the server's process group do not reach it; the client forwards its own),
    the client's standard streams, environment and working directory, default signal handlers, the thread count
    of ``fixed`` applied (or Ray's, when Ray sets it later: :func:`_apply_rays_thread_count`), NumPy's global
    generator reseeded from the OS (a fresh process seeds it so; forked children would share one), ``sys.argv`` and
    ``sys.path[0]`` as ``python <script>`` or ``python -m`` sets them.
    """
    os.setsid()
    for target_fd, fd in zip((0, 1, 2), fds[:3], strict=True):
        os.dup2(fd, target_fd)
        os.close(fd)
    _reopen_standard_streams()
    _watch_lifeline(fds[3])
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    if fixed:
        import torch

        name = "OMP_NUM_THREADS" if "OMP_NUM_THREADS" in fixed else fixed[0]
        torch.set_num_threads(int(request.env[name]))
    if "torch" in sys.modules and "OMP_NUM_THREADS" not in request.env:
        _apply_rays_thread_count()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    kind, what = request.target()
    if kind == "module":
        sys.argv = [what, *request.argv[2:]]  # runpy.run_module(alter_sys=True) puts the module's file first
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(request.argv)
        sys.path[0] = os.path.dirname(os.path.abspath(what))
    return kind, what


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the prefork server (started by ServerProcess)")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--lifeline-fd", type=int, default=-1)
    parser.add_argument("--modules", default=",".join(PRELOAD))
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    args.socket.unlink(missing_ok=True)
    sock.bind(str(args.socket))
    sock.listen(128)  # clients connect now and wait for their answer until the preload is done
    started = time.perf_counter()
    server_env = dict(os.environ)
    try:
        reads = preload([m for m in args.modules.split(",") if m])
    except Exception as exc:  # noqa: BLE001 - every client then starts plain Python; the reason is logged
        sys.stderr.write(f"prefork: not serving: {type(exc).__name__}: {exc}\n")
        sock.close()
        args.socket.unlink(missing_ok=True)
        return 1
    server = PreforkServer(sock, reads, server_env, args.lifeline_fd)
    server.say(f"serving after {time.perf_counter() - started:.1f} s of imports ({len(reads.values)} variables read)")
    outcome = server.serve()
    if outcome is None:
        args.socket.unlink(missing_ok=True)
        return 0
    kind, what = become(*outcome)
    if kind == "module":
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(what, run_name="__main__")
    return 0
