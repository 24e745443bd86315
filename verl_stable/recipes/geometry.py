"""The parallel layout and the batch geometry a run asks for, checked against its world before anything starts.

verl splits each step's samples over the actor's data-parallel ranks, each mini-batch of an update the same way,
and each rank's share into micro-batches; megatron-core splits the world into its parallel groups. Where a size
does not divide, verl or megatron-core asserts inside the workers, after Ray, the workers and a rollout have started
(``data size must be divisible by force_group_size * micro_batch_size_per_gpu`` at the first update). Here the same
arithmetic runs on the composed config:

* :func:`layout_problems`: Megatron's tensor x pipeline x context and expert x expert-tensor x pipeline parallel
  sizes against the world (``trainer.nnodes x trainer.n_gpus_per_node``), and the layouts the CPU runtime
  (``trainer.device=cpu``, gloo) cannot run exactly;
* :func:`batch_problems`: with fixed micro-batch sizes (``use_dynamic_bsz=false``), each update mini-batch
  (``ppo_mini_batch_size x rollout.n`` samples) over the data-parallel ranks, and each rank's share over
  ``ppo_micro_batch_size_per_gpu``; the old-log-prob pass's share (the step's ``train_batch_size x rollout.n``
  samples, which verl pads up to a multiple of the mini-batch and of the data-parallel size) over
  ``rollout.log_prob_micro_batch_size_per_gpu``.

Each returns messages naming the keys (empty: fine). Nothing here imports verl.
"""

from __future__ import annotations

import math
from typing import Any

from verl_stable.monitor.logged import config_get

__all__ = ["batch_problems", "data_parallel_size", "layout_problems"]

ACTOR = "actor_rollout_ref.actor"
MEGATRON = f"{ACTOR}.megatron"
WORLD = "trainer.nnodes x trainer.n_gpus_per_node"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def world_size(cfg: Any) -> int | None:
    """``trainer.nnodes x trainer.n_gpus_per_node`` (None: not two ints >= 1)."""
    nodes, per_node = _int(config_get(cfg, "trainer.nnodes", 1)), _int(config_get(cfg, "trainer.n_gpus_per_node", 1))
    return None if nodes is None or per_node is None else nodes * per_node


def _megatron_sizes(cfg: Any) -> dict[str, Any]:
    sizes = {k: config_get(cfg, f"{MEGATRON}.{k}_parallel_size", 1) for k in ("tensor_model", "pipeline_model")}
    sizes["context"] = config_get(cfg, f"{MEGATRON}.context_parallel_size", 1)
    sizes["expert_model"] = config_get(cfg, f"{MEGATRON}.expert_model_parallel_size", 1)
    # megatron-core: expert-tensor parallel defaults to tensor parallel
    sizes["expert_tensor"] = config_get(cfg, f"{MEGATRON}.expert_tensor_parallel_size", None) or sizes["tensor_model"]
    return sizes


def data_parallel_size(cfg: Any) -> int | None:
    """The actor's data-parallel size: the world over Megatron's tensor x pipeline x context parallel ranks, or over
    the FSDP actor's Ulysses sequence-parallel degree (None: the sizes do not divide the world)."""
    world = world_size(cfg)
    if world is None:
        return None
    if config_get(cfg, f"{ACTOR}.strategy", "fsdp") == "megatron":
        sizes = _megatron_sizes(cfg)
        model = [_int(sizes[k]) for k in ("tensor_model", "pipeline_model", "context")]
        if None in model:
            return None
        split = math.prod(model)
    else:
        split = _int(config_get(cfg, f"{ACTOR}.ulysses_sequence_parallel_size", 1)) or 1
    return world // split if world % split == 0 else None


