"""Device checks that need no verl, Ray or vLLM: R3 replay on the FSDP path, the losses, R3's step overhead.

Written for the machine the ``device`` tool lends (one H100, PyTorch + transformers + pytest, no verl / Ray / vLLM,
nothing to download) and run through ``tests/gpu/device_check.sh``, which installs the few wheels these checks import
(tensordict for :mod:`verl_stable.routing.replay_pass`) and puts the project on ``PYTHONPATH``. verl itself cannot be
imported there: ``import verl`` imports Ray (its wheel alone is 76 MiB, over the 64 MiB a call may carry), and verl
0.9.1 pins transformers < 5.11. So the checks drive the verl-free half of the FSDP engine's replay: the same
:class:`~verl_stable.routing.replay_pass.ReplayPass` (router-choice recorder, replayer, used-experts recorder, in that
order), armed with the rows the engine's alignment gives (packed micro-batch, static pad rows without data), and the
same agreement computation.

Checks, one line each (``[PASS]`` / ``[FAIL]``; ``[INFO]`` only for a timing that is not judged):

* R3 replay, bf16, on the toy Qwen3-MoE (the CPU runtime's model) and on one decoder layer at Qwen3-30B-A3B's width
  (hidden 2048, 128 experts, top-8, moe_intermediate_size 768, 32 / 4 attention heads): the expert ids and gate weights
  the experts modules actually receive (read by plain forward hooks, independent of the project's recorders) equal
  the replayed routes; replaying the model's own routes gives outputs bit-identical to no replay; random routes are
  used as given and change the output; the router still gets a gradient.
* The losses (MiniRL, VESPO, and the group-mean-baseline advantage the project registers with them) on the device,
  fp32 and bf16 log-probs, against a float64 reference written here from the papers' formulas on the CPU: per-token
  losses, the gradient of the aggregated loss, and metrics within stated tolerances.
* R3's step overhead at Qwen3-30B-A3B's width: forward + backward of the one-layer model with the engine's R3 pass
  vs without, interleaved rounds, the median ratio printed; on CUDA it must stay under the R3 paper's anchor (3 %).

Run:  python tests/gpu/device_checks.py [--device cuda|cpu] [--quick]   (exit code 0 iff every check passed)
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

RESULTS: list[tuple[str, str, str]] = []

#: The R3 paper's anchor for R3's training-step overhead (the threshold on CUDA).
OVERHEAD_LIMIT = 1.03


def report(status: str, name: str, detail: str = "") -> None:
    """Record and print one check line."""
    RESULTS.append((status, name, detail))
    print(f"[{status}] {name}{(' - ' + detail) if detail else ''}", flush=True)


def check(name: str, ok: bool, detail: str = "") -> bool:
    """Record a judged check; returns ``ok``."""
    report("PASS" if ok else "FAIL", name, detail)
    return bool(ok)


@contextmanager
def guarded(name: str) -> Iterator[None]:
    """Run a group of checks; an exception fails the group (with its traceback) and lets the next group run."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - a device check reports every failure as a FAIL line
        traceback.print_exc()
        check(f"{name}: ran to completion", False, f"{type(exc).__name__}: {exc}"[:300])


# ------------------------------------------------------------------------------------------------ sizes
@dataclass(frozen=True)
class Sizes:
    """Token counts and timing rounds of one run (``--quick`` and the CPU keep the widths, shrink the tokens)."""

    toy_lengths: tuple[int, ...]
    wide_lengths: tuple[int, ...]
    static_pad: int
    overhead_lengths: tuple[int, ...]
    rounds: int
    steps: int
    warmup: int
    loss_batch: tuple[int, int]


def sizes_for(device: str, quick: bool) -> Sizes:
    """The sizes of a run: a few thousand tokens on CUDA, tens on the CPU in ``--quick`` (CI)."""
    if device == "cuda":
        return Sizes(
            toy_lengths=(37, 120, 5, 64),
            wide_lengths=(700, 300, 1024) if not quick else (200, 56),
            static_pad=3,
            overhead_lengths=(512,) * 8 if not quick else (512,) * 2,
            rounds=15 if not quick else 7,
            steps=3 if not quick else 2,
            warmup=2,
            loss_batch=(64, 512),
        )
    if quick:
        return Sizes((7, 12, 5, 9), (13, 6), 3, (24, 24), 3, 1, 1, (6, 40))
    return Sizes((37, 60, 5, 24), (100, 28), 3, (128, 128), 5, 1, 1, (16, 128))


