"""verl's own Megatron router replay replays exactly on megatron-core running on CPU.

verl 0.9.1's ``apply_router_replay_patch`` (``verl.utils.megatron.router_replay_patch``) gives every ``TopKRouter`` of a
model built afterwards a ``RouterReplay`` and replaces its routing with one that records, replays or partly replays
(``replay_mask``) top-k expert choices. The model is ``testkit.megatron``'s tiny GPT MoE inside the Megatron CPU
runtime, with full activation recomputation so that routing also runs again inside the backward pass (verl's
``REPLAY_BACKWARD``: the recomputed forward must take the same experts, from ``replay_backward_list``).

The experts actually used are read back independently of verl's code, by hooks:

* on each router's output: its ``routing_map`` (token -> experts the dispatcher sends it to), in the forward and in
  the backward's recomputation; the router's *native* choice is recomputed from the router's input and weight with
  plain ``torch.mm`` + ``topk`` (the softmax is monotonic), so a partial replay is checked row by row;
* on each local expert: the number of token rows it receives from the alltoall dispatcher, which must equal how
  often the replayed top-k names it (summed over the ranks whose tokens it serves at EP=2).

Scenarios: R2 (record, perturb the routers until native routing differs on most token-layers, replay -> exactly the
recorded experts), R3 (random distinct top-k given -> exactly those), R3 with ``replay_mask`` (masked rows the given
experts, others native). At world size 1 in the test process and at expert parallelism 2 on two spawned gloo ranks.
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from testkit import megatron as tm
from testkit.spawn import report, spawn_and_collect

from verl_stable.cpu.megatron.runtime import megatron_cpu_runtime
from verl_stable.integration.megatron_replay_patch import verl_router_replay_patch


# ================================================================================================== shared helpers
def replay_config(ep: int = 1):
    """The tiny model with routing replay enabled and every layer recomputed in the backward."""
    return tm.tiny_config(
        ep=ep,
        moe_enable_routing_replay=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )


@dataclass
class RoutingProbe:
    """Hooks on every router (output routing map, native top-k from its input) and every local expert (rows).

    Attributes:
        phase: the label the next events get ("forward", "backward", ...); set by the test.
        routes: ``(phase, layer_number, routing_map [T, E] bool, native top-k [T, K])`` per router call.
        rows: ``(phase, layer_number, global expert index, rows received)`` per local-expert call.
    """

    phase: str = "forward"
    routes: list[tuple[str, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    handles: list = field(default_factory=list)

    def attach(self, model) -> RoutingProbe:
        from megatron.core import parallel_state as mpu

        for layer in model.decoder.layers:
            moe = layer.mlp
            self.handles.append(moe.router.register_forward_hook(self._on_route(layer.layer_number), with_kwargs=True))
            first = mpu.get_expert_model_parallel_rank() * moe.experts.num_local_experts
            for i, expert in enumerate(moe.experts.local_experts):
                self.handles.append(expert.register_forward_pre_hook(self._on_rows(layer.layer_number, first + i)))
        return self

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _on_route(self, layer: int):
        def hook(router, args, kwargs, output) -> None:
            hidden = (args[0] if args else kwargs["input"]).detach()
            logits = torch.mm(hidden.reshape(-1, hidden.shape[-1]), router.weight.detach().t())
            native = logits.topk(router.topk, dim=-1).indices
            self.routes.append((self.phase, layer, output[1].detach().clone(), native))

        return hook

    def _on_rows(self, layer: int, expert: int):
        def hook(module, args) -> None:
            self.rows.append((self.phase, layer, expert, int(args[0].shape[0])))

        return hook

    def maps(self, phase: str) -> dict[int, torch.Tensor]:
        """The routing map of each layer in ``phase`` (one call per layer expected)."""
        found = [(layer, m) for p, layer, m, _ in self.routes if p == phase]
        assert len(found) == tm.LAYERS, f"{len(found)} router calls in phase {phase}"
        return dict(found)

    def natives(self, phase: str) -> dict[int, torch.Tensor]:
        return {layer: native for p, layer, _, native in self.routes if p == phase}

    def expert_rows(self, phase: str) -> torch.Tensor:
        """``[layers, experts]`` rows each local expert received in ``phase`` (zeros for experts elsewhere)."""
        counts = torch.zeros(tm.LAYERS, tm.EXPERTS, dtype=torch.long)
        for p, layer, expert, n in self.rows:
            if p == phase:
                counts[layer - 1, expert] += n
        return counts


def multi_hot(indices: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` expert indices -> ``[T, E]`` bool map (what a router's routing_map holds)."""
    return torch.zeros(indices.shape[0], tm.EXPERTS, dtype=torch.bool).scatter(1, indices.long(), True)


