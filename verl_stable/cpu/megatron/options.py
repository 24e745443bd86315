"""The settings verl's Megatron actor needs on the CPU runtime, as hydra overrides (no import of megatron-core).

verl's ``ppo_megatron_trainer`` defaults assume a GPU build: Transformer Engine and flash attention
(``override_transformer_config.attention_backend: flash``), fused kernels, GPU initialization, sequence parallelism, and
Megatron-Bridge (``vanilla_mbridge: false``; megatron-bridge 0.5+ does not install for Python 3.11). On CPU the actor
runs megatron-core's local spec through mbridge 0.15.1 (verl's ``vanilla_mbridge`` path, with the local-spec bridges of
:mod:`verl_stable.cpu.megatron.bridge`), packed (THD) sequences with the packed attention of
:mod:`verl_stable.cpu.megatron.attention`, parameters initialized on the host, every fusion off.
"""

from __future__ import annotations

ACTOR = "actor_rollout_ref.actor.megatron"
REF = "actor_rollout_ref.ref.megatron"

TRANSFORMER_CONFIG: dict[str, object] = {
    "use_cpu_initialization": True,
    # megatron-core's own attention (the local spec); the packed THD path is verl_stable.cpu.megatron.attention
    "attention_backend": "local",
    # fused CUDA / apex kernels
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
    "gradient_accumulation_fusion": False,
    "apply_rope_fusion": False,
}
"""``override_transformer_config`` entries for a CPU actor (``set_extra_args`` of verl's vanilla-mbridge path)."""


def overrides(roles: tuple[str, ...] = (ACTOR, REF)) -> list[str]:
    """Hydra overrides that make verl's Megatron engines of ``roles`` (config prefixes) run on the CPU runtime.

    ``sequence_parallel=False``: with tensor parallel size 1 (the CPU runs' default) Megatron refuses it anyway; set
    ``...megatron.tensor_model_parallel_size=2`` together with ``sequence_parallel=True`` for a TP run (MoE with
    TP > 1 requires it).
    """
    out = ["actor_rollout_ref.model.use_remove_padding=True"]  # verl's Megatron engine trains on packed sequences
    for role in roles:
        out += [f"{role}.vanilla_mbridge=True", f"{role}.sequence_parallel=False"]
        out += [f"++{role}.override_transformer_config.{key}={value}" for key, value in TRANSFORMER_CONFIG.items()]
    return out