# ------------------------------------------------------------------------------------------------ models
def toy_config() -> Any:
    """The CPU runtime's toy Qwen3-MoE (``verl_stable.toy.assets.AssetSpec`` defaults), built from its config."""

    from verl_stable.toy import assets

    vocab = len(assets.SPECIALS) + 1 + len(assets.WORDS)  # the word-level tokenizer build_tokenizer saves
    return assets.model_config(assets.AssetSpec(), vocab, pad_token_id=0)


def wide_config() -> Any:
    """One decoder layer of Qwen3-30B-A3B (its config.json's widths; the vocabulary is unused: inputs are embeddings)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        pad_token_id=0,
    )


def build(config: Any, device: str, causal_lm: bool) -> torch.nn.Module:
    """The model in bf16 on ``device``, random weights (seed 0), train mode (as the FSDP actor runs it)."""
    from transformers import Qwen3MoeForCausalLM, Qwen3MoeModel

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = (Qwen3MoeForCausalLM if causal_lm else Qwen3MoeModel)(config)
    finally:
        torch.set_default_dtype(previous)
    for block in moe_blocks(model):
        if not bool(block.gate.weight.any()):  # a zero router ties every expert: routing would be degenerate
            torch.nn.init.normal_(block.gate.weight, std=0.02)
    return model.train()


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks (a ``gate`` router beside an ``experts`` module), in layer order."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


class ExpertProbe:
    """What each MoE block's experts actually received and its router computed, read by plain torch hooks.

    Independent of verl_stable's routing sessions: a forward pre-hook on every ``experts`` module keeps the
    ``top_k_index`` / ``top_k_weights`` it is called with, a forward hook on every ``gate`` its router logits.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        blocks = moe_blocks(model)
        self.ids: list[torch.Tensor | None] = [None] * len(blocks)
        self.weights: list[torch.Tensor | None] = [None] * len(blocks)
        self.logits: list[torch.Tensor | None] = [None] * len(blocks)
        self.calls = [0] * len(blocks)
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.experts.register_forward_pre_hook(self._experts_hook(i), with_kwargs=True))
            self._handles.append(block.gate.register_forward_hook(self._gate_hook(i)))

    def _experts_hook(self, i: int) -> Callable:
        def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            weights = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
            self.ids[i], self.weights[i] = ids.detach().clone(), weights.detach().clone()
            self.calls[i] += 1

        return hook

    def _gate_hook(self, i: int) -> Callable:
        def hook(_module: torch.nn.Module, _args: tuple, out: Any) -> None:
            logits = out[0] if isinstance(out, tuple) else out
            self.logits[i] = logits.detach().clone()

        return hook

    def stacked_ids(self) -> torch.Tensor:
        """``[rows, MoE layers, top_k]`` int64 ids the experts received in the last forward."""
        return torch.stack([t.long() for t in self.ids], dim=1)  # type: ignore[union-attr]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# ------------------------------------------------------------------------------------- the engine's R3 pass
def replay_pass_module() -> tuple[Any, str]:
    """:mod:`verl_stable.routing.replay_pass` (imports tensordict), or None with the reason."""
    try:
        from verl_stable.routing import replay_pass
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return replay_pass, ""


class _MirrorPass:
    """ReplayPass's REPLAY sessions in its order, for a machine where tensordict does not import (reported as FAIL)."""

    def __init__(self, model: torch.nn.Module, routing: Any) -> None:
        self.model, self.routing = model, routing
        self.natural = self.replayer = self.used = None

    def open(self) -> None:
        from verl_stable.routing.replay import RoutingRecorder

        self.natural = RoutingRecorder(self.model, self.routing, use_attention_mask=False)
        self.natural.install()

    def arm(self, targets: Any) -> None:
        from verl_stable.routing.replay import RoutingRecorder, RoutingReplayer

        self.replayer = RoutingReplayer(
            self.model, self.routing, None, token_mask=targets.token_mask, checked_rows=targets.dense
        )
        self.replayer.install()
        self.used = RoutingRecorder(self.model, self.routing, use_attention_mask=False)
        self.used.install()

    def close(self) -> None:
        for session in (self.used, self.replayer, self.natural):
            if session is not None:
                session.remove()


