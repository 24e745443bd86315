"""megatron-core trains on a CPU build of torch inside the Megatron CPU runtime, and the runtime leaves no trace.

The model is ``testkit.megatron``'s tiny GPT MoE (local spec, 2 layers, hidden 64, 8 experts top-2, SwiGLU, RMSNorm +
q/k-norm, RoPE, alltoall dispatcher, fp32), trained through megatron's own stack: its schedule
(``get_forward_backward_func``), DDP, the distributed Adam optimizer with gradient clipping.

References:

* World size 1: the initial loss of a random model is ~ln(vocabulary) (near-uniform predictions), and Adam steps on
  one repeated batch lower it; the MoE aux-loss tracker (a ``device="cuda"`` site) records a positive loss.
* Parallel layouts: two spawned gloo ranks load the world-size-1 model's weights (each its shard) and train on the
  same global batch: expert parallelism 2 (data parallelism 2: each rank half the batch) and tensor parallelism 2
  with sequence parallelism (data parallelism 1). Their losses before and after one optimizer step equal the world-
  size-1 losses computed in the test process. After a step this also checks the gradients: megatron's data-parallel
  averaging, the expert all-to-all backward, and (TP) the sum of the norms' gradients across tensor-parallel ranks
  that the sequence-parallel tag of the runtime's torch norm asks for; an untagged norm trains differently.
* The ranks use the process-scope ``install()`` before megatron-core is imported (the deferred path), the test
  process the context manager after (the immediate path); both are checked to restore every attribute.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from testkit import megatron as tm
from testkit.spawn import report, spawn_and_collect

from verl_stable.cpu.megatron import device, rng, runtime

# fp32 throughout. Parallel layouts change the order of floating-point sums (row-parallel all-reduce, per-rank
# expert batches, sequence-parallel gathers). Measured: the losses before and after one step agree to <= 2.4e-7
# (half an fp32 ulp of a loss ~4.8 is 2.4e-7). 5e-6 leaves 20x margin and stays far below the smallest real error
# measured: sequence-parallel norms left untagged (their gradients not summed across TP) move the loss after one
# Adam step by 2.9e-4; a wrong shard or a missing data-parallel average moves the first loss itself.
LOSS_TOLERANCE = 5e-6
LAYOUTS = {
    # name: (tp, ep, sequence_parallel, rows of the global batch each rank trains on)
    "ep2": (1, 2, False, lambda rank: slice(2 * rank, 2 * rank + 2)),
    "tp2_sp": (2, 1, True, lambda rank: slice(None)),
}
STEPS = 2


def _cuda_attributes() -> dict[str, object]:
    names = [*device.CUDA_STUBS, *rng.CUDA_RNG_STUBS]
    return {name: getattr(torch.cuda, name) for name in names}


def _megatron_attributes() -> dict[str, object]:
    import megatron.core.tensor_parallel.random as random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {
        "random._get_cuda_rng_state": random._get_cuda_rng_state,
        "random._set_cuda_rng_state": random._set_cuda_rng_state,
        "moe_utils.te_general_gemm": vars(moe_utils).get("te_general_gemm", "absent"),
        "dispatcher.maybe_move_tensor_to_cpu": dispatcher.maybe_move_tensor_to_cpu,
        "dispatcher.cuda_dtoh_stream": vars(dispatcher.MoEAlltoAllTokenDispatcher)["cuda_dtoh_stream"],
        "WrappedTorchNorm.__new__": vars(WrappedTorchNorm)["__new__"],
    }


def _train(config, weights: dict[str, torch.Tensor] | None, rows: slice) -> list[float]:
    model = tm.build_model(config)
    if weights is not None:
        tm.load_weights(model, weights, config)
    ddp, optimizer = tm.ddp_and_optimizer(model, config)
    data = tm.batch(rows)
    return [tm.train_step(ddp, optimizer, data)[0] for _ in range(STEPS)]


# ================================================================================================= world size 1
def test_every_contract_holds():
    results = runtime.check_contracts()
    assert {r.name for r in results} == {c.name for c in runtime.CONTRACTS}
    assert [r for r in results if not r.ok] == []


def test_the_tiny_moe_trains_at_world_size_one(world_of_one):
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    config = tm.tiny_config(moe_aux_loss_coeff=1e-2)
    model = tm.build_model(config)
    assert [type(m).__name__ for m in model.modules() if type(m).__name__ == "MoELayer"] == ["MoELayer"] * tm.LAYERS
    ddp, optimizer = tm.ddp_and_optimizer(model, config)
    data = tm.batch()
    steps = [tm.train_step(ddp, optimizer, data) for _ in range(3)]
    losses = [loss for loss, _ in steps]
    # a freshly initialised model predicts near-uniformly over the vocabulary
    assert abs(losses[0] - math.log(tm.VOCAB)) < 0.1
    assert losses[0] > losses[1] > losses[2], losses
    assert all(math.isfinite(norm) and norm > 0 for _, norm in steps)
    aux = get_moe_layer_wise_logging_tracker().pop("load_balancing_loss")["values"]  # megatron's global: cleared
    assert aux.device.type == "cpu" and aux.shape == (tm.LAYERS,) and bool((aux > 0).all())
    # megatron's optimizer dispatch was told "torch.cuda.FloatTensor"; everyone else still sees the truth
    assert model.embedding.word_embeddings.weight.type() == "torch.FloatTensor"


def test_the_runtime_restores_every_attribute_and_leaves_no_mode():
    import megatron.core.transformer.moe.token_dispatcher  # noqa: F401 - every patched module imported

    cuda_before, megatron_before = _cuda_attributes(), _megatron_attributes()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    with runtime.megatron_cpu_runtime() as installed:
        assert installed == [f"megatron_cpu:{fix.name}" for fix in runtime.FIXES]
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert torch.cuda.current_device() == "cpu"
        changed = {k for k, v in _megatron_attributes().items() if v is not megatron_before[k]}
        assert changed == set(megatron_before)
        with runtime.megatron_cpu_runtime():  # nested: shares the installation and the mode
            assert torch.cuda.current_device() == "cpu"
        assert runtime.installed() and device.active_mode() is not None
    assert not runtime.installed() and device.active_mode() is None
    assert _cuda_attributes() == cuda_before
    assert _megatron_attributes() == megatron_before
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_install_holds_the_runtime_past_a_context_and_covers_its_thread_until_uninstall():
    cuda_before = _cuda_attributes()
    try:
        first = runtime.install()
        assert runtime.install() == first  # idempotent
        with runtime.megatron_cpu_runtime():
            pass
        assert runtime.installed() and torch.cuda.current_device() == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"  # the mode, pushed on this thread by install()
    finally:
        runtime.uninstall()
    assert not runtime.installed() and device.active_mode() is None
    assert _cuda_attributes() == cuda_before


def test_install_covers_each_calling_thread_and_uninstall_disables_them_all():
    import threading

    seen: dict[str, object] = {}

    def other(install: bool) -> None:
        if install:
            runtime.install()
        seen["mode"] = device.active_mode()
        try:
            seen["device"] = torch.zeros(1, device="cuda").device.type
        except (AssertionError, RuntimeError):
            seen["device"] = "refused"

    try:
        runtime.install()
        thread = threading.Thread(target=other, args=(False,))
        thread.start()
        thread.join()
        assert seen == {"mode": None, "device": "refused"}  # torch keeps modes per thread
        thread = threading.Thread(target=other, args=(True,))
        thread.start()
        thread.join()
        assert seen["device"] == "cpu" and seen["mode"].enabled
    finally:
        runtime.uninstall()
    assert not seen["mode"].enabled  # left on the other thread's stack, inert
    assert device.active_mode() is None


# ======================================================================================= parallel layouts (spawned)
def _rank(rank: int, tmp: str, results) -> None:
    report(results, {"rank": rank}, lambda: _rank_body(rank, tmp), f"{tmp}/rank{rank}.pt")


def _rank_body(rank: int, tmp: str) -> dict:
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    assert "megatron.core" not in sys.modules
    cuda_before = _cuda_attributes()
    installed = runtime.install()  # before megatron-core is imported: the megatron fixes wait for their modules
    out: dict = {"deferred": [line for line in installed if "on import of" in line]}
    from megatron.core import parallel_state as mpu

    weights = torch.load(f"{tmp}/weights.pt")
    for name, (tp, ep, sp, rows) in LAYOUTS.items():
        with tm.parallel_state(rank, 2, f"{tmp}/{name}.store", tp=tp, ep=ep):
            config = tm.tiny_config(tp=tp, ep=ep, sp=sp)
            out[f"{name}_local_experts"] = config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
            out[name] = torch.tensor(_train(config, weights, rows(rank)), dtype=torch.float64)
    runtime.uninstall()
    out["restored"] = _cuda_attributes() == cuda_before and not runtime.installed()
    return out


def test_expert_and_tensor_parallel_losses_equal_world_size_one(world_of_one):
    config = tm.tiny_config()
    weights = tm.full_weights(tm.build_model(config))
    reference = torch.tensor(_train(config, weights, slice(None)), dtype=torch.float64)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(weights, f"{tmp}/weights.pt")
        spawn_and_collect(_rank, [(rank, tmp) for rank in range(2)], timeout=120, what="rank")
        ranks = [torch.load(f"{tmp}/rank{rank}.pt") for rank in range(2)]
    for out in ranks:
        assert out["restored"]
        assert len(out["deferred"]) == sum(fix.module is not None for fix in runtime.FIXES)
        assert out["ep2_local_experts"] == tm.EXPERTS // 2 and out["tp2_sp_local_experts"] == tm.EXPERTS
    # expert parallelism 2 = data parallelism 2: the global loss is the mean of the ranks' half-batch losses
    ep2 = (ranks[0]["ep2"] + ranks[1]["ep2"]) / 2
    torch.testing.assert_close(ep2, reference, rtol=0, atol=LOSS_TOLERANCE)
    for out in ranks:
        torch.testing.assert_close(out["tp2_sp"], reference, rtol=0, atol=LOSS_TOLERANCE)
    # the step mattered: the compared second losses are not the first ones again
    assert reference[0] - reference[1] > 1e-2
