"""One pass of verl's FSDP engine under router replay: what it does with routing and the routing sessions it holds.

This module owns the pieces of the replay state machine that do not depend on verl's engine: the decision table of
a pass (:func:`replay_action`: none / observe / record / replay, from ``router_replay.mode`` and the pass's kind),
the routing sessions installed on the model for one ``forward_backward_batch`` call (:class:`ReplayPass`, armed
once per micro-batch), reading a micro-batch's ``routed_experts`` as packed rows (:func:`routed_rows`) and the rows
a recorder saw (:func:`last_forward_rows`), the per-layer R2 drift (:func:`r2_drift_per_layer`) and the replay
coverage of a micro-batch (:func:`response_layout`, :func:`token_roles`, :func:`coverage_counts`). The engine mixin
that drives them from verl's hooks is :mod:`verl_stable.integration.fsdp_replay`; nothing here imports verl.

Replay coverage. Each (token, MoE layer) row the routers see in a replayed micro-batch falls in exactly one class:

* ``response_rows``: rows of response tokens whose routing feeds a trained log-prob, i.e. every response token
  before the sample's last trained one (``response_mask == 1``; tool output between turns included, since later
  trained tokens attend to it); ``response_replayed_rows`` of them were replayed, the rest fell back to the
  model's own routing;
* ``prompt_rows`` / ``prompt_replayed_rows``: the same for prompt tokens;
* ``not_needed_rows``: tokens from the sample's last trained token on (the last sampled token, which the engine
  never fed back, and tool output after the last turn): the log-prob at position ``p`` is computed from the hidden
  state at ``p - 1``, so their routing feeds no trained log-prob and a missing row there is no fallback;
* ``padding_rows``: rows of the model input that are no token (packing pad, Ulysses pad, right padding).

The counts are of the whole micro-batch, before any Ulysses slicing, so every sequence-parallel rank computes the
same numbers; the fractions are formed on the driver from the summed counts
(:func:`verl_stable.monitor.routing_metrics.replay_coverage_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from tensordict import TensorDict

from verl_stable.metric_names import COVERAGE_COUNTS, ENGINE_ROUTING
from verl_stable.routing.disagreement import expert_sets_differ
from verl_stable.routing.families import ModelRouting
from verl_stable.routing.replay import RoutingRecorder, RoutingReplayer

ROUTED_EXPERTS = "routed_experts"
METRIC_PREFIX = ENGINE_ROUTING  # verl adds "actor/"; the monitored trainers move the keys back under "stable/"
MODES = ("disabled", "R2", "R3")


class ReplayAction(Enum):
    """What one engine pass does with routing."""

    NONE = "none"  # verl's engine, untouched
    OBSERVE = "observe"  # record the routing used and compare it with the batch's routed_experts
    RECORD = "record"  # R2 pi_old pass: record and return routed_experts
    REPLAY = "replay"  # force the batch's routed_experts


class RouterReplayError(RuntimeError):
    """Router replay cannot run as configured (missing routing, wrong shapes, unsupported setup)."""


def replay_action(
    mode: str,
    *,
    forward_only: bool,
    engine_forward_only: bool,
    reference_pass: bool,
    batch_has_routing: bool,
    worker_flag: bool | None = None,
) -> ReplayAction:
    """Decide what an engine pass does with routing.

    Args:
        mode: ``router_replay.mode`` of this engine: disabled, R2 or R3.
        forward_only: the pass computes log-probs only (``compute_log_prob``), no update.
        engine_forward_only: the engine was built forward-only (verl's reference policy engine).
        reference_pass: the pass runs under ``disable_adapter()`` (reference log-probs of a LoRA actor).
        batch_has_routing: the batch carries ``routed_experts``.
        worker_flag: the ``enable_routing_replay`` value verl's worker put on the batch, if any (verl sets it to
            False for the reference pass of strategies it knows).

    Returns:
        NONE for the reference policy and for disabled runs without routing in the batch; OBSERVE for disabled runs
        that carry the rollout's routing; RECORD for R2's pi_old pass; REPLAY for R2 updates and every R3 pass.
    """
    if mode not in MODES:
        raise ValueError(f"router_replay.mode must be one of {MODES}, got {mode!r}")
    if engine_forward_only or reference_pass or worker_flag is False:
        return ReplayAction.NONE
    if mode == "disabled":
        return ReplayAction.OBSERVE if batch_has_routing else ReplayAction.NONE
    if mode == "R2":
        return ReplayAction.RECORD if forward_only else ReplayAction.REPLAY
    return ReplayAction.REPLAY


def routed_rows(micro_batch: TensorDict, field: str = ROUTED_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing ``field`` of a micro-batch as packed rows ``[nnz, layers, top_k]`` and the input's cu_seqlens."""
    input_ids = micro_batch["input_ids"]
    offsets = input_ids.offsets() if input_ids.is_nested else None
    routed = micro_batch.get(field, None)
    if routed is None:
        raise RouterReplayError(f"the micro-batch has no '{field}'")
    if routed.is_nested:
        if offsets is None:
            raise RouterReplayError(f"{field} is nested but input_ids is not: cannot align them")
        rows = routed.values()
        routed_offsets = routed.offsets()
        if routed_offsets.shape != offsets.shape or not torch.equal(routed_offsets.cpu(), offsets.cpu()):
            raise RouterReplayError(
                f"{field} rows per sample {routed_offsets.diff().tolist()} do not match the input_ids lengths "
                f"{offsets.diff().tolist()}: routing must have one row per valid token (prompt + response)"
            )
        return rows, offsets
    if routed.dim() != 4:
        raise RouterReplayError(
            f"routed_experts must be [batch, tokens, layers, top_k] (nested over tokens), got {tuple(routed.shape)}"
        )
    batch, width = routed.shape[:2]
    if offsets is None:
        offsets = torch.arange(batch + 1, device=routed.device) * width
    lengths = offsets.diff()
    if bool((lengths != width).any()):
        raise RouterReplayError(
            f"routed_experts is a dense [batch, {width}, ...] tensor but the samples have {lengths.tolist()} tokens"
        )
    return routed.reshape(batch * width, *routed.shape[2:]), offsets