@dataclass
class Targets:
    """The fields of ``replay_pass.MicroBatchTargets`` this check uses (the mirror's stand-in)."""

    dense: torch.Tensor
    token_mask: torch.Tensor
    coverage: dict | None = None


class EngineR3:
    """One micro-batch under R3 the way the FSDP engine's replay mixin runs it (``fsdp_replay``, which imports verl).

    ``prepare_model_inputs`` aligns the micro-batch's ``routed_experts`` (int16 ``[nnz, decoder layers, top_k]``)
    to the packed model input and arms the pass; ``prepare_model_outputs`` compares the router's own and the used
    experts with the targets. The alignment and the comparison below are those of
    ``RouterReplayMixin._align_targets`` / ``_agreement_metrics`` for a packed micro-batch without Ulysses.
    """

    def __init__(self, model: torch.nn.Module, routing: Any) -> None:
        self.model, self.routing = model, routing
        self.module, _ = replay_pass_module()

    def align(self, rows: torch.Tensor, offsets: torch.Tensor, static_pad: int) -> Any:
        from verl_stable.routing import alignment
        from verl_stable.routing.checks import check_id_range
        from verl_stable.routing.trace import MISSING

        layout = self.routing.layout
        moe = alignment.select_layers(rows, layout.moe_layers)
        check_id_range(moe, layout.num_experts)
        has_data = alignment.rows_with_data(moe)
        dense = moe.to(torch.long).masked_fill_(~has_data.unsqueeze(-1), MISSING)
        aligned = alignment.packed_layout(dense, offsets, static_pad=static_pad)
        kind = Targets if self.module is None else self.module.MicroBatchTargets
        return kind(dense=aligned.token_rows(), token_mask=aligned.has_data.reshape(1, -1), coverage=None)

    @contextmanager
    def armed(self, rows: torch.Tensor, offsets: torch.Tensor, static_pad: int) -> Iterator[tuple[Any, Any]]:
        """The pass open and armed for one forward (and its backward), closed on exit."""
        targets = self.align(rows, offsets, static_pad)
        if self.module is None:
            replay = _MirrorPass(self.model, self.routing)
        else:
            replay = self.module.ReplayPass(
                action=self.module.ReplayAction.REPLAY, routing=self.routing, model=self.model
            )
        replay.open()
        try:
            replay.arm(targets)
            yield replay, targets
        finally:
            replay.close()

    @staticmethod
    def agreement(replay: Any, targets: Any) -> dict[str, float]:
        """Rows whose router choice / used experts differ from the targets (one read-back, as the engine does)."""
        from verl_stable.routing.disagreement import expert_sets_differ
        from verl_stable.routing.trace import MISSING

        natural = last_rows(replay.natural)
        used = last_rows(replay.used)
        token_rows = targets.token_mask.reshape(-1).to(natural.device)
        target = targets.dense.to(natural.device)
        has_data = target[..., 0] != MISSING
        both = torch.stack([natural[token_rows], used[token_rows]]).to(torch.long)
        differ = expert_sets_differ(both, target.expand(2, *target.shape)) & has_data
        router, used_differ, compared = torch.stack([differ[0].sum(), differ[1].sum(), has_data.sum()]).tolist()
        return {
            "router_disagreement": router / max(compared, 1),
            "disagreement": used_differ / max(compared, 1),
            "compared_rows": compared,
        }


def last_rows(recorder: Any) -> torch.Tensor:
    """``[rows, MoE layers, top_k]`` ids a recorder saw in its last forward (``replay_pass.last_forward_rows``)."""
    return torch.stack(list(recorder.forwards[-1].ids), dim=1)


# ------------------------------------------------------------------------------------------ R3 replay checks
@dataclass
class Packed:
    """A packed micro-batch: valid tokens of every sample, then ``static_pad`` pad rows (``use_remove_padding``)."""

    offsets: torch.Tensor  # cu_seqlens of the valid tokens, on the device
    static_pad: int
    inputs: dict[str, torch.Tensor]  # model kwargs ([1, nnz + pad])

    @property
    def nnz(self) -> int:
        return int(self.offsets[-1])


