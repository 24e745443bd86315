"""One-command CPU runs of verl's own trainer (``python -m verl.trainer.main_ppo``) with the CPU runtime.

:func:`cpu_overrides` returns the hydra overrides a CPU run needs (platform, fake Ray GPU for placement, gloo, sdpa,
one TransferQueue storage unit, the ``hf`` rollout backend, tiny batch sizes, the toy reward). :func:`main` checks its
arguments and the composed config (:func:`verl_stable.recipes.preflight`), builds the tiny assets if missing and runs
``main_ppo`` in a subprocess with ``VERL_PLATFORM=cpu``; extra ``key=value`` arguments are appended and win. Per-step
metrics go to a JSON-lines file (verl's ``file`` logger).

Every run gets a Ray temporary directory of its own (:func:`ray_tmpdir`, passed as ``RAY_TMPDIR``), so concurrent runs
and users on one machine never share Ray's session directories or sockets.

    python -m verl_stable.cpu.launch --workdir /tmp/run trainer.total_training_steps=3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from verl_stable.cpu import vllm_rollout
from verl_stable.cpu.polling import ENV_POLL_INTERVAL
from verl_stable.lab import tasks
from verl_stable.lab.assets import Assets, AssetSpec, asset_paths, ensure_assets
from verl_stable.lab.variants import PRECISIONS

# Overrides every CPU run needs, independent of the model/data; each says why where it is not obvious.
RUNTIME_OVERRIDES: tuple[str, ...] = (
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "+ray_kwargs.ray_init.num_gpus=1",  # a fake Ray GPU: verl's resource pools count GPUs
    "ray_kwargs.ray_init.num_cpus=16",  # TransferQueue actors need more CPU slots than a 2-core host has
    "+ray_kwargs.ray_init.include_dashboard=False",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.model.use_remove_padding=False",  # flash-attn varlen path is GPU-only
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "data.dataloader_num_workers=0",
)


ENGINES = ("hf", "vllm")
# vLLM's CPU build serves these rollout precisions (verl's ``rollout.dtype``); fp8/fp16 weights are the hf backend's.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def asset_spec(engine: str = "hf", task: str = "copy") -> AssetSpec:
    """The tiny assets a CPU run of ``engine`` uses: vLLM's CPU attention needs a head size of 32 (2 heads of 64)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "vllm":
        return AssetSpec(task=task, num_attention_heads=2, num_key_value_heads=1)
    return AssetSpec(task=task)


def engine_overrides(engine: str, precision: str | None, sync_weights: bool) -> list[str]:
    """The rollout-engine part of :func:`cpu_overrides` (backend name, precision, weight sync).

    Raises:
        ValueError: an unknown engine, or a precision / ``sync_weights=False`` that the engine does not offer.
    """
    if engine == "hf":
        ov = [
            "actor_rollout_ref.rollout.name=hf",
            f"+actor_rollout_ref.rollout.engine_kwargs.hf.sync_weights={sync_weights}",
        ]
        if precision is not None:
            ov.append(f"+actor_rollout_ref.rollout.engine_kwargs.hf.precision={precision}")
        return ov
    if engine != "vllm":
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not sync_weights:
        raise ValueError("engine vllm always syncs weights (verl starts vLLM on dummy weights); --no-sync is hf-only")
    if precision is not None and precision not in VLLM_DTYPES:
        raise ValueError(f"engine vllm serves precision {sorted(VLLM_DTYPES)} on CPU, got {precision!r} (fp8/fp16: hf)")
    ov = list(vllm_rollout.RUNTIME_OVERRIDES)
    if precision is not None:
        ov.append(f"actor_rollout_ref.rollout.dtype={VLLM_DTYPES[precision]}")
    return ov


def cpu_overrides(
    assets: Assets,
    *,
    steps: int = 3,
    batch_size: int = 4,
    group_size: int = 4,
    max_prompt_length: int = 16,
    max_response_length: int = 4,
    precision: str | None = None,
    sync_weights: bool = True,
    rollout_is: str | None = "token",
    routing_capture: bool = False,
    kl_loss_coef: float | None = None,
    metrics_logger: Sequence[str] = ("console", "file"),
    engine: str = "hf",
) -> list[str]:
    """Hydra overrides for a GRPO run of the tiny assets on the CPU runtime.

    Args:
        assets: paths from :func:`verl_stable.lab.assets.ensure_assets`.
        steps: ``trainer.total_training_steps``.
        batch_size: prompts per step (also the PPO mini-batch: one update per step).
        group_size: samples per prompt (GRPO group, ``rollout.n``).
        precision: rollout precision: ``hf`` fp32 | bf16 | fp16 | fp8 (weights), ``vllm`` fp32 | bf16 (``rollout.dtype``);
            None keeps ``rollout.dtype``.
        sync_weights: False leaves the ``hf`` rollout at the initial weights (deliberate drift, for checks).
        rollout_is: verl's rollout correction ``rollout_is`` (token | sequence | None).
        routing_capture: ``rollout.enable_rollout_routing_replay`` (routing export from the hf backend).
        kl_loss_coef: with a value, ``actor.use_kl_loss=True`` at that coefficient (``low_var_kl``): verl builds a
            forward-only reference engine and logs ``actor/kl_loss``. None: no KL loss, no reference model.
        engine: rollout engine, ``hf`` (the project's backend) or ``vllm`` (verl's own vLLM rollout on vLLM's CPU
            build; assets from :func:`asset_spec`).
    """
    reward_path = tasks.__file__
    ov = [o for o in RUNTIME_OVERRIDES if not o.startswith("actor_rollout_ref.rollout.name=")]
    ov += engine_overrides(engine, precision, sync_weights)
    ov += [
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"data.train_batch_size={batch_size}",
        f"data.max_prompt_length={max_prompt_length}",
        f"data.max_response_length={max_response_length}",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={group_size}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch_size * group_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch_size * group_size}",
        f"actor_rollout_ref.actor.use_kl_loss={kl_loss_coef is not None}",
        "algorithm.use_kl_in_reward=False",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.enable_rollout_routing_replay={routing_capture}",
        f"reward.custom_reward_function.path={reward_path}",
        "reward.custom_reward_function.name=compute_score",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.project_name=verl_stable_cpu",
        "trainer.experiment_name=cpu_run",
        "trainer.logger=[" + ",".join(f'"{x}"' for x in metrics_logger) + "]",
    ]
    if kl_loss_coef is not None:
        ov += [
            f"actor_rollout_ref.actor.kl_loss_coef={kl_loss_coef}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={batch_size * group_size}",
        ]
    if rollout_is is not None:
        ov.append(f"algorithm.rollout_correction.rollout_is={rollout_is}")
    return ov


