"""Preflight of the layouts the engine tests run (tests/mcore/test_megatron_engine.py: tensor, expert and pipeline
parallel, alone and combined): what the CPU runtime runs passes, R2 included; what it cannot run (an expert-tensor size
other than the tensor-parallel size) or what verl would assert on at the first update (a batch that does not divide
over the data-parallel ranks) is refused naming the keys.

The data-parallel size the batch checks divide by is counted here by hand: the world over tensor x pipeline x context
parallel for Megatron (expert parallelism does not split the batch), over the Ulysses degree for FSDP.
"""

from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from verl_stable.recipes import geometry
from verl_stable.recipes.compose import compose_recipe

MEGATRON = "actor_rollout_ref.actor.megatron"
CPU = ["trainer.device=cpu"]
FIXED = [
    "actor_rollout_ref.actor.use_dynamic_bsz=false",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
]


@pytest.fixture(scope="module")
def recipes() -> dict[str, object]:
    """The shipped recipes, composed once (a composition costs ~1 s); each test sets its keys on a copy."""
    return {
        "minirl_n4_r3": compose_recipe("megatron", "minirl_n4_r3", CPU),
        "minirl_n2_r2": compose_recipe("megatron", "minirl_n2_r2", CPU),
        "fsdp": compose_recipe("fsdp", "minirl_n4_r3", []),
    }


def _with(cfg, *overrides: str):
    """``cfg`` with ``key=value`` overrides set (what composing with them gives for the keys geometry reads)."""
    out = copy.deepcopy(cfg)
    for override in overrides:
        key, value = override.split("=", 1)
        OmegaConf.update(out, key, OmegaConf.create(f"v: {value}")["v"], force_add=True)  # parsed as hydra does
    return out


def _sizes(world: int, tp: int = 1, ep: int = 1, pp: int = 1) -> list[str]:
    return [
        f"trainer.n_gpus_per_node={world}",
        f"{MEGATRON}.tensor_model_parallel_size={tp}",
        f"{MEGATRON}.expert_model_parallel_size={ep}",
        f"{MEGATRON}.pipeline_model_parallel_size={pp}",
    ]