def pack(lengths: tuple[int, ...], static_pad: int, device: str, *, vocab: int | None, hidden: int | None) -> Packed:
    """Random tokens (or bf16 embeddings) of ``lengths`` packed into one row, position ids restarting per sample."""
    gen = torch.Generator().manual_seed(sum(lengths))
    nnz = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(static_pad)])[None]
    offsets = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.long, device=device)
    inputs: dict[str, torch.Tensor] = {"position_ids": positions.to(device)}
    if vocab is not None:
        ids = torch.randint(1, vocab, (nnz,), generator=gen)
        inputs["input_ids"] = torch.cat([ids, torch.zeros(static_pad, dtype=torch.long)])[None].to(device)
    else:
        embeds = torch.randn(1, nnz + static_pad, hidden, generator=gen)
        inputs["inputs_embeds"] = embeds.to(device=device, dtype=torch.bfloat16)
    return Packed(offsets=offsets, static_pad=static_pad, inputs=inputs)


def output_of(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    out = model(**packed.inputs, use_cache=False)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


def random_rows(nnz: int, layers: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """``[nnz, layers, top_k]`` int16: ``top_k`` distinct experts per row, drawn uniformly."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(nnz, layers, experts, generator=gen).argsort(dim=-1)[..., :top_k].to(torch.int16)


def reference_gate_weights(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's gate weights at ``ids``: ``softmax_fp32(z)[ids]`` renormalised over the top-k, in z's dtype."""
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, ids.long())
    return (probs / probs.sum(dim=-1, keepdim=True)).to(logits.dtype)


def replay_checks(label: str, model: torch.nn.Module, packed: Packed) -> None:
    """R3 replay on one model: exact on native routes, forced on random routes, router gradient."""
    from verl_stable.routing.families import bind_model

    routing = bind_model(model)
    layout = routing.layout
    engine = EngineR3(model, routing)
    nnz, pad = packed.nnz, packed.static_pad
    probe = ExpertProbe(model)
    try:
        with torch.no_grad():
            plain = output_of(model, packed)
            native = probe.stacked_ids()  # [nnz + pad, M, K]: the router's own choice, as the experts got it
            again = output_of(model, packed)
        check(f"{label}: plain forward is deterministic (the baseline of 'bit-identical')", torch.equal(plain, again))

        # the rollout's routed_experts for the valid tokens: native routes, int16 over every decoder layer
        rows = torch.zeros(nnz, layout.num_hidden_layers, layout.top_k, dtype=torch.int16, device=native.device)
        rows[:, list(layout.moe_layers)] = native[:nnz].to(torch.int16)
        with torch.no_grad(), engine.armed(rows, packed.offsets, pad) as (replay, targets):
            replayed = output_of(model, packed)
            used = probe.stacked_ids()
            agree = engine.agreement(replay, targets)
        diff = (replayed.float() - plain.float()).abs().max().item()
        check(
            f"{label}: R3 native routes: experts used == replayed on all {nnz} x {layout.num_moe_layers} rows",
            torch.equal(used[:nnz], native[:nnz]) and agree["disagreement"] == 0.0,
        )
        check(
            f"{label}: R3 native routes: {pad} pad rows keep the router's choice", torch.equal(used[nnz:], native[nnz:])
        )
        check(f"{label}: R3 native routes: output bit-identical to no replay", diff == 0.0, f"max |diff| {diff:.3g}")

        forced = random_rows(nnz, layout.num_hidden_layers, layout.num_experts, layout.top_k, seed=1)
        forced = forced.to(native.device)
        want = forced[:, list(layout.moe_layers)].long()
        model.zero_grad(set_to_none=True)
        with engine.armed(forced, packed.offsets, pad) as (replay, targets):
            out = output_of(model, packed)
            used = probe.stacked_ids()
            agree = engine.agreement(replay, targets)
            project_used = last_rows(replay.used).long()
            out.float().square().mean().backward()
            stats = replay.replayer.stats
        check(
            f"{label}: R3 random routes: experts used == replayed (independent hooks)",
            torch.equal(used[:nnz], want),
            f"rows {nnz} x {layout.num_moe_layers} layers, top-{layout.top_k} of {layout.num_experts}",
        )
        check(
            f"{label}: R3 random routes: the project's used-experts count agrees (disagreement 0)",
            agree["disagreement"] == 0.0 and torch.equal(project_used, used),
            f"disagreement {agree['disagreement']:.3g} over {agree['compared_rows']} rows",
        )
        check(
            f"{label}: R3 random routes: the router's own choice differs",
            agree["router_disagreement"] > 0.5,
            f"router disagreement {agree['router_disagreement']:.3f}",
        )
        worst = 0.0
        for layer in range(layout.num_moe_layers):
            got = probe.weights[layer][:nnz].float()
            ref = reference_gate_weights(probe.logits[layer][:nnz], want[:, layer]).float()
            worst = max(worst, ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item())
        check(
            f"{label}: R3 random routes: gate weights == softmax(router logits)[replayed ids], renormalised",
            worst <= 2.0**-7,
            f"max relative diff {worst:.3g} (bf16 ulp {2.0**-7:.3g})",
        )
        diff = (out.detach().float() - plain.float()).abs().max().item()
        scale = plain.float().abs().max().item()
        check(f"{label}: R3 random routes change the output", diff > 1e-3 * scale, f"max |diff| {diff:.3g}")
        grads = [b.gate.weight.grad for b in moe_blocks(model)]
        norms = [float(g.float().norm()) if g is not None else float("nan") for g in grads]
        check(
            f"{label}: R3 random routes: every router gets a finite, non-zero gradient",
            all(math.isfinite(n) and n > 0 for n in norms),
            f"grad norms {[f'{n:.3g}' for n in norms]}",
        )
        check(
            f"{label}: R3 replay stats: {nnz * layout.num_moe_layers} rows replayed, {pad * layout.num_moe_layers} pad",
            stats.replayed_rows == nnz * layout.num_moe_layers and stats.padding_rows == pad * layout.num_moe_layers,
            str(stats.as_dict()),
        )
    finally:
        probe.remove()
        model.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------- loss checks
EPS_LOW, EPS_HIGH = 0.2, 0.27


def loss_inputs(batch: int, length: int, seed: int, spread: float) -> dict[str, np.ndarray]:
    """Ragged float64 token tensors: log-probs, old log-probs at ``spread``, +-1 advantages, IS weights, mask."""
    rng = np.random.default_rng(seed)
    logp = rng.uniform(-4.0, -0.05, (batch, length))
    old = logp + rng.normal(0.0, spread, (batch, length))
    # keep every ratio away from the trust-region bounds: a token within float32 rounding of a bound could be masked
    # on one side and not the other, a legitimate difference this comparison must not report
    for bound in (1.0 + EPS_HIGH, 1.0 - EPS_LOW):
        near = np.abs(np.exp(logp - old) - bound) < 1e-4
        old[near] += 1e-3
    lengths = rng.integers(length // 4, length + 1, batch)
    mask = np.arange(length)[None] < lengths[:, None]
    seq_adv = rng.choice([-1.0, 1.0], batch) * rng.uniform(0.2, 1.5, batch)
    adv = np.where(mask, seq_adv[:, None], 0.0)
    weights = np.minimum(np.exp(rng.normal(0.0, 0.2, (batch, length))), 5.0)
    return {"log_prob": logp, "old_log_prob": old, "advantages": adv, "mask": mask, "weights": weights}


def minirl_reference(x: dict[str, np.ndarray]) -> dict[str, Any]:
    """MiniRL (arXiv 2512.01374) in float64: ``-M * sg[w * r] * A * logp`` per token, seq-mean-token-sum."""
    lp, old, adv, mask, w = x["log_prob"], x["old_log_prob"], x["advantages"], x["mask"], x["weights"]
    r = np.exp(np.clip(lp - old, -20.0, 20.0))
    clipped = ((adv > 0) & (r > 1 + EPS_HIGH)) | ((adv < 0) & (r < 1 - EPS_LOW))
    coef = np.where(mask & ~clipped, w * r * adv, 0.0)
    seqs = mask.any(axis=1).sum()
    return {
        "loss_mat": -coef * lp,
        "loss": (-coef * lp).sum() / seqs,
        "grad": -coef / seqs,
        "actor/pg_clipfrac": (clipped & mask).sum() / mask.sum(),
        "actor/ppo_kl": np.where(mask, old - lp, 0.0).sum() / mask.sum(),
    }


def vespo_reference(x: dict[str, np.ndarray]) -> dict[str, Any]:
    """VESPO (arXiv 2602.10693) in float64: ``phi(W) = W^c1 exp(c2 (1 - W))`` per sequence, token-mean."""
    lp, old, adv, mask, w = x["log_prob"], x["old_log_prob"], x["advantages"], x["mask"], x["weights"]
    log_w = np.clip(np.where(mask, lp - old + np.log(w), 0.0).sum(axis=1), -20.0, 20.0)

    def phi(c1: float, c2: float) -> np.ndarray:
        return np.exp(log_w) ** c1 * np.exp(c2 * (1.0 - np.exp(log_w)))

    per_token = np.where(adv > 0, phi(2.0, 3.0)[:, None], phi(3.0, 2.0)[:, None])
    coef = np.where(mask, per_token * adv, 0.0)
    tokens = mask.sum()
    seqs = mask.any(axis=1)
    return {
        "loss_mat": -coef * lp,
        "loss": (-coef * lp).sum() / tokens,
        "grad": -coef / tokens,
        "actor/vespo/log_w_mean": log_w[seqs].mean(),
        "actor/ppo_kl": np.where(mask, old - lp, 0.0).sum() / tokens,
    }


def advantage_reference(rewards: np.ndarray, mask: np.ndarray, groups: list[str]) -> np.ndarray:
    """Group-mean baseline: ``A_i = R_i - mean_{j in group(i)} R_j`` on every valid token, float64."""
    scores = np.where(mask, rewards, 0.0).sum(axis=1)
    out = np.zeros_like(rewards)
    for i, g in enumerate(groups):
        members = [j for j, h in enumerate(groups) if h == g]
        out[i] = np.where(mask[i], scores[i] - scores[members].mean(), 0.0)
    return out


def _rel(got: torch.Tensor | float, ref: np.ndarray | float) -> float:
    """max |got - ref| / max(max |ref|, tiny): the error relative to the tensor's scale."""
    g = got.detach().double().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    return float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))


