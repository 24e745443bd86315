"""verl's processes forked from one that has already imported torch and transformers: the prefork server.

A verl run on the CPU is about ten Python processes -- the driver, the task runner, TransferQueue's controller and
storage, the actor, the rollout server, the reward-loop and agent-loop workers, the load balancer -- and each spends
~7 s of CPU importing torch, transformers, datasets, peft and verl before it does anything; verl starts most of them
one after another. The prefork server imports the heavy packages that do not import Ray (:data:`PRELOAD`) once, then
forks a child for each process of the run, which imports only what is left (verl and Ray, ~1.2 s) and runs as the
process would have run. Nothing of verl or Ray is changed: Ray's documented ``runtime_env["py_executable"]`` (the
command a worker is started with) is set to the client (:mod:`verl_stable.cpu.prefork_client`), which asks the
server for a fork and otherwise becomes plain Python. Linux only (``fork`` and ``SCM_RIGHTS``).

**What a child is.** Its standard streams, environment, working directory and arguments are the client's, so it runs
the script (``default_worker.py``) or module (``-m verl.trainer.main_ppo``) exactly as the plain process would, in
a session of its own, and dies with the client (a lifeline pipe). What it inherits from the server is the preloaded
modules, and their state is what those imports made of the *server's* environment and working directory. So before
forking, the server compares (:func:`import_time_differences`) every variable the preload read from Python (recorded
while importing, :class:`EnvReads`) and every variable native code reads at load or first use
(:data:`NATIVE_PREFIXES`) between its environment and the child's, and the working directories; a difference means
the child would not be the process it replaces, and the server refuses: the client starts plain Python. The thread
count (:data:`THREAD_VARIABLES`) is the one difference a child fixes instead (``torch.set_num_threads``, what OpenMP
does with the variable when torch loads in a fresh process): at the fork when the client's environment has another
value, and when Ray sets an actor's ``OMP_NUM_THREADS`` later (:func:`_apply_rays_thread_count`; in a plain worker
that happens before torch is imported). Ray itself is never preloaded: ``import ray`` fixes Ray's C++ configuration
from the environment of the importing process, and a worker's job id (``RAY_JOB_ID``) is in it.

**What is measured** (``python benchmarks/bench_run_startup.py``: a run's wall 0.567x and CPU 0.517x of the same run
without the server; a forked run logs the plain run's values bit for bit) is in ``docs/cpu-runtime.md`` and
``docs/benchmarks.md``; ``VERL_STABLE_PREFORK=0`` turns it off for a run.

    python -c 'import sys; from verl_stable.cpu.prefork import main; sys.exit(main(sys.argv[1:]))' \
        --socket PATH [--lifeline-fd N] [--modules a,b]                   # what ServerProcess starts
"""

from __future__ import annotations

import argparse
import array
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractResult
from verl_stable.cpu import prefork_client

ENV_SOCKET = prefork_client.ENV_SOCKET
ENV_SWITCH = "VERL_STABLE_PREFORK"

# What a verl process imports that does not import Ray, heaviest first in practice (``python -X importtime`` of the
# modules a CPU run's actors live in: torch with torch._dynamo ~2.2 s, transformers with modeling_utils and
# processing_utils ~1.3 s, datasets with pyarrow ~0.5 s, peft ~1 s, pandas, scipy.optimize, hydra). Everything a
# verl process imports besides these -- verl, Ray, TransferQueue, tensordict, verl-stable -- is ~1.2 s.
PRELOAD: tuple[str, ...] = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "numpy",
    "pandas",
    "pyarrow",
    "datasets",
    "omegaconf",
    "hydra",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",
    "peft",
    "scipy.optimize",
)
# never preloaded: importing Ray reads Ray's C++ configuration from the environment once (a worker's RAY_JOB_ID among
# it); verl and TransferQueue import Ray
NEVER_PRELOADED: tuple[str, ...] = ("ray", "verl", "transfer_queue", "vllm", "megatron")

# Read by native code when a library loads or on first use, so the preload's Python-level record cannot see them:
# OpenMP and MKL thread pools, the allocator, the dynamic loader, the interpreter's own start-up, ATen's CPU dispatch
# and oneDNN, torch's C++ flags.
NATIVE_PREFIXES: tuple[str, ...] = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "LD_",
    "PYTHON",
    "ATEN_",
    "DNNL_",
    "ONEDNN_",
    "TORCH_",
    "PYTORCH_",
)
# variables under those prefixes that no native code reads when a library loads; each with the reason
NATIVE_EXEMPT: dict[str, str] = {
    # verl's Megatron engine package sets it in the driver (CPU hosts); only torch.utils.cpp_extension reads it, from
    # Python, when it builds a CUDA extension -- which the record of the preload's reads would show
    "TORCH_CUDA_ARCH_LIST": "read only when building CUDA extensions",
}
# OpenMP reads them when torch loads; a child whose environment has another value gets it from torch.set_num_threads
THREAD_VARIABLES: tuple[str, ...] = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Ray sets OMP_NUM_THREADS in a worker's os.environ when it starts an actor's creation task without one set
# (ray._private.utils.set_omp_num_threads_if_unset: the actor's CPUs, 1 for an actor without num_cpus), before the
# actor's module -- and torch with it -- is imported: in a plain worker OpenMP reads that value
RAY_THREAD_SETTER = "ray._private.utils"
# modules whose import walks the whole environment for a prefix of their own (tqdm's envwrap, fsspec's config)
KNOWN_SCANS: dict[str, str] = {"tqdm.utils": "TQDM_", "fsspec.config": "FSSPEC_"}
_PLUMBING = ("os", "_collections_abc", "collections.abc", "typing", "verl_stable.cpu.prefork")