@dataclass
class MicroBatchTargets:
    """The reference routing of one micro-batch, aligned to the rows the routers see on this rank."""

    dense: torch.Tensor  # [token rows, M, K] int64 on device, MISSING where a row has no data; ids checked
    token_mask: torch.Tensor  # [B, S] bool over the model input: True where a row is a real token
    coverage: dict[str, float] | None = None  # coverage_counts of the whole micro-batch (REPLAY passes only)


@dataclass
class ReplayPass:
    """Routing sessions installed on the model for one ``forward_backward_batch`` call."""

    action: ReplayAction
    routing: ModelRouting
    model: torch.nn.Module
    natural: RoutingRecorder | None = None  # sees the router's own choice (installed before the replayer)
    replayer: RoutingReplayer | None = None
    used: RoutingRecorder | None = None  # sees the experts actually used (installed after the replayer)
    targets: MicroBatchTargets | None = None
    output_args: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def open(self) -> None:
        """Install the recorder of the router's own choice (before any replayer, so it sees the live router)."""
        self.natural = RoutingRecorder(self.model, self.routing, use_attention_mask=False)
        self.natural.install()

    def arm(self, targets: MicroBatchTargets | None) -> None:
        """Prepare the sessions for the next micro-batch forward (its backward runs before the next ``arm``)."""
        self.targets = targets
        self.metrics = {}
        assert self.natural is not None
        self.natural.clear()
        if self.used is not None:
            self.used.clear()
        if self.action is not ReplayAction.REPLAY:
            return
        assert targets is not None
        # the engine checked the rows as it aligned them (range; a row with data has distinct ids by definition)
        if self.replayer is None:
            self.replayer = RoutingReplayer(
                self.model, self.routing, None, token_mask=targets.token_mask, checked_rows=targets.dense
            )
            self.replayer.install()
            self.used = RoutingRecorder(self.model, self.routing, use_attention_mask=False)
            self.used.install()
        else:
            self.replayer.set_checked_rows(targets.dense, token_mask=targets.token_mask)

    def close(self) -> None:
        """Remove every session this pass installed."""
        # Remove in reverse install order so every wrapper restores what it wrapped.
        for session in (self.used, self.replayer, self.natural):
            if session is not None:
                session.remove()