#: Tolerances of the device results against the float64 reference, relative to each tensor's largest value. fp32:
#: measured errors are <= 2e-7 (minirl) and <= 4e-6 (vespo: log W sums a sequence of fp32 log-ratio differences, and
#: phi multiplies that error by up to c1 + c2 W); the bounds sit ~25x above. bf16 log-probs are rounded before the
#: reference sees them, so only the fp32 arithmetic and the bf16 rounding of the gradient (2^-8) remain.
LOSS_TOL = {torch.float32: {"value": 1e-4, "grad": 1e-4}, torch.bfloat16: {"value": 1e-4, "grad": 8e-3}}


def loss_checks(device: str, sizes: Sizes) -> None:
    """MiniRL, VESPO and the group-mean advantage on ``device`` against the float64 CPU reference."""
    from verl_stable.algos.advantages import group_mean_baseline_advantages
    from verl_stable.algos.minirl import minirl_policy_loss
    from verl_stable.algos.vespo import vespo_policy_loss

    batch, length = sizes.loss_batch
    cases = [
        ("minirl", minirl_policy_loss, minirl_reference, 0.3, lambda m, n: m.sum() / n.any(dim=1).sum()),
        ("vespo", vespo_policy_loss, vespo_reference, 0.02, lambda m, n: m.sum() / n.sum()),
    ]
    for name, loss_fn, reference, spread, aggregate in cases:
        for dtype in (torch.float32, torch.bfloat16):
            x = loss_inputs(batch, length, seed=3, spread=spread)
            leaf = torch.tensor(x["log_prob"], dtype=dtype, device=device, requires_grad=True)
            x["log_prob"] = leaf.detach().double().cpu().numpy()  # the reference sees the rounded values
            ref = reference(x)

            def on_device(key: str) -> torch.Tensor:
                return torch.tensor(x[key], dtype=torch.float32, device=device)  # noqa: B023 - used in this loop

            mask = torch.tensor(x["mask"], device=device)
            terms = loss_fn(
                leaf, on_device("old_log_prob"), on_device("advantages"), mask.float(), on_device("weights")
            )
            loss = aggregate(terms.loss_mat, mask)
            loss.backward()
            metrics = terms.scalars()
            tol = LOSS_TOL[dtype]
            errors = {
                "loss_mat": _rel(terms.loss_mat, ref["loss_mat"]),
                "loss": _rel(loss, ref["loss"]),
                "grad": _rel(leaf.grad, ref["grad"]),
            }
            errors.update({k: _rel(metrics[k], ref[k]) for k in ref if "/" in k})
            limits = {k: tol["grad"] if k == "grad" else tol["value"] for k in errors}
            worst = {k: f"{v:.2g}" for k, v in errors.items()}
            check(
                f"losses: {name} on {device} ({str(dtype).removeprefix('torch.')} log-probs) == float64 CPU reference",
                all(errors[k] <= limits[k] for k in errors) and np.isfinite(ref["loss"]),
                f"relative errors {worst} (tolerance {tol['value']:.0e} values, {tol['grad']:.0e} grad)",
            )
            if name == "minirl" and dtype is torch.float32:
                clipfrac = ref["actor/pg_clipfrac"]
                check(
                    "losses: minirl inputs exercise the trust region",
                    0.05 < clipfrac < 0.95,
                    f"clipfrac {clipfrac:.3f}",
                )

    rng = np.random.default_rng(5)
    rewards = rng.normal(0.0, 1.0, (batch, length))
    mask = np.arange(length)[None] < rng.integers(1, length + 1, batch)[:, None]
    groups = [f"uid{i // 4}" for i in range(batch)]
    adv, _ = group_mean_baseline_advantages(
        torch.tensor(rewards, dtype=torch.float32, device=device), torch.tensor(mask, device=device), groups
    )
    ref = advantage_reference(rewards.astype(np.float32).astype(np.float64), mask, groups)
    err = _rel(adv, ref)
    check(
        f"losses: group-mean advantage on {device} == float64 CPU reference", err <= 1e-6, f"relative error {err:.2g}"
    )


