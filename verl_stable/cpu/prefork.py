"""verl's processes forked from one that has already imported torch and transformers: starting the prefork server.

A verl run on the CPU is about ten Python processes -- the driver, the task runner, TransferQueue's controller and
storage, the actor, the rollout server, the reward-loop and agent-loop workers, the load balancer -- and each spends
~7 s of CPU importing torch, transformers, datasets, peft and verl before it does anything; verl starts most of them
one after another. The prefork server imports the heavy packages that do not import Ray once, then forks a child for
each process of the run, which imports only what is left (verl and Ray, ~1.2 s) and runs as the process would have
run. Nothing of verl or Ray is changed: Ray's documented ``runtime_env["py_executable"]`` (the command a worker is
started with) is set to the client (:func:`client_command`), which asks the server for a fork and otherwise becomes
plain Python. Linux only (``fork`` and ``SCM_RIGHTS``).

This module is the launcher's side: whether a run uses the server (:func:`enabled`), the server process of a run
(:class:`ServerProcess`), the client command, and the contracts with Ray the server relies on. The rest:

* :mod:`verl_stable.cpu.prefork_client` -- the client a process is started with (standard library only).
* :mod:`verl_stable.cpu.prefork_protocol` -- the request and answers between client and server.
* :mod:`verl_stable.cpu.prefork_preload` -- what the server imports, what those imports read of the environment, and
  which differences between the server's environment and a child's rule a fork out.
* :mod:`verl_stable.cpu.prefork_server` -- the server's loop and what a forked child does to become its process.

**What is measured** (``python benchmarks/bench_run_startup.py``: a run's wall 0.567x and CPU 0.517x of the same run
without the server; a forked run logs the plain run's values bit for bit) is in ``docs/explanation/cpu-runtime.md`` and
``docs/explanation/benchmarks.md``; ``VERL_STABLE_PREFORK=0`` turns it off for a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractResult
from verl_stable.cpu import prefork_client
from verl_stable.cpu.prefork_preload import PRELOAD, RAY_THREAD_SETTER

ENV_SOCKET = prefork_client.ENV_SOCKET
ENV_SWITCH = "VERL_STABLE_PREFORK"


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
    # the child applies Ray's thread count when this function sets it (prefork_server._apply_rays_thread_count); if
    # Ray set it elsewhere, a forked actor would keep the server's thread count and compute in another order than a
    # plain one
    Contract("ray_omp_num_threads", "where Ray sets an actor's OMP_NUM_THREADS", _rays_thread_setter),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the prefork server's contracts with Ray (all by default); never raises."""
    return contracts.check(CONTRACTS, names)


# the server runs as ``python -c``: its module keeps its own name (never ``__main__``, which is the name the child's
# script runs under), so that frames of the server's modules are told apart from the child's
_SERVER_MAIN = "import sys; from verl_stable.cpu.prefork_server import main; sys.exit(main(sys.argv[1:]))"


def client_command() -> list[str]:
    """The command in front of a process's arguments that routes it through the server (``-I -S``: no site)."""
    return [sys.executable, "-I", "-S", prefork_client.__file__]


def enabled(env: Mapping[str, str]) -> bool:
    """Whether a run with ``env`` uses the server: Linux, and ``VERL_STABLE_PREFORK`` not ``0``.

    Raises:
        verl_stable.env_vars.EnvVarError: (a ``ValueError``) ``VERL_STABLE_PREFORK`` is set to something other than
            ``0`` or ``1``; the one reader of the variable (:data:`verl_stable.env_vars.PREFORK`).
    """
    from verl_stable import env_vars

    return env_vars.PREFORK.read(env) and sys.platform.startswith("linux")


class ServerProcess:
    """A prefork server for one run, started with ``env`` in ``cwd``; :meth:`stop` (or the ``with`` block) ends it.

    ``env`` and ``cwd`` must be those of the run's processes (the driver's: Ray's workers inherit both), or every
    request is refused. It preloads ``modules`` (:data:`~verl_stable.cpu.prefork_preload.PRELOAD`; tests pass cheap
    ones). The server's log is ``log_path``. It exits by itself when this process dies (the lifeline), and waits for
    the children it forked before it exits.
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