# (world, TP, EP, PP) of the engine tests
ENGINE_LAYOUTS = [(1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (4, 1, 2, 2), (4, 2, 1, 2), (4, 2, 2, 1)]


@pytest.mark.parametrize(("world", "tp", "ep", "pp"), ENGINE_LAYOUTS)
def test_the_engine_tests_r3_layouts_pass_preflight_on_cpu(recipes, world, tp, ep, pp):
    assert geometry.layout_problems(_with(recipes["minirl_n4_r3"], *_sizes(world, tp, ep, pp))) == []


@pytest.mark.parametrize(("world", "tp", "ep", "pp"), ENGINE_LAYOUTS)
def test_the_engine_tests_r2_layouts_pass_preflight_on_cpu(recipes, world, tp, ep, pp):
    """R2 at tensor parallel 2 included: its pad rows make the expert-tensor ranks' routed-token counts uneven, which
    the CPU runtime's collectives pad for gloo (tests/mcore/test_collectives.py, and the engine test's tp2 layout,
    whose R2 update routes 25 and 28 tokens on the two ranks)."""
    assert geometry.layout_problems(_with(recipes["minirl_n2_r2"], *_sizes(world, tp, ep, pp))) == []


def test_an_expert_tensor_size_other_than_tensor_parallel_is_refused_on_cpu(recipes):
    """The CPU runtime's local-spec bridge loads and exports experts only at ETP = TP (mbridge's default)."""
    cfg = _with(recipes["minirl_n2_r2"], *_sizes(2, 2), f"{MEGATRON}.expert_tensor_parallel_size=1")
    problems = geometry.layout_problems(cfg)
    assert any("expert_tensor_parallel_size=1 differs from tensor_model_parallel_size=2" in p for p in problems)


@pytest.mark.parametrize(
    ("world", "tp", "ep", "pp", "dp"),
    [(2, 1, 1, 2, 1), (4, 1, 2, 2, 2), (4, 2, 1, 2, 1), (4, 2, 2, 1, 2), (6, 1, 1, 2, 3), (8, 1, 4, 2, 4)],
)
def test_the_data_parallel_size_is_the_world_over_tensor_pipeline_and_context(recipes, world, tp, ep, pp, dp):
    cfg = _with(recipes["minirl_n4_r3"], *_sizes(world, tp, ep, pp))
    assert geometry.data_parallel_size(cfg) == dp == world // (tp * pp)


@pytest.mark.parametrize(
    ("world", "tp", "ep", "pp", "mini", "n", "micro", "message"),
    [
        # PP 2 on six ranks: three data-parallel ranks, 2 x 4 = 8 samples do not split over them
        (6, 1, 1, 2, 2, 4, 1, "an update mini-batch of 8 samples"),
        # EP 2 x PP 2 on four ranks: two data-parallel ranks of 4 samples, micro-batches of 3
        (4, 1, 2, 2, 2, 4, 3, "each data-parallel rank's 4 samples"),
        # TP 2 x PP 2 on four ranks: one data-parallel rank of 8 samples, micro-batches of 16 (the recipe's)
        (4, 2, 1, 2, 2, 4, 16, "each data-parallel rank's 8 samples"),
    ],
)
def test_a_pipelined_batch_that_does_not_divide_is_refused_naming_the_keys(
    recipes, world, tp, ep, pp, mini, n, micro, message
):
    batch = [
        "data.train_batch_size=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
    ]
    cfg = _with(recipes["minirl_n4_r3"], *_sizes(world, tp, ep, pp), *FIXED, *batch)
    (problem,) = [p for p in geometry.batch_problems(cfg) if "update mini-batch" in p]
    assert message in problem, problem
    assert f"ppo_mini_batch_size={mini}" in problem and "rollout.n=" in problem
    if "does not split over" not in problem:
        assert f"ppo_micro_batch_size_per_gpu={micro}" in problem
    # the same geometry with micro-batches of one sample, on a world the mini-batch divides: nothing to refuse
    dp = world // (tp * pp)
    if (mini * n) % dp == 0:
        ok = _with(
            recipes["minirl_n4_r3"],
            *_sizes(world, tp, ep, pp),
            *FIXED,
            *batch[:3],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        )
        assert geometry.batch_problems(ok) == []


def test_fsdp_batch_geometry_is_refused_naming_the_keys(recipes):
    batch = [
        *FIXED,
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",  # two data-parallel ranks
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=4",
    ]
    cfg = _with(recipes["fsdp"], *batch, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert geometry.data_parallel_size(cfg) == 2
    (problem,) = [p for p in geometry.batch_problems(cfg) if "update mini-batch" in p]
    assert "each data-parallel rank's 4 samples" in problem and "ppo_micro_batch_size_per_gpu=3" in problem
    ok = _with(recipes["fsdp"], *batch, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert [p for p in geometry.batch_problems(ok) if "update mini-batch" in p] == []


@pytest.mark.parametrize(
    "overrides",
    [[f"{MEGATRON}.context_parallel_size=2"], [f"{MEGATRON}.dynamic_context_parallel=true"]],
)
def test_context_parallelism_is_refused_on_cpu_naming_the_keys(recipes, overrides):
    """The packed attention raises at the first forward under context parallelism: preflight says so first."""
    cfg = _with(recipes["minirl_n4_r3"], *_sizes(2), *overrides)
    (problem,) = [p for p in geometry.layout_problems(cfg) if "context_parallel_size" in p]
    assert f"{MEGATRON}.context_parallel_size=" in problem and "dynamic_context_parallel=" in problem
    gpu = _with(recipes["minirl_n4_r3"], *_sizes(2), *overrides, "trainer.device=cuda")
    assert [p for p in geometry.layout_problems(gpu) if "context_parallel_size=" in p and "CPU" in p] == []