# ------------------------------------------------------------------------------------------ overhead check
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def overhead_check(model: torch.nn.Module, packed: Packed, device: str, sizes: Sizes, quick: bool) -> None:
    """Forward + backward of the wide layer with the engine's R3 pass vs without: interleaved rounds, median ratio."""
    from verl_stable.routing.families import bind_model

    routing = bind_model(model)
    layout = routing.layout
    engine = EngineR3(model, routing)
    recorder_probe = ExpertProbe(model)
    with torch.no_grad():
        output_of(model, packed)
    native = recorder_probe.stacked_ids()[: packed.nnz]
    recorder_probe.remove()
    rows = torch.zeros(packed.nnz, layout.num_hidden_layers, layout.top_k, dtype=torch.int16, device=native.device)
    rows[:, list(layout.moe_layers)] = native.to(torch.int16)  # a rollout that routed as the trainer does
    disagreements: list[float] = []

    def plain_step() -> None:
        model.zero_grad(set_to_none=True)
        output_of(model, packed).float().square().mean().backward()

    def r3_step() -> None:
        model.zero_grad(set_to_none=True)
        with engine.armed(rows, packed.offsets, packed.static_pad) as (replay, targets):
            out = output_of(model, packed)
            disagreements.append(engine.agreement(replay, targets)["disagreement"])
            out.float().square().mean().backward()

    def timed(step: Callable[[], None]) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(sizes.steps):
            step()
        sync(device)
        return (time.perf_counter() - start) / sizes.steps

    for _ in range(sizes.warmup):
        timed(plain_step)
        timed(r3_step)
    ratios, plain_times, r3_times = [], [], []
    for i in range(sizes.rounds):
        # alternate which variant goes first, so neither always runs on a warmer cache or clock
        if i % 2 == 0:
            t_plain, t_r3 = timed(plain_step), timed(r3_step)
        else:
            t_r3, t_plain = timed(r3_step), timed(plain_step)
        plain_times.append(t_plain)
        r3_times.append(t_r3)
        ratios.append(t_r3 / t_plain)
    model.zero_grad(set_to_none=True)
    median = statistics.median(ratios)
    tokens = packed.nnz + packed.static_pad
    detail = (
        f"median R3 / off {median:.4f} over {sizes.rounds} interleaved rounds x {sizes.steps} steps "
        f"(rounds min {min(ratios):.4f} max {max(ratios):.4f}); step medians off "
        f"{statistics.median(plain_times) * 1e3:.2f} ms, R3 {statistics.median(r3_times) * 1e3:.2f} ms; "
        f"{tokens} tokens, {layout.num_experts} experts top-{layout.top_k}, hidden {model.config.hidden_size}"
    )
    check(
        "overhead: every R3 step replayed exactly (disagreement 0)",
        bool(disagreements) and max(disagreements) == 0.0 and all(math.isfinite(r) for r in ratios),
        f"{len(disagreements)} R3 steps",
    )
    if device == "cuda":
        check(
            f"overhead: R3 step <= {OVERHEAD_LIMIT:.2f}x of no replay (the R3 paper's < 3 %)",
            median < OVERHEAD_LIMIT,
            detail,
        )
    else:
        report("INFO", "overhead: R3 step vs no replay (timing judged on cuda only)", detail)