def distinct_topk(tokens: int, seed: int) -> list[torch.Tensor]:
    """Per layer, ``[tokens, TOPK]`` distinct random experts (a valid rollout routing)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.stack([torch.randperm(tm.EXPERTS, generator=gen)[: tm.TOPK] for _ in range(tokens)])
        for _ in range(tm.LAYERS)
    ]


def routers(model) -> list:
    """The model's routers in layer order."""
    return [layer.mlp.router for layer in model.decoder.layers]


def train_pass(model, data, probe: RoutingProbe, RouterReplay) -> None:  # noqa: N803 - verl's class
    """verl's training order: REPLAY_FORWARD for the forward, REPLAY_BACKWARD for the backward's recomputation."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probe.phase = "forward"
    loss = tm.lm_loss(model, data)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    probe.phase = "backward"
    loss.backward()
    RouterReplay.clear_global_router_replay_action()


# ======================================================================================================= scenarios
def run_r2(model, data, RouterReplay) -> dict:  # noqa: N803
    """Record, perturb the routers, replay: returns the recorded and used routes and the perturbation's effect."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction

    probe = RoutingProbe().attach(model)
    try:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        probe.phase = "record"
        with torch.no_grad():
            tm.lm_loss(model, data)
        recorded = [r.clone() for r in RouterReplay.get_recorded_data()]
        RouterReplay.clear_global_router_replay_action()
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for router in routers(model):
                router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        probe.phase = "native"
        with torch.no_grad():
            tm.lm_loss(model, data)
        RouterReplay.set_replay_data(recorded)
        train_pass(model, data, probe, RouterReplay)
        leftover = sum(len(r.replay_backward_list) for r in RouterReplay.router_instances)
        RouterReplay.clear_global_indices()
    finally:
        probe.detach()
    return {
        "recorded": [multi_hot(r) for r in recorded],
        "record_native": [multi_hot(probe.natives("record")[layer]) for layer in sorted(probe.maps("record"))],
        "perturbed": [probe.maps("native")[layer] for layer in sorted(probe.maps("native"))],
        "forward": [probe.maps("forward")[layer] for layer in sorted(probe.maps("forward"))],
        "backward": [probe.maps("backward")[layer] for layer in sorted(probe.maps("backward"))],
        "leftover": leftover,
        "router_grad": torch.stack([r.weight.grad.norm() for r in routers(model)]),
    }


def run_r3(model, data, RouterReplay, seed: int, masked: bool) -> dict:  # noqa: N803
    """Given top-k (with a random half of the rows masked in, when ``masked``): the expected and used routes."""
    tokens = data["tokens"].numel()
    given = distinct_topk(tokens, seed)
    mask = torch.rand(tokens, generator=torch.Generator().manual_seed(seed + 1)) < 0.5 if masked else None
    probe = RoutingProbe().attach(model)
    try:
        for router, topk in zip(routers(model), given, strict=True):
            router.router_replay.set_target_indices(topk, replay_mask=mask)
        train_pass(model, data, probe, RouterReplay)
        RouterReplay.clear_global_indices()
    finally:
        probe.detach()
    out: dict = {"given": [multi_hot(g) for g in given], "mask": mask}
    for phase in ("forward", "backward"):
        natives = probe.natives(phase)
        expected = []
        for layer, topk in zip(sorted(natives), given, strict=True):
            chosen = topk if mask is None else torch.where(mask.unsqueeze(-1), topk, natives[layer])
            expected.append(multi_hot(chosen))
        out[f"{phase}_expected"] = expected
        out[f"{phase}_native"] = [multi_hot(natives[layer]) for layer in sorted(natives)]
        out[phase] = [probe.maps(phase)[layer] for layer in sorted(natives)]
    out["rows"] = probe.expert_rows("forward")
    out["given_counts"] = torch.stack([multi_hot(g).sum(0) for g in given])
    return out


def scenarios(rows: slice, seed: int) -> dict:
    """R3, R3 with a mask, then R2 (it perturbs the routers) on one tiny model; inside the runtime and a group."""
    with verl_router_replay_patch() as RouterReplay:  # noqa: N806 - verl's class
        from megatron.core import parallel_state as mpu

        config = replay_config(ep=mpu.get_expert_model_parallel_world_size())
        model = tm.build_model(config)
        assert len(RouterReplay.router_instances) == tm.LAYERS
        assert all(type(r.router_replay) is RouterReplay for r in routers(model))
        data = tm.batch(rows)
        return {
            "r3": run_r3(model, data, RouterReplay, seed, masked=False),
            "r3_mask": run_r3(model, data, RouterReplay, seed + 10, masked=True),
            "r2": run_r2(model, data, RouterReplay),
        }