def last_forward_rows(recorder: RoutingRecorder | None) -> tuple[torch.Tensor, tuple[int, int]]:
    """``[rows, M, K]`` ids (on the model's device) and ``(B, S)`` of the recorder's last forward."""
    if recorder is None or not recorder.forwards:
        raise RouterReplayError("no forward pass was recorded for this micro-batch")
    fwd = recorder.forwards[-1]
    if any(ids is None for ids in fwd.ids) or fwd.batch is None:
        raise RouterReplayError("the micro-batch forward did not route through every MoE layer")
    return torch.stack(list(fwd.ids), dim=1), fwd.batch


def r2_drift_per_layer(natural: torch.Tensor, recorded: torch.Tensor, has_data: torch.Tensor) -> list[float]:
    """Per MoE layer, the fraction of rows with data where the router's top-k set differs from the recorded one.

    ``drift_l = sum_n 1[set(natural[n, l]) != set(recorded[n, l])] * has_data[n, l] / max(sum_n has_data[n, l], 1)``.

    Args:
        natural: ``[rows, moe_layers, top_k]`` expert ids the live router chose.
        recorded: ``[rows, moe_layers, top_k]`` pi_old's recorded (replayed) ids.
        has_data: ``[rows, moe_layers]`` bool, rows that carry recorded routing.
    """
    differ = (expert_sets_differ(natural, recorded) & has_data).sum(dim=0).double()
    compared = has_data.sum(dim=0).clamp(min=1).double()
    return (differ / compared).tolist()


