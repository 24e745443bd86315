"""verl's trainer (``python -m verl.trainer.main_ppo``) as a subprocess on the CPU runtime, and the metrics it logs.

:func:`run_main_ppo` starts it with the CPU platform selected (:func:`cpu_env`), its log in a file and its per-step
metrics in a JSON-lines file (verl's ``file`` logger, read back with :func:`read_metrics`). Every run gets a Ray
temporary directory of its own (:func:`ray_tmpdir`, passed as ``RAY_TMPDIR``), so concurrent runs and users on one
machine never share Ray's session directories or sockets; a Ray node that times out while starting (an overloaded
host) is retried. The variables it sets for verl's processes also travel in the Ray job's ``runtime_env``
(:func:`job_env`), so that they reach every node of a cluster the run joins (``ray_kwargs.ray_init.address``).

A second run in the same directory never destroys the first: :func:`set_aside` moves the earlier run's log and metrics
(verl's file logger opens its file with mode ``"wb"``) into ``superseded/<time>/`` before the new run starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from verl_stable import env_vars
from verl_stable.compat.skip_imports import ENV_SKIP_IMPORTS
from verl_stable.cpu import prefork
from verl_stable.cpu.polling import ENV_POLL_INTERVAL

DEFAULT_POLL_INTERVAL_S = 0.1
"""The replay buffer's poll interval in a CPU run, unless given or set in ``VERL_STABLE_POLL_INTERVAL_S`` (verl: 2 s,
most of a tiny CPU step)."""

# Ray's head serves two Prometheus endpoints on fixed ports (the autoscaler monitor's 44217 and the dashboard's 44227),
# whatever include_dashboard says: a second Ray instance on the host (the other run of a lab sweep) fails to bind them
# and logs "Address already in use" tracebacks into its session's monitor.log and dashboard.log. Port 0 lets every
# instance take a free port of its own. (The dashboard agent's HTTP port 52365 cannot be set through ray.init; the
# second instance's agent runs without its HTTP service, which nothing in a verl run uses.)
RAY_FIXED_PORT_ENV = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")


def cpu_env(
    metrics_file: str | os.PathLike | None = None,
    poll_interval_s: float | None = DEFAULT_POLL_INTERVAL_S,
    base: dict | None = None,
) -> dict[str, str]:
    """Environment for a CPU ``main_ppo`` subprocess: platform choice, poll interval, metrics file, and Ray's fixed
    metrics ports made free (:data:`RAY_FIXED_PORT_ENV`; a value the caller set wins)."""
    env = dict(os.environ if base is None else base)
    env["VERL_PLATFORM"] = "cpu"
    for name in RAY_FIXED_PORT_ENV:
        env.setdefault(name, "0")
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    if poll_interval_s is not None:
        env[ENV_POLL_INTERVAL] = str(poll_interval_s)
    if metrics_file is not None:
        env["VERL_FILE_LOGGER_PATH"] = str(metrics_file)
    return env


# verl merges ``ray_kwargs.ray_init.runtime_env`` over its defaults and passes it to ``ray.init``: the Ray job's
# runtime_env, whose ``env_vars`` Ray sets in every worker process of the job, on every node of the cluster.
JOB_ENV_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"


def hydra_quote(value: str) -> str:
    """``value`` as a quoted hydra override value that composes back to exactly this string.

    Quoting keeps a value such as ``0.1`` or ``true`` a string (Ray wants string ``env_vars``); quotes and the
    backslashes before them are escaped, and ``${`` is escaped so that OmegaConf does not read an interpolation.
    """
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)  # before the closing quote
    return "'" + escaped.replace("${", "\\${") + "'"


def job_env_overrides(env_vars: dict[str, str]) -> list[str]:
    """Hydra overrides that set ``env_vars`` in every process of the Ray job ``main_ppo`` starts, on every node.

    ``++`` adds each variable to ``ray_kwargs.ray_init.runtime_env.env_vars`` or replaces its value, so the overrides
    compose on verl's config and on a recipe that already sets the variable.
    """
    for name in env_vars:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"environment variable name {name!r} cannot be a config key")
    return [f"++{JOB_ENV_KEY}.{name}={hydra_quote(str(value))}" for name, value in env_vars.items()]


# Forwarded to every process of the Ray job: verl's and verl-stable's variables (platform choice, poll interval, metrics
# file, VERL_STABLE_SKIP_STEPS ...), which the hf servers also receive, and the tokenizers setting.
JOB_ENV_PREFIXES = ("VERL_",)
JOB_ENV_NAMES = ("TOKENIZERS_PARALLELISM",)


def job_env(env: dict[str, str], overrides: Sequence[str] = ()) -> list[str]:
    """Overrides that put ``env``'s verl variables into the Ray job's ``runtime_env``, for every node of the cluster.

    A Ray instance that ``main_ppo`` starts itself gives its workers the driver's environment; the nodes of a cluster
    started beforehand (``ray start``, joined with ``ray_kwargs.ray_init.address``) give them their own, so without
    these a worker on such a node would not select the CPU platform (verl would pick NCCL) nor find the metrics file.
    A variable that ``overrides`` already set under ``ray_kwargs.ray_init.runtime_env.env_vars`` is left to them.
    """
    given = {item.split("=", 1)[0].lstrip("+~") for item in overrides}
    chosen = {
        name: value
        for name, value in sorted(env.items())
        if (name.startswith(JOB_ENV_PREFIXES) or name in JOB_ENV_NAMES) and f"{JOB_ENV_KEY}.{name}" not in given
    }
    return job_env_overrides(chosen)


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Per-step metric dicts from verl's file logger (``{"step": s, "data": {...}}`` per line)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append({"step": record["step"], **record["data"]})
    return rows


METRICS_NAME = "metrics.jsonl"
SUPERSEDED = "superseded"


def set_aside(run_dir: str | os.PathLike, names: Sequence[str]) -> Path | None:
    """Move the files ``names`` that an earlier run left in ``run_dir`` into ``run_dir/superseded/<UTC time>/``.

    What a run measured (its metrics, its log, a failure's message) is moved, never deleted or truncated, so a run
    that starts over in the same directory (``verl-stable run``, a lab run measured again) keeps the earlier one's.

    Returns:
        The folder the files went to, or None when none of them existed.
    """
    run_dir = Path(run_dir)
    files = [run_dir / n for n in names if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not files:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    dest, i = run_dir / SUPERSEDED / stamp, 0
    while True:  # exist_ok=False claims the folder, so two runs setting aside in the same second never share one
        try:
            dest.mkdir(parents=True)
            break
        except FileExistsError:
            i += 1
            dest = run_dir / SUPERSEDED / f"{stamp}_{i}"
    for f in files:
        f.rename(dest / f.name)
    return dest


def _named_config_text(overrides: Sequence[str]) -> str:
    """The lower-cased text of the config file ``--config-path`` / ``--config-name`` name (``""`` when none is)."""
    options = dict(item.split("=", 1) for item in overrides if item.startswith("--config-") and "=" in item)
    if "--config-name" not in options:
        return ""
    name = options["--config-name"]
    config = Path(options.get("--config-path", ".")) / (name if name.endswith(".yaml") else f"{name}.yaml")
    return config.read_text(errors="ignore").lower() if config.is_file() else ""


def mentions_megatron(overrides: Sequence[str]) -> bool:
    """Whether a run may build a Megatron engine: an override, or the config file ``--config-path`` /
    ``--config-name`` name, mentions Megatron (conservative: any mention counts, so a Megatron run is never refused
    its engine; the others skip megatron-core's import, :mod:`verl_stable.compat.skip_imports`)."""
    return any("megatron" in item.lower() for item in overrides) or "megatron" in _named_config_text(overrides)


_HF_ROLLOUT = "actor_rollout_ref.rollout.name=hf"
# a reward model or a distillation teacher is served by its own rollout engine (vLLM by verl's default)
_OTHER_ENGINE = re.compile(r"(reward_model|teacher)[^=]*\.enable=true", re.IGNORECASE)


def rollout_needs_vllm(overrides: Sequence[str]) -> bool:
    """Whether a run may import vLLM: anything but an ``hf`` rollout that nothing else asks vLLM of (conservative).

    verl's default rollout is vLLM, so only an explicit ``actor_rollout_ref.rollout.name=hf`` override says a run does
    without it; any other override mentioning vLLM or enabling a reward model or teacher (each served by its own
    rollout engine), or a named config file mentioning either, keeps vLLM importable."""
    if _HF_ROLLOUT not in overrides:
        return True
    if any("vllm" in item.lower() or _OTHER_ENGINE.search(item) for item in overrides):
        return True
    config = _named_config_text(overrides)
    return "reward_model" in config or "teacher" in config


def skip_groups(overrides: Sequence[str]) -> tuple[str, ...]:
    """The :data:`verl_stable.compat.skip_imports.GROUPS` a run launched with ``overrides`` does not need."""
    return tuple(
        group
        for group, needed in (("megatron", mentions_megatron(overrides)), ("vllm", rollout_needs_vllm(overrides)))
        if not needed
    )


_RAY_START_FAILURE = "The current node timed out during startup"

RAY_TMPDIR_NAME = "ray_tmp"
# Ray puts its unix sockets at <RAY_TMPDIR>/ray/session_<date>_<time>_<microseconds>_<pid>/sockets/<name>; this is the
# longest such tail (pid up to Linux's 4194304, a numbered plasma_store socket). A socket path holds at most 107 bytes
# on Linux and 103 on macOS, and Ray refuses longer ones only once the node starts.
_RAY_SOCKET_TAIL = "/ray/session_2000-01-01_00-00-00_000000_4194304/sockets/plasma_store.99"
_SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107


def _fits_ray_sockets(path: Path) -> bool:
    return len(str(path).encode()) + len(_RAY_SOCKET_TAIL) <= _SOCKET_PATH_MAX


def ray_tmpdir(workdir: str | os.PathLike) -> Path:
    """The Ray temporary directory of a run in ``workdir`` (created; Ray adds ``ray/session_*`` below it).

    ``workdir/ray_tmp`` when Ray's socket paths below it fit the unix-socket limit. A deeper workdir gets a short
    directory of its own in the system temp dir instead, named by the user id and a hash of ``workdir`` (mode 0700,
    so another user cannot share or pre-create it), and ``workdir/ray_tmp`` becomes a link to it.

    Raises:
        PermissionError: The short directory exists but is not a directory owned by this user.
        ValueError: No candidate directory is short enough.
    """
    workdir = Path(workdir).resolve()
    own = workdir / RAY_TMPDIR_NAME
    if _fits_ray_sockets(own):
        if own.is_symlink():  # left by an earlier run when the path was handled as too long
            own.unlink()
        own.mkdir(parents=True, exist_ok=True)
        return own
    uid = os.getuid() if hasattr(os, "getuid") else 0
    name = f"vs-ray-{uid}-{hashlib.sha256(str(workdir).encode()).hexdigest()[:12]}"
    for root in dict.fromkeys((Path(tempfile.gettempdir()), Path("/tmp"))):
        short = root / name
        if not _fits_ray_sockets(short):
            continue
        short.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(short)
        if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != uid):
            raise PermissionError(
                f"Ray temporary directory {short} is not a directory owned by user {uid}; expected one this user "
                "created (remove it or run from a shorter --workdir)"
            )
        workdir.mkdir(parents=True, exist_ok=True)
        if own.is_symlink() or not own.exists():
            own.unlink(missing_ok=True)
            own.symlink_to(short, target_is_directory=True)
        return short
    raise ValueError(
        f"no Ray temporary directory short enough for unix sockets ({_SOCKET_PATH_MAX} bytes with "
        f"{len(_RAY_SOCKET_TAIL)} for Ray's session path) under {workdir} or the system temp dir"
    )


def run_main_ppo(
    overrides: Sequence[str],
    workdir: str | os.PathLike,
    *,
    timeout_s: float | None = None,
    poll_interval_s: float | None = None,
    log_name: str = "main_ppo.log",
    ray_start_retries: int = 2,
) -> subprocess.CompletedProcess:
    """Run ``python -m verl.trainer.main_ppo`` with ``overrides`` in ``workdir`` (log in ``workdir/log_name``).

    Ray gives its local node a fixed 30 s to start; on an overloaded host that fails before verl runs, so such a
    start-up failure (and only that) is retried up to ``ray_start_retries`` times. Ray's temporary files (sessions,
    sockets, logs) go to the run's own :func:`ray_tmpdir`. The run's verl variables are also passed in the Ray job's
    ``runtime_env`` (:func:`job_env`): a run joining a cluster (``+ray_kwargs.ray_init.address=...``) then has them on
    every node. The log and metrics of an earlier run in ``workdir`` are first moved aside (:func:`set_aside`; the
    folder is printed on stderr): the log is opened with mode ``"w"`` and verl's file logger opens the metrics with
    ``"wb"``, so they would be emptied. A run gets ``VERL_STABLE_SKIP_IMPORTS`` for the packages it does not need
    (:func:`skip_groups`: megatron-core when nothing mentions Megatron, vLLM for an ``hf`` rollout), unless the
    caller's environment sets the variable, even empty: verl would otherwise import both in each of its processes.
    The replay buffer polls every ``poll_interval_s`` seconds; None: the environment's
    ``VERL_STABLE_POLL_INTERVAL_S`` when set, else :data:`DEFAULT_POLL_INTERVAL_S`.

    Raises:
        ValueError: a ``VERL_STABLE_*`` variable :func:`verl_stable.env_vars.check_all` refuses; before the earlier
            run's files are moved or anything starts.
    """
    env_vars.check()  # the run's processes read them: refused before anything is moved aside or started
    if poll_interval_s is None:
        poll_interval_s = env_vars.POLL_INTERVAL_S.read() or DEFAULT_POLL_INTERVAL_S
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    aside = set_aside(workdir, (log_name, METRICS_NAME))
    if aside is not None:
        print(f"verl-stable: the earlier run's files in {workdir} were moved to {aside}", file=sys.stderr)
    env = cpu_env(workdir / METRICS_NAME, poll_interval_s)
    env["RAY_TMPDIR"] = str(ray_tmpdir(workdir))
    if ENV_SKIP_IMPORTS not in env and (groups := skip_groups(overrides)):
        env[ENV_SKIP_IMPORTS] = ",".join(groups)  # saves every verl process of the run importing them
    with _prefork_server(env, workdir, overrides) as (python, extra):
        cmd = [*python, "-m", "verl.trainer.main_ppo", *overrides, *extra, *job_env(env, overrides)]
        for attempt in range(ray_start_retries + 1):
            with open(workdir / log_name, "w") as log:
                proc = subprocess.run(
                    cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
                )
            if proc.returncode == 0 or _RAY_START_FAILURE not in (workdir / log_name).read_text(errors="ignore"):
                return proc
            print(f"Ray node start-up timed out (attempt {attempt + 1}); retrying", file=sys.stderr)
    return proc


PREFORK_LOG = "prefork.log"
_PY_EXECUTABLE_KEY = "ray_kwargs.ray_init.runtime_env.py_executable"


@contextmanager
def _prefork_server(
    env: dict[str, str], workdir: Path, overrides: Sequence[str]
) -> Iterator[tuple[list[str], list[str]]]:
    """The interpreter command for the driver and the overrides that start every Ray worker through the prefork server.

    With :func:`verl_stable.cpu.prefork.enabled` (the default on Linux; ``VERL_STABLE_PREFORK=0`` turns it off), a
    server is started for the run (its log ``workdir/prefork.log``) unless ``env`` already names one (a sweep's,
    ``VERL_STABLE_PREFORK_SOCKET``); ``env`` gains the variable, and Ray's ``runtime_env.py_executable`` becomes the
    client. An override of ``py_executable`` by the caller wins: the workers then start as it says, the driver
    still through the server. Off, the driver is plain ``sys.executable`` and nothing is added.
    """
    if not prefork.enabled(env):
        yield [sys.executable], []
        return
    client = prefork.client_command()
    given = {item.split("=", 1)[0].lstrip("+~") for item in overrides}
    extra = [] if _PY_EXECUTABLE_KEY in given else [f"++{_PY_EXECUTABLE_KEY}={hydra_quote(shlex.join(client))}"]
    if env.get(prefork.ENV_SOCKET):  # run_main_ppo checked it (env_vars.PREFORK_SOCKET) before anything started
        yield client, extra
        return
    with prefork.ServerProcess(ray_tmpdir(workdir) / "prefork.sock", env, workdir / PREFORK_LOG, workdir) as server:
        env.update(server.env())
        yield client, extra