@dataclass
class EnvReads:
    """What the imports inside :meth:`recording` read of ``os.environ``.

    Attributes:
        values: name -> the value it had when first read (``None``: unset), for reads from Python code.
        scans: module -> the prefix it scanned the environment for (``None``: a module not in :data:`KNOWN_SCANS`,
            so the prefix is unknown).
        cwd: the working directory during the imports (torch._dynamo and torch._inductor derive their debug and
            cache directories from it when they load); ``None``: not recorded.
    """

    values: dict[str, str | None] = field(default_factory=dict)
    scans: dict[str, str | None] = field(default_factory=dict)
    cwd: str | None = None

    @staticmethod
    def _reader() -> str:
        """The module of the nearest frame outside ``os``, ``collections.abc`` and this module."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "") in _PLUMBING:
            frame = frame.f_back
        return "" if frame is None else frame.f_globals.get("__name__", "")

    @contextmanager
    def recording(self) -> Iterator[EnvReads]:
        """Record every read of ``os.environ`` (``[]``, ``get``, ``in``, ``os.getenv``, iteration) in the block.

        ``os._Environ``'s ``__getitem__`` and ``__iter__`` are wrapped for the span of the block and restored after.
        A read made by a scanning module (iteration) counts as part of its scan, not as a read of each name.
        """
        environ_cls = type(os.environ)
        getitem, iterate = environ_cls.__getitem__, environ_cls.__iter__
        record = self

        def recorded_getitem(environ: os._Environ, key: str) -> str:
            reader = EnvReads._reader()
            try:
                value = getitem(environ, key)
            except KeyError:
                if reader not in record.scans:
                    record.values.setdefault(key, None)
                raise
            if reader not in record.scans:
                record.values.setdefault(key, value)
            return value

        def recorded_iter(environ: os._Environ) -> Iterator[str]:
            reader = EnvReads._reader()
            record.scans.setdefault(reader, KNOWN_SCANS.get(reader))
            return iterate(environ)

        self.cwd = os.getcwd()
        # patch: prefork_env_reads (verl_stable.compat.catalogue)
        environ_cls.__getitem__, environ_cls.__iter__ = recorded_getitem, recorded_iter
        try:
            yield self
        finally:
            environ_cls.__getitem__, environ_cls.__iter__ = getitem, iterate

    def unknown_scans(self) -> list[str]:
        """Modules that walked the whole environment for a prefix this module does not know."""
        return sorted(m for m, prefix in self.scans.items() if prefix is None)


def import_time_differences(
    reads: EnvReads, server_env: Mapping[str, str], child_env: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """Which variables a child would see differently from what the preload saw, and which of them can be fixed.

    Compared: every variable the preload read (:attr:`EnvReads.values`, against the value it read), every variable
    under a scanned prefix and under :data:`NATIVE_PREFIXES` (against the server's environment, where either side
    sets it), :data:`NATIVE_EXEMPT` left out.

    Returns:
        ``(refused, fixed)``: names whose difference rules the fork out, and names among
        :data:`THREAD_VARIABLES` whose difference the child fixes (a positive integer in the child's environment).
    """
    seen: dict[str, str | None] = dict(reads.values)
    prefixes = (*NATIVE_PREFIXES, *(p for p in reads.scans.values() if p))
    for name in set(server_env) | set(child_env):
        if name.startswith(prefixes) and name not in NATIVE_EXEMPT:
            seen.setdefault(name, server_env.get(name))
    refused, fixed = [], []
    for name, value in sorted(seen.items()):
        if child_env.get(name) == value:
            continue
        if name in THREAD_VARIABLES and child_env.get(name, "").isdigit() and int(child_env[name]) > 0:
            fixed.append(name)
        else:
            refused.append(name)
    return refused, fixed


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


def _receive(conn: socket.socket) -> tuple[Request, list[int]]:
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
            request, fds = _receive(conn)
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
            _send(conn, f"refused {exc}")
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
        _send(conn, f"pid {pid}")
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
                _send(conn, f"exit {os.waitstatus_to_exitcode(status)}")
                conn.close()


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass  # the client is gone; its child dies with its lifeline


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
    """``sys.stdin``/``stdout``/``stderr`` over the new descriptors 0-2, buffered as Python's start-up would buffer them.

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
    """In the child: when Ray sets ``OMP_NUM_THREADS`` (:data:`RAY_THREAD_SETTER`), apply it as ``torch.set_num_threads``.

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
    of ``fixed`` applied (or Ray's, when Ray sets it later: :func:`_apply_rays_thread_count`), NumPy's global generator reseeded from the OS (a fresh process seeds it so; forked
    children would share one), ``sys.argv`` and ``sys.path[0]`` as ``python <script>`` or ``python -m`` sets them.
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


def preload(modules: Sequence[str] = PRELOAD) -> EnvReads:
    """Import ``modules`` while recording their reads of the environment.

    The skip groups the environment names (:mod:`verl_stable.compat.skip_imports`) are installed first, as the
    plugin installs them in every verl process, so that a preloaded package never imports one.

    Raises:
        RuntimeError: a module of :data:`NEVER_PRELOADED` was imported, or an import walked the environment for a
            prefix not in :data:`KNOWN_SCANS` (no fork could be checked then).
    """
    from verl_stable.compat import skip_imports

    reads = EnvReads()
    with reads.recording():
        skip_imports.install(skip_imports.requested())
        for name in modules:
            importlib.import_module(name)
    loaded = sorted(m for m in NEVER_PRELOADED if m in sys.modules)
    if loaded:
        raise RuntimeError(f"the preload imported {loaded}; those must be imported by each process itself")
    if reads.unknown_scans():
        raise RuntimeError(f"imports walked the whole environment: {reads.unknown_scans()}; cannot check forks")
    return reads


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the prefork server (started by PreforkServer)")
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


def _py_executable_plugin() -> str:
    from ray._private.runtime_env.py_executable import PyExecutablePlugin

    if PyExecutablePlugin.name != "py_executable":
        raise AttributeError(f"the plugin is named {PyExecutablePlugin.name!r}")
    return "Ray starts workers with runtime_env['py_executable']"


def _rays_thread_setter() -> str:
    import importlib as _importlib
    import inspect

    module = _importlib.import_module(RAY_THREAD_SETTER)
    source = inspect.getsource(module.set_omp_num_threads_if_unset)
    if 'os.environ["OMP_NUM_THREADS"]' not in source:
        raise AttributeError("set_omp_num_threads_if_unset no longer sets os.environ['OMP_NUM_THREADS'] itself")
    return f"{RAY_THREAD_SETTER}.set_omp_num_threads_if_unset sets OMP_NUM_THREADS in os.environ"


CONTRACTS: tuple[Contract, ...] = (
    Contract("ray_py_executable", "Ray's runtime_env py_executable plugin", _py_executable_plugin),
    # the child applies Ray's thread count when this function sets it (_apply_rays_thread_count); if Ray set it
    # elsewhere, a forked actor would keep the server's thread count and compute in another order than a plain one
    Contract("ray_omp_num_threads", "where Ray sets an actor's OMP_NUM_THREADS", _rays_thread_setter),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the prefork server's contracts with Ray (all by default); never raises."""
    return contracts.check(CONTRACTS, names)


# the server runs as ``python -c``: this module keeps its own name (never ``__main__``, which is the name the child's
# script runs under), so that frames of this module are told apart from the child's
_SERVER_MAIN = "import sys; from verl_stable.cpu.prefork import main; sys.exit(main(sys.argv[1:]))"


def client_command() -> list[str]:
    """The command in front of a process's arguments that routes it through the server (``-I -S``: no site)."""
    return [sys.executable, "-I", "-S", prefork_client.__file__]


def enabled(env: Mapping[str, str]) -> bool:
    """Whether a run with ``env`` uses the server: Linux, and ``VERL_STABLE_PREFORK`` not ``0``.

    Raises:
        ValueError: ``VERL_STABLE_PREFORK`` is set to something other than ``0`` or ``1``.
    """
    value = env.get(ENV_SWITCH, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH} must be 0 or 1, got {value!r}")
    return value == "1" and sys.platform.startswith("linux")


class ServerProcess:
    """A prefork server for one run, started with ``env`` in ``cwd``; :meth:`stop` (or the ``with`` block) ends it.

    ``env`` and ``cwd`` must be those of the run's processes (the driver's: Ray's workers inherit both), or every
    request is refused. It preloads ``modules`` (:data:`PRELOAD`; tests pass cheap ones). The server's log is ``log_path``. It exits by itself when this process dies (the lifeline), and waits for the
    children it forked before it exits.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike,
        env: Mapping[str, str],
        log_path: str | os.PathLike,
        cwd: str | os.PathLike,
        modules: Sequence[str] = PRELOAD,
    ) -> None:
        self.socket_path = Path(socket_path)
        lifeline_r, self._lifeline_w = os.pipe()
        cmd = [sys.executable, "-c", _SERVER_MAIN, "--socket", str(self.socket_path)]
        cmd += ["--lifeline-fd", str(lifeline_r), "--modules", ",".join(modules)]
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(lifeline_r,),
            )
        os.close(lifeline_r)
        deadline = time.monotonic() + 30.0
        while not self.socket_path.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the socket is bound before the imports start: a few ms

    def env(self) -> dict[str, str]:
        """The variable that points a run's processes at this server."""
        return {ENV_SOCKET: str(self.socket_path)}

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._lifeline_w >= 0:
            os.close(self._lifeline_w)
            self._lifeline_w = -1
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
