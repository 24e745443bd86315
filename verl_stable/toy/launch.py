"""One-command CPU runs of verl's own trainer (``python -m verl.trainer.main_ppo``) with the CPU runtime.

:func:`cpu_overrides` returns the hydra overrides a CPU run needs (platform, fake Ray GPU for placement, gloo, sdpa,
one TransferQueue storage unit, the ``hf`` rollout backend, tiny batch sizes, the toy reward); :func:`regime_overrides`
turns a recipe's regime into such a run with the same N, loss and replay, and :func:`run_recipe` runs it. :func:`main`
(``verl-stable run``) checks its arguments and the composed config (:func:`verl_stable.recipes.preflight`), builds the
tiny assets (:mod:`verl_stable.toy.assets`) if missing and runs ``main_ppo`` in a subprocess with ``VERL_PLATFORM=cpu``;
extra ``key=value`` arguments are appended and win. Per-step metrics go to a JSON-lines file (verl's ``file`` logger).
A second run in the same ``--workdir`` first moves the earlier run's log and metrics to ``superseded/<time>/`` (and
says where), so nothing it measured is overwritten.

Running the subprocess (environment, a Ray temporary directory of its own, start-up retries, reading the metrics back)
is :mod:`verl_stable.toy.trainer_process`; its names stay importable from here.

    python -m verl_stable.toy.launch --workdir /tmp/run trainer.total_training_steps=3
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from verl_stable import env_vars, recipes
from verl_stable.argtypes import positive_int, positive_seconds, resolve_path
from verl_stable.backends.hf.options import PRECISIONS
from verl_stable.backends.vllm_cpu import rollout as vllm_rollout
from verl_stable.cpu import attention as varlen_attention
from verl_stable.cpu.megatron import options as megatron_options
from verl_stable.toy import tasks
from verl_stable.toy.assets import Assets, AssetSpec, asset_paths, ensure_assets
from verl_stable.toy.trainer_process import (
    DEFAULT_POLL_INTERVAL_S,
    RAY_TMPDIR_NAME,
    cpu_env,
    job_env_overrides,
    ray_tmpdir,
    read_metrics,
    run_main_ppo,
)

__all__ = [
    "ATTENTIONS",
    "CPU_GROUP_SIZE",
    "CPU_MINI_BATCH_PROMPTS",
    "ENGINES",
    "PRECISIONS",
    "RAY_TMPDIR_NAME",
    "RUNTIME_OVERRIDES",
    "VLLM_DTYPES",
    "asset_spec",
    "cpu_env",
    "cpu_overrides",
    "engine_overrides",
    "main",
    "ray_tmpdir",
    "read_metrics",
    "regime_overrides",
    "run_main_ppo",
    "run_recipe",
]

# Overrides every CPU run needs, independent of the model/data; each says why where it is not obvious.
RUNTIME_OVERRIDES: tuple[str, ...] = (
    "trainer.device=cpu",
    # VERL_PLATFORM=cpu in the Ray job's runtime_env: workers on nodes the driver did not start (a cluster joined with
    # ray_kwargs.ray_init.address) select the CPU platform too, instead of verl's default NCCL/CUDA
    *job_env_overrides({"VERL_PLATFORM": "cpu"}),
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "+ray_kwargs.ray_init.num_gpus=1",  # a fake Ray GPU: verl's resource pools count GPUs
    "ray_kwargs.ray_init.num_cpus=16",  # TransferQueue actors need more CPU slots than a 2-core host has
    "+ray_kwargs.ray_init.include_dashboard=False",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "actor_rollout_ref.actor.strategy=fsdp2",
    # flash-attn's varlen path is GPU-only; attention="varlen" swaps in verl_stable.cpu.attention (ATTENTIONS)
    "actor_rollout_ref.model.use_remove_padding=False",
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "reward.num_workers=1",
    "data.dataloader_num_workers=0",
)


# The actor's attention on CPU: padded batches with transformers' sdpa (the default), or packed batches
# (use_remove_padding) with the pure-torch varlen kernel, which also serves verl's Ulysses sequence parallelism.
ATTENTIONS: dict[str, tuple[str, ...]] = {
    "sdpa": (
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    ),
    "varlen": varlen_attention.OVERRIDES,
}

ENGINES = ("hf", "vllm")
# the actor back ends a recipe can run with on the CPU runtime
CPU_BACKENDS = ("fsdp", "megatron")
# what RUNTIME_OVERRIDES sets for the FSDP actor and a Megatron run must not: the strategy, padded batches
FSDP_ONLY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.model.use_remove_padding")
# vLLM's CPU build serves these rollout precisions (verl's ``rollout.dtype``); fp8/fp16 weights are the hf backend's.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def asset_spec(engine: str = "hf", task: str = "copy", actor: str = "fsdp") -> AssetSpec:
    """The tiny assets a CPU run of ``engine`` and the ``actor`` back end uses: vLLM's CPU attention needs a head size
    of 32 (2 heads of 64); verl's Megatron actor a pad-token embedding row that is not zero
    (:attr:`~verl_stable.toy.assets.AssetSpec.random_pad_row`)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if actor not in CPU_BACKENDS:
        raise ValueError(f"actor must be one of {CPU_BACKENDS}, got {actor!r}")
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1} if engine == "vllm" else {}
    return AssetSpec(task=task, random_pad_row=actor == "megatron", **heads)


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
    attention: str = "sdpa",
) -> list[str]:
    """Hydra overrides for a GRPO run of the tiny assets on the CPU runtime.

    Args:
        assets: paths from :func:`verl_stable.toy.assets.ensure_assets`.
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
        attention: the actor's (and reference's) attention, a key of :data:`ATTENTIONS`: ``sdpa`` (padded batches)
            or ``varlen`` (packed batches, :mod:`verl_stable.cpu.attention`; needed for Ulysses sp > 1).

    Raises:
        ValueError: an unknown attention, or an engine / precision :func:`engine_overrides` refuses.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {sorted(ATTENTIONS)}, got {attention!r}")
    reward_path = tasks.__file__
    chosen = {item.split("=", 1)[0]: item for item in ATTENTIONS[attention]}  # same keys for every attention
    ov = [
        chosen.get(o.split("=", 1)[0], o)
        for o in RUNTIME_OVERRIDES
        if not o.startswith("actor_rollout_ref.rollout.name=")
    ]
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


# A regime's recipe on the CPU: the paper's 64 prompts x 16 samples per mini-batch, scaled down.
CPU_MINI_BATCH_PROMPTS = 2
CPU_GROUP_SIZE = 4


def regime_overrides(
    regime: str | recipes.Regime,
    assets: Any,
    *,
    steps: int = 2,
    mini_batch_prompts: int = CPU_MINI_BATCH_PROMPTS,
    group_size: int = CPU_GROUP_SIZE,
    backend: str = "fsdp",
    engine: str = "hf",
    precision: str | None = None,
) -> list[str]:
    """Overrides that run a regime's recipe on the CPU runtime with the tiny assets, keeping its N, loss and replay.

    The runtime overrides come from :func:`cpu_overrides`; every key the recipe file sets itself is dropped from them
    (the recipe defines the regime), then the CPU geometry is appended: a mini-batch of
    ``mini_batch_prompts x group_size`` responses, ``N`` of them per step, one micro-batch per mini-batch.

    Args:
        regime: the regime (or its name, see :data:`verl_stable.recipes.REGIMES`).
        assets: :class:`verl_stable.toy.assets.Assets` (tiny MoE, tokenizer, parquet data).
        steps: ``trainer.total_training_steps``.
        mini_batch_prompts: prompts per mini-batch (the paper's 64, scaled down).
        group_size: samples per prompt (the paper's 16, scaled down).
        backend: ``fsdp`` or ``megatron`` (verl's Megatron engine under the Megatron CPU runtime, with the overrides
            of :func:`verl_stable.cpu.megatron.options.overrides`).
        engine: rollout engine (``hf`` or ``vllm``, see :func:`cpu_overrides`); its settings win over the recipe's.
        precision: rollout precision of ``engine`` (None: the engine's default).

    Raises:
        ValueError: An unknown backend, or an engine / precision :func:`engine_overrides` refuses.
    """
    if backend not in CPU_BACKENDS:
        raise ValueError(f"backend must be one of {CPU_BACKENDS} on the CPU runtime, got {backend!r}")
    regime = recipes.REGIMES[regime] if isinstance(regime, str) else regime
    own = set(recipes.recipe_keys(recipes.recipe_path(backend, regime.name)))
    train = mini_batch_prompts * regime.staleness
    runtime = cpu_overrides(
        assets,
        steps=steps,
        batch_size=train,
        group_size=group_size,
        rollout_is="token",
        routing_capture=regime.rollout_routing_export,
        engine=engine,
        precision=precision,
    )
    # the recipes name a GPU engine (vllm) and its settings: on CPU the engine's own overrides replace them
    forced = {item.split("=", 1)[0].lstrip("+~") for item in engine_overrides(engine, precision, True)}
    geometry = {
        "data.train_batch_size": train,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini_batch_prompts,
        "actor_rollout_ref.rollout.n": group_size,
        "actor_rollout_ref.actor.use_dynamic_bsz": False,
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": False,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": mini_batch_prompts * group_size,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": mini_batch_prompts * group_size,
    }
    kept = [
        item
        for item in runtime
        if (key := item.split("=", 1)[0].lstrip("+~")) in forced or (key not in own and key not in geometry)
    ]
    return for_actor(kept, backend) + [f"{k}={v}" for k, v in geometry.items()]


def for_actor(overrides: Sequence[str], backend: str) -> list[str]:
    """:func:`cpu_overrides` (written for the FSDP actor) for the actor ``backend``: ``fsdp`` unchanged; ``megatron``
    without the FSDP strategy and padded batches (verl's ``ppo_megatron_trainer`` chooses the strategy; Megatron trains
    packed), plus the Megatron CPU runtime's overrides (:func:`verl_stable.cpu.megatron.options.overrides`).

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in CPU_BACKENDS:
        raise ValueError(f"backend must be one of {CPU_BACKENDS} on the CPU runtime, got {backend!r}")
    if backend == "fsdp":
        return list(overrides)
    kept = [item for item in overrides if item.split("=", 1)[0].lstrip("+~") not in FSDP_ONLY_KEYS]
    return kept + megatron_options.overrides()


def run_recipe(
    regime: str,
    workdir: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    steps: int = 2,
    task: str = "copy",
    backend: str = "fsdp",
    engine: str = "hf",
) -> int:
    """Run ``recipes/<backend>/<regime>.yaml`` with verl's ``main_ppo`` on the CPU runtime (tiny MoE, toy task).

    ``backend`` is ``fsdp`` or ``megatron`` (verl's Megatron engine under the Megatron CPU runtime); ``engine`` the
    rollout, ``hf`` (the project's backend) or ``vllm`` (verl's vLLM rollout on vLLM's CPU build at verl's rollout dtype; the
    assets of :func:`asset_spec`).

    The arguments are checked first (:func:`verl_stable.recipes.preflight`); then the tiny assets are built under
    ``workdir/assets`` if missing; the log is ``workdir/run/main_ppo.log`` and the per-step metrics
    ``workdir/run/metrics.jsonl`` (an earlier run's are moved to ``workdir/run/superseded/<time>/`` first, see
    :func:`verl_stable.toy.trainer_process.set_aside`). Returns ``main_ppo``'s exit code.

    Raises:
        ValueError: An unknown regime or task, ``steps`` below 1, a ``workdir`` that cannot be resolved (a symlink
            loop) or that :func:`verl_stable.recipes.check_output_dir` refuses, or overrides that
            :func:`verl_stable.recipes.preflight` refuses, a malformed recipe file, or a ``VERL_STABLE_*`` variable
            :func:`verl_stable.env_vars.check_all` refuses; raised before anything is built or started.
    """
    recipes.check_backend_regime(backend, regime)
    if backend not in CPU_BACKENDS:
        raise ValueError(f"backend must be one of {CPU_BACKENDS} on the CPU runtime, got {backend!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if task not in tasks.TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {tasks.TASKS}")
    workdir = recipes.check_output_dir(resolve_path(workdir, "workdir"), "workdir")
    path = recipes.recipe_path(backend, regime)
    ov = regime_overrides(regime, asset_paths(workdir / "assets"), steps=steps, backend=backend, engine=engine)
    ov += [f"trainer.default_local_dir={workdir / 'checkpoints'}", *overrides]
    env_vars.check()  # read by the run's processes: refused before any asset is built
    recipes.preflight(ov, recipe=path, backend=backend)
    ensure_assets(workdir / "assets", asset_spec(engine, task, backend))
    args = [f"--config-path={path.parent}", f"--config-name={path.stem}", *ov]
    proc = run_main_ppo(args, workdir / "run")
    return proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: check the arguments, build tiny assets if missing, then run verl's trainer on CPU.

    Returns:
        The trainer's exit code (0 after ``--print-overrides``).

    Raises:
        SystemExit: code 2 for a bad argument or overrides that :func:`verl_stable.recipes.preflight` refuses (a
            malformed or unknown key, a config verl would reject) or a ``VERL_STABLE_*`` variable
            :func:`verl_stable.env_vars.check_all` refuses, before any asset is built or verl started.
    """
    parser = argparse.ArgumentParser(prog="verl-stable run", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="./verl_stable_cpu_run", help="assets, checkpoints, logs, metrics")
    parser.add_argument("--task", default="copy", choices=tasks.TASKS)
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--engine", default="hf", choices=ENGINES, help="rollout engine (vllm: vLLM's CPU build)")
    parser.add_argument(
        "--actor",
        default="fsdp",
        choices=CPU_BACKENDS,
        help="actor engine: fsdp, or megatron (verl's Megatron engine, ppo_megatron_trainer, on the Megatron CPU runtime)",
    )
    parser.add_argument("--precision", default=None, choices=PRECISIONS, help="rollout precision (vllm: fp32, bf16)")
    parser.add_argument("--no-sync", action="store_true", help="skip weight sync to the hf rollout (drift check)")
    parser.add_argument(
        "--attention",
        default="sdpa",
        choices=sorted(ATTENTIONS),
        help="actor attention: sdpa (padded) or varlen (packed, pure-torch; allows Ulysses sp > 1)",
    )
    parser.add_argument(
        "--poll-interval",
        type=positive_seconds,
        help=f"replay-buffer poll seconds (default: ${env_vars.POLL_INTERVAL_S.name} when set, else "
        f"{DEFAULT_POLL_INTERVAL_S}; verl: 2.0)",
    )
    parser.add_argument("--print-overrides", action="store_true", help="print the overrides and exit")
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides key=value (appended, they win)")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    try:
        workdir = recipes.check_output_dir(resolve_path(args.workdir, "--workdir"), "--workdir")
    except ValueError as exc:
        parser.error(str(exc))
    assets = asset_paths(workdir / "assets")  # where they will be; nothing is built before the checks pass
    try:
        ov = cpu_overrides(
            assets,
            steps=args.steps,
            precision=args.precision,
            sync_weights=not args.no_sync,
            engine=args.engine,
            attention=args.attention,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.actor == "megatron" and args.attention != "sdpa":
        parser.error("--attention is the FSDP actor's; the Megatron actor runs its own packed attention on CPU")
    ov = for_actor(ov, args.actor)
    ov += [f"trainer.default_local_dir={workdir / 'checkpoints'}", *args.overrides]
    try:
        env_vars.check()  # read by the run's processes: refused before any asset is built
        recipes.preflight(ov, backend=args.actor)
    except ValueError as exc:
        parser.error(str(exc))
    if args.print_overrides:
        print("\n".join(ov))
        return 0
    ensure_assets(workdir / "assets", asset_spec(args.engine, args.task, args.actor))
    config = [f"--config-name={recipes.BACKENDS[args.actor]}"] if args.actor != "fsdp" else []
    proc = run_main_ppo([*config, *ov], workdir, poll_interval_s=args.poll_interval)
    print(f"main_ppo exited {proc.returncode}; log: {workdir / 'main_ppo.log'}; metrics: {workdir / 'metrics.jsonl'}")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