def response_layout(micro_batch: TensorDict, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each sample's response length and which response tokens are trained, read from a micro-batch on the host.

    The response is the tail of each sample's ``input_ids``: ``response_mask`` is nested with one entry per response
    token (verl's engine workers), or a right-padded ``[B, R]`` tensor next to the ``[B, S]`` ``attention_mask`` whose
    last ``R`` columns give each response's length (verl's padded batches).

    Args:
        micro_batch: the micro-batch as the engine receives it.
        offsets: ``[B + 1]`` cu_seqlens of its ``input_ids``.

    Returns:
        ``(response_lengths, trained)``: ``[B]`` int64 and ``[sum(response_lengths)]`` bool (``response_mask != 0``,
        sample after sample), both on the host; ``None`` when the micro-batch carries no ``response_mask`` (or a dense
        one without ``attention_mask``): coverage is then not counted.

    Raises:
        RouterReplayError: If the response lengths do not fit the sequences.
    """
    keys = micro_batch.keys()
    if "response_mask" not in keys:
        return None
    response_mask = micro_batch["response_mask"]
    lengths = offsets.diff().cpu()
    if response_mask.is_nested:
        response_lengths = response_mask.offsets().diff().cpu()
        flags = response_mask.values().cpu() != 0
    elif response_mask.dim() == 2 and "attention_mask" in keys and not micro_batch["attention_mask"].is_nested:
        width = response_mask.shape[1]
        response_lengths = micro_batch["attention_mask"][:, -width:].sum(dim=1).cpu() if width else lengths * 0
        columns = torch.arange(width).unsqueeze(0)
        flags = (response_mask.cpu() != 0)[columns < response_lengths.unsqueeze(1)]  # row-major: sample by sample
    else:
        return None
    if response_lengths.shape != lengths.shape or bool((response_lengths > lengths).any()):
        raise RouterReplayError(
            f"response lengths {response_lengths.tolist()} do not fit the sequence lengths {lengths.tolist()}"
        )
    return response_lengths.long(), flags


def token_roles(micro_batch: TensorDict, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per packed token row of a micro-batch: is it a prompt token, and is its log-prob trained.

    Args:
        micro_batch: the micro-batch as the engine receives it (its response layout: :func:`response_layout`).
        offsets: ``[B + 1]`` cu_seqlens of its ``input_ids``.

    Returns:
        ``(is_prompt, trained)``, two ``[tokens]`` bool tensors on ``offsets``' device, or ``None`` when the
        micro-batch carries no response layout: coverage is then not counted.

    Raises:
        RouterReplayError: If the response lengths do not fit the sequences.
    """
    layout = response_layout(micro_batch, offsets)
    if layout is None:
        return None
    response_lengths, flags = layout
    lengths = offsets.diff().cpu()
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    position = torch.arange(int(lengths.sum())) - offsets.cpu()[:-1][sample]
    is_prompt = position < (lengths - response_lengths)[sample]
    trained = torch.zeros_like(is_prompt)
    trained[~is_prompt] = flags
    return is_prompt.to(offsets.device), trained.to(offsets.device)


def coverage_counts(
    has_data: torch.Tensor,
    offsets: torch.Tensor,
    is_prompt: torch.Tensor,
    trained: torch.Tensor,
    padding_tokens: int,
) -> dict[str, float]:
    """Replay coverage of one micro-batch in (token, MoE layer) rows (classes in the module docstring).

    A row is needed iff its position lies before its sample's last trained token; a sample without a trained token
    (verl's padding samples) needs none.

    Args:
        has_data: ``[tokens, moe_layers]`` bool, rows with routing to replay, packed sample after sample.
        offsets: ``[B + 1]`` cu_seqlens of the samples in ``has_data``.
        is_prompt: ``[tokens]`` bool, prompt tokens.
        trained: ``[tokens]`` bool, tokens whose log-prob is trained (``response_mask == 1``).
        padding_tokens: model-input positions that are no token.

    Returns:
        ``{name: count}`` for every name of :data:`~verl_stable.metric_names.COVERAGE_COUNTS`.

    Raises:
        ValueError: If the shapes disagree or ``padding_tokens`` is negative.
    """
    tokens, layers = has_data.shape
    if is_prompt.shape != (tokens,) or trained.shape != (tokens,) or int(offsets[-1]) != tokens:
        raise ValueError(
            f"coverage needs one prompt / trained flag per token row and offsets ending at {tokens}, got "
            f"{tuple(is_prompt.shape)}, {tuple(trained.shape)} and offsets ending at {int(offsets[-1])}"
        )
    if padding_tokens < 0:
        raise ValueError(f"padding_tokens must be >= 0, got {padding_tokens}")
    device = has_data.device
    lengths = offsets.diff().to(device)
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    position = torch.arange(tokens, device=device)
    # the last trained position of each sample, -1 when none; everything before it feeds a trained log-prob
    last_trained = torch.full((lengths.numel(),), -1, dtype=torch.long, device=device)
    last_trained.scatter_reduce_(0, sample, torch.where(trained.to(device), position, -1), reduce="amax")
    needed = position < last_trained[sample]
    prompt = needed & is_prompt.to(device)
    response = needed & ~is_prompt.to(device)
    replayed = has_data.sum(dim=1)  # MoE layers with routing, per token
    counts = {
        "response_rows": int(response.sum()) * layers,
        "response_replayed_rows": int(replayed[response].sum()),
        "prompt_rows": int(prompt.sum()) * layers,
        "prompt_replayed_rows": int(replayed[prompt].sum()),
        "not_needed_rows": int((~needed).sum()) * layers,
        "padding_rows": int(padding_tokens) * layers,
    }
    assert tuple(counts) == COVERAGE_COUNTS
    return {name: float(value) for name, value in counts.items()}