# --------------------------------------------------------------------------------------------------- main
def environment(device: str) -> str:
    import transformers

    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    try:
        import tensordict

        parts.append(f"tensordict {tensordict.__version__}")
    except ImportError:
        parts.append("tensordict missing")
    if device == "cuda":
        parts.append(torch.cuda.get_device_name(0))
    else:
        parts.append(f"cpu, {torch.get_num_threads()} thread(s)")
    return ", ".join(parts)


def run(device: str, quick: bool) -> None:
    sizes = sizes_for(device, quick)
    module, why = replay_pass_module()
    check(
        "import verl_stable.routing.replay_pass (the FSDP engine's replay pass; needs tensordict)",
        module is not None,
        why or "replay checks use it",
    )
    with guarded("toy Qwen3-MoE"):
        t0 = time.perf_counter()
        toy = build(toy_config(), device, causal_lm=True)
        packed = pack(sizes.toy_lengths, sizes.static_pad, device, vocab=toy.config.vocab_size, hidden=None)
        report("INFO", "toy Qwen3-MoE", f"experts implementation {toy.config._experts_implementation}")
        replay_checks("toy", toy, packed)
        print(f"  toy replay checks {time.perf_counter() - t0:.1f} s", flush=True)
        del toy
    with guarded("losses"):
        t0 = time.perf_counter()
        loss_checks(device, sizes)
        print(f"  loss checks {time.perf_counter() - t0:.1f} s", flush=True)
    with guarded("Qwen3-30B-A3B layer"):
        t0 = time.perf_counter()
        wide = build(wide_config(), device, causal_lm=False)
        params = sum(p.numel() for p in wide.parameters())
        report(
            "INFO",
            "Qwen3-30B-A3B layer",
            f"{params / 1e6:.0f} M parameters, experts {wide.config._experts_implementation}",
        )
        hidden = wide.config.hidden_size
        replay_checks(
            "30B-A3B layer", wide, pack(sizes.wide_lengths, sizes.static_pad, device, vocab=None, hidden=hidden)
        )
        print(f"  wide replay checks {time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        overhead = pack(sizes.overhead_lengths, 0, device, vocab=None, hidden=hidden)
        overhead_check(wide, overhead, device, sizes, quick)
        print(f"  overhead check {time.perf_counter() - t0:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="fewer tokens and timing rounds (CI: --device cpu)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads on --device cpu (default 1)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[FAIL] no CUDA device (run with --device cpu for the CPU variant)")
        return 1
    if args.device == "cpu":
        # one thread: on a shared host, OpenMP workers that wait on each other run many times slower
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(f"device checks on {args.device}{' (quick)' if args.quick else ''}: {environment(args.device)}", flush=True)
    try:
        run(args.device, args.quick)
    except Exception:  # noqa: BLE001 - reported as a FAIL line, the exit code says it
        traceback.print_exc()
        check("device checks ran to completion", False)
    failed = [name for status, name, _ in RESULTS if status == "FAIL"]
    judged = [r for r in RESULTS if r[0] != "INFO"]
    print(
        f"{len(judged) - len(failed)}/{len(judged)} checks passed in {time.perf_counter() - start:.1f} s"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 0 if judged and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