def cpu_env(
    metrics_file: str | os.PathLike | None = None, poll_interval_s: float | None = 0.1, base: dict | None = None
) -> dict[str, str]:
    """Environment for a CPU ``main_ppo`` subprocess: platform choice, poll interval, metrics file."""
    env = dict(os.environ if base is None else base)
    env["VERL_PLATFORM"] = "cpu"
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    if poll_interval_s is not None:
        env[ENV_POLL_INTERVAL] = str(poll_interval_s)
    if metrics_file is not None:
        env["VERL_FILE_LOGGER_PATH"] = str(metrics_file)
    return env


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Per-step metric dicts from verl's file logger (``{"step": s, "data": {...}}`` per line)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append({"step": record["step"], **record["data"]})
    return rows


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
    poll_interval_s: float | None = 0.1,
    log_name: str = "main_ppo.log",
    ray_start_retries: int = 2,
) -> subprocess.CompletedProcess:
    """Run ``python -m verl.trainer.main_ppo`` with ``overrides`` in ``workdir`` (log in ``workdir/log_name``).

    Ray gives its local node a fixed 30 s to start; on an overloaded host that fails before verl runs, so such a
    start-up failure (and only that) is retried up to ``ray_start_retries`` times. Ray's temporary files (sessions,
    sockets, logs) go to the run's own :func:`ray_tmpdir`.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = cpu_env(workdir / "metrics.jsonl", poll_interval_s)
    env["RAY_TMPDIR"] = str(ray_tmpdir(workdir))
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    for attempt in range(ray_start_retries + 1):
        with open(workdir / log_name, "w") as log:
            proc = subprocess.run(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        if proc.returncode == 0 or _RAY_START_FAILURE not in (workdir / log_name).read_text(errors="ignore"):
            return proc
        print(f"Ray node start-up timed out (attempt {attempt + 1}); retrying", file=sys.stderr)
    return proc


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: check the arguments, build tiny assets if missing, then run verl's trainer on CPU.

    Returns:
        The trainer's exit code (0 after ``--print-overrides``).

    Raises:
        SystemExit: code 2 for a bad argument or overrides that :func:`verl_stable.recipes.preflight` refuses (a
            malformed or unknown key, a config verl would reject), before any asset is built or verl started.
    """
    from verl_stable import recipes

    parser = argparse.ArgumentParser(prog="verl-stable run", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="./verl_stable_cpu_run", help="assets, checkpoints, logs, metrics")
    parser.add_argument("--task", default="copy", choices=tasks.TASKS)
    parser.add_argument("--steps", type=_positive_int, default=3)
    parser.add_argument("--engine", default="hf", choices=ENGINES, help="rollout engine (vllm: vLLM's CPU build)")
    parser.add_argument("--precision", default=None, choices=PRECISIONS, help="rollout precision (vllm: fp32, bf16)")
    parser.add_argument("--no-sync", action="store_true", help="skip weight sync to the hf rollout (drift check)")
    parser.add_argument(
        "--poll-interval", type=_positive_seconds, default=0.1, help="replay-buffer poll seconds (verl: 2.0)"
    )
    parser.add_argument("--print-overrides", action="store_true", help="print the overrides and exit")
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides key=value (appended, they win)")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    try:
        workdir = recipes.check_output_dir(args.workdir, "--workdir")
    except ValueError as exc:
        parser.error(str(exc))
    assets = asset_paths(workdir / "assets")  # where they will be; nothing is built before the checks pass
    try:
        ov = cpu_overrides(
            assets, steps=args.steps, precision=args.precision, sync_weights=not args.no_sync, engine=args.engine
        )
    except ValueError as exc:
        parser.error(str(exc))
    ov += [f"trainer.default_local_dir={workdir / 'checkpoints'}", *args.overrides]
    try:
        recipes.preflight(ov)
    except ValueError as exc:
        parser.error(str(exc))
    if args.print_overrides:
        print("\n".join(ov))
        return 0
    ensure_assets(workdir / "assets", asset_spec(args.engine, args.task))
    proc = run_main_ppo(ov, workdir, poll_interval_s=args.poll_interval)
    print(f"main_ppo exited {proc.returncode}; log: {workdir / 'main_ppo.log'}; metrics: {workdir / 'metrics.jsonl'}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