def check_r2(r2: dict) -> None:
    for recorded, native in zip(r2["recorded"], r2["record_native"], strict=True):
        assert torch.equal(recorded, native)  # RECORD keeps what the router chose itself
    changed = sum(int((p != r).any(1).sum()) for p, r in zip(r2["perturbed"], r2["recorded"], strict=True))
    total = sum(r.shape[0] for r in r2["recorded"])
    assert changed > total // 2, f"the perturbed routers still agree on {total - changed} of {total} token-layers"
    for phase in ("forward", "backward"):
        for used, recorded in zip(r2[phase], r2["recorded"], strict=True):
            assert torch.equal(used, recorded), phase
    assert r2["leftover"] == 0  # the recomputation took its routes from REPLAY_BACKWARD's list
    assert bool(torch.isfinite(r2["router_grad"]).all()) and bool((r2["router_grad"] > 0).all())


def check_r3(r3: dict, masked: bool) -> None:
    for phase in ("forward", "backward"):
        for used, expected in zip(r3[phase], r3[f"{phase}_expected"], strict=True):
            assert torch.equal(used, expected), phase
        if masked:
            mask = r3["mask"]
            assert 0 < int(mask.sum()) < mask.numel()
            for used, given, native in zip(r3[phase], r3["given"], r3[f"{phase}_native"], strict=True):
                assert torch.equal(used[mask], given[mask]) and torch.equal(used[~mask], native[~mask])
                # the mask decides: on most unmasked rows the given experts are not the native ones
                assert int((given[~mask] != native[~mask]).any(1).sum()) > int((~mask).sum()) // 2
        else:
            for used, given in zip(r3[phase], r3["given"], strict=True):
                assert torch.equal(used, given), phase


# ==================================================================================================== world size 1
@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> dict:
    """The three scenarios at world size 1, run once for the module (runtime and group closed afterwards)."""
    store = tmp_path_factory.mktemp("replay") / "store"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
        with megatron_cpu_runtime(), tm.parallel_state(0, 1, str(store)):
            return scenarios(slice(None), seed=100)


def test_r2_replays_the_recorded_routing_after_the_routers_changed(replayed):
    check_r2(replayed["r2"])


def test_r3_uses_exactly_the_given_experts(replayed):
    r3 = replayed["r3"]
    check_r3(r3, masked=False)
    # the dispatcher delivered each expert exactly the rows the given routing names
    assert torch.equal(r3["rows"], r3["given_counts"])


def test_r3_replay_mask_replays_masked_rows_and_keeps_native_routing_elsewhere(replayed):
    check_r3(replayed["r3_mask"], masked=True)


# ========================================================================================= expert parallel (spawned)
def _rank(rank: int, tmp: str, results) -> None:
    report(results, {"rank": rank}, lambda: _rank_body(rank, tmp), f"{tmp}/rank{rank}.pt")


def _rank_body(rank: int, tmp: str) -> dict:
    warnings.filterwarnings("ignore")
    with megatron_cpu_runtime(), tm.parallel_state(rank, 2, f"{tmp}/store", ep=2):
        return scenarios(slice(2 * rank, 2 * rank + 2), seed=100 + rank)


def test_router_replay_at_expert_parallel_two():
    with tempfile.TemporaryDirectory() as tmp:
        spawn_and_collect(_rank, [(rank, tmp) for rank in range(2)], timeout=120, what="rank")
        ranks = [torch.load(f"{tmp}/rank{rank}.pt", weights_only=False) for rank in range(2)]
    for out in ranks:
        check_r2(out["r2"])
        check_r3(out["r3"], masked=False)
        check_r3(out["r3_mask"], masked=True)
    # each rank's experts serve both ranks' tokens: rows received = the given routing's counts summed over ranks
    given = ranks[0]["r3"]["given_counts"] + ranks[1]["r3"]["given_counts"]
    half = tm.EXPERTS // 2
    for rank, out in enumerate(ranks):
        rows, mine = out["r3"]["rows"], slice(rank * half, (rank + 1) * half)
        assert torch.equal(rows[:, mine], given[:, mine])
        assert int(rows.sum()) == int(given[:, mine].sum())  # nothing counted for experts on the other rank