def layout_problems(cfg: Any) -> list[str]:
    """Megatron's parallel sizes against the world, and layouts the CPU runtime cannot run exactly."""
    if config_get(cfg, f"{ACTOR}.strategy") != "megatron":
        return []
    world = world_size(cfg)
    sizes = _megatron_sizes(cfg)
    problems = [
        f"{MEGATRON}.{name}_parallel_size must be an int >= 1, got {value!r}"
        for name, value in sizes.items()
        if _int(value) is None
    ]
    if problems or world is None:
        return problems
    tp, pp, cp, ep, etp = (
        sizes[k] for k in ("tensor_model", "pipeline_model", "context", "expert_model", "expert_tensor")
    )
    if world % (tp * pp * cp):
        problems.append(
            f"{MEGATRON}: tensor ({tp}) x pipeline ({pp}) x context ({cp}) parallel = {tp * pp * cp} ranks do not divide "
            f"the world of {world} ({WORLD})"
        )
    if world % (ep * etp * pp):
        problems.append(
            f"{MEGATRON}: expert ({ep}) x expert-tensor ({etp}) x pipeline ({pp}) parallel = {ep * etp * pp} ranks do "
            f"not divide the world of {world} ({WORLD})"
        )
    if str(config_get(cfg, "trainer.device", "")).lower() == "cpu":
        problems += _cpu_layout_problems(cfg, sizes)
    return problems


def _cpu_layout_problems(cfg: Any, sizes: dict[str, Any]) -> list[str]:
    """Layouts the Megatron CPU runtime (local spec, gloo) cannot run exactly.

    (R2 under expert-tensor parallelism, whose pad rows make the ranks' routed-token counts uneven, runs: the runtime
    pads gloo's collectives to one size, :mod:`verl_stable.cpu.megatron.collectives`.)
    """
    problems = []
    given_etp = config_get(cfg, f"{MEGATRON}.expert_tensor_parallel_size", None)
    if given_etp is not None and given_etp != sizes["tensor_model"]:
        problems.append(
            f"{MEGATRON}.expert_tensor_parallel_size={given_etp} differs from tensor_model_parallel_size="
            f"{sizes['tensor_model']}: the CPU runtime's local-spec bridge loads and exports expert weights only at "
            "mbridge's default (expert-tensor parallel = tensor parallel); leave it null on CPU"
        )
    if sizes["context"] > 1 or config_get(cfg, f"{MEGATRON}.dynamic_context_parallel", False):
        problems.append(
            f"{MEGATRON}.context_parallel_size={sizes['context']} / dynamic_context_parallel="
            f"{config_get(cfg, f'{MEGATRON}.dynamic_context_parallel', False)}: the CPU runtime's packed attention "
            "(verl_stable.cpu.megatron.attention) has no ring or all-gather attention across context-parallel ranks; "
            "use context_parallel_size=1 and dynamic_context_parallel=false on CPU"
        )
    return problems


def batch_problems(cfg: Any) -> list[str]:
    """Fixed micro-batch sizes that do not split the data-parallel ranks' shares (dynamic batch sizes: nothing)."""
    if config_get(cfg, f"{ACTOR}.use_dynamic_bsz", False):
        return []
    dp = data_parallel_size(cfg)
    n = _int(config_get(cfg, "actor_rollout_ref.rollout.n", 1))
    batch, mini = (
        _int(config_get(cfg, "data.train_batch_size", None)),
        _int(config_get(cfg, f"{ACTOR}.ppo_mini_batch_size", None)),
    )
    micro = _int(config_get(cfg, f"{ACTOR}.ppo_micro_batch_size_per_gpu", None))
    infer = _int(config_get(cfg, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", None))
    if None in (dp, n, batch, mini):
        return []  # verl's own checks (and layout_problems) name what is malformed
    problems = []
    samples = mini * n
    if samples % dp:
        problems.append(
            f"an update mini-batch of {samples} samples ({ACTOR}.ppo_mini_batch_size={mini} x "
            f"actor_rollout_ref.rollout.n={n}) does not split over the actor's {dp} data-parallel ranks"
        )
    elif micro is not None and (samples // dp) % micro:
        problems.append(
            f"each data-parallel rank's {samples // dp} samples of an update mini-batch ({ACTOR}.ppo_mini_batch_size="
            f"{mini} x rollout.n={n} over {dp} ranks) do not split into micro-batches of "
            f"{ACTOR}.ppo_micro_batch_size_per_gpu={micro} (verl asserts this at the first update)"
        )
    if infer is not None:
        multiple = math.lcm(dp, samples)
        per_rank = math.ceil(batch * n / multiple) * multiple // dp  # verl pads the step's batch to the multiple
        if per_rank % infer:
            problems.append(
                f"each data-parallel rank's {per_rank} samples of the old-log-prob pass (data.train_batch_size={batch} "
                f"x rollout.n={n}, padded by verl to a multiple of {multiple}, over {dp} ranks) do not split into "
                f"micro-batches of actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={infer}"
            )
    return problems
