"""A pure-torch varlen causal attention for the CPU runtime: verl's packed (``use_remove_padding``) and Ulysses paths.

verl trains on packed micro-batches (``use_remove_padding=True``: the valid tokens of all samples concatenated into one
row ``[1, S]``, each sample's ``position_ids`` restarting at 0) and runs Ulysses sequence parallelism on top of them.
Both reach attention through transformers' flash-attention entry, ``transformers.integrations.flash_attention.
_flash_attention_forward``: verl's ``apply_monkey_patch`` (called by its FSDP engine's ``_build_model_optimizer`` with
``use_remove_padding`` and ``ulysses_sequence_parallel_size``) replaces that entry with
``verl.models.transformers.monkey_patch._ulysses_flash_attention_forward``, which all-to-alls query/key/value from
"sequence slice, all heads" to "whole sequence, heads slice", all-gathers ``position_ids``, calls the kernel it holds
as the module global ``monkey_patch._flash_attention_forward`` (transformers' flash-attn varlen kernel, GPU-only), and
all-to-alls back. transformers' ``sdpa`` does not go through that entry, so under sp > 1 each rank would attend only
within its own slice of the sequence.

This module gives the CPU both halves:

* :func:`varlen_causal_attention`, the kernel, with flash-attn varlen semantics (the call convention of transformers'
  ``_flash_attention_forward``: ``[B, S, H, D]`` in and out).
* :func:`register`, the CPU runtime's registration (:mod:`verl_stable.cpu.runtime`, in every process verl starts, only
  where the CPU platform is selected): an attention implementation named :data:`ATTN_IMPLEMENTATION` in transformers'
  ``AttentionInterface`` (verl passes ``actor_rollout_ref.model.override_config.attn_implementation`` to
  ``AutoConfig.from_pretrained``) whose function calls the flash-attention entry looked up per call, so verl's Ulysses
  patch wraps it; and the kernel as verl's ``monkey_patch._flash_attention_forward`` for CPU tensors, so the kernel
  runs under verl's all-to-all. Both wait for the import of their module (:func:`~verl_stable.integration.
  import_hooks.when_imported`): the plugin step imports neither transformers' modeling code nor verl's patch module.

Selecting it for a run is :data:`OVERRIDES` (``verl_stable.toy.launch.cpu_overrides(attention="varlen")``).
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import torch

from verl_stable.compat import contracts
from verl_stable.compat.contracts import Contract, ContractError, ContractResult
from verl_stable.cpu.platform import cpu_selected

ATTN_IMPLEMENTATION = "verl_stable_varlen"
"""The ``attn_implementation`` name the kernel is registered under (``override_config.attn_implementation``)."""

OVERRIDES: tuple[str, ...] = (
    "actor_rollout_ref.model.use_remove_padding=True",
    f"+actor_rollout_ref.model.override_config.attn_implementation={ATTN_IMPLEMENTATION}",
)
"""Hydra overrides that make a CPU run train packed with this kernel (and allow Ulysses sp > 1)."""

TRANSFORMERS_MODULE = "transformers.modeling_utils"  # defines AttentionInterface
VERL_PATCH_MODULE = "verl.models.transformers.monkey_patch"  # holds the kernel verl's Ulysses wrapper calls

# Kernel calls in this process, by path: "ulysses" (under verl's Ulysses wrapper, whatever its sp) or "direct" (the
# attention function called the kernel itself). Bounded (two keys); tests and the first-call log line read it.
CALLS: collections.Counter[str] = collections.Counter()

# Arguments of transformers' flash-attention call convention that change the result and that this kernel does not
# implement: refused when set, never silently ignored.
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "cu_seq_lens_q", "cu_seq_lens_k")


def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which packed sequence each token belongs to, per batch row.

    A sequence starts at the first token and wherever the position does not continue its predecessor
    (``p_t != p_{t-1} + 1``). For verl's packed rows (every sample's positions ``0, 1, ..., n-1``, Ulysses pad rows
    ``0, 1, ...``) these are exactly flash-attn's sequences (``cu_seqlens`` at ``p_t == 0``).

    Args:
        position_ids: ``[B, S]`` integer positions.

    Returns:
        ``[B, S]`` int64, 1-based sequence index within each row.
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.to(torch.int64).cumsum(dim=1)


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_length: int,
    *args: Any,
    is_causal: bool = True,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Causal attention within each packed sequence, as flash-attn's varlen kernel computes it, in pure torch.

    With ``seq(t)`` the sequence of token ``t`` (:func:`sequence_ids` of ``position_ids``; one sequence per row when
    ``position_ids`` is None) and ``valid(s)`` the 2D ``attention_mask`` (all ones when None)::

        allowed(t, s) = [seq(s) == seq(t)] * [s <= t] * [valid(s) or s == t]
        out_t = sum_s softmax_s(q_t . k_s * scale + log allowed(t, s)) v_s,   scale = softmax_scale or D ** -0.5

    per batch row and head; key/value head ``j`` serves query heads ``j * H / H_kv ... (j + 1) * H / H_kv - 1`` (GQA).
    A padding query attends only to itself (its output is not used; a fully masked row would be NaN).

    Memory is ``O(B * H * S^2)`` (a dense mask and score matrix): meant for the CPU runtime's short sequences.

    Args:
        query: ``[B, S, H, D]``.
        key: ``[B, S, H_kv, D]``, ``H`` a multiple of ``H_kv``.
        value: ``[B, S, H_kv, D]``.
        attention_mask: None, or ``[B, S]`` with 1/True at real tokens (transformers' flash-attention mask).
        query_length: ``S`` (no KV cache: keys are the same tokens as queries).
        *args: ignored (transformers' positional extras).
        is_causal: must be True (decoder self-attention).
        dropout: attention dropout probability (transformers passes 0.0 outside training).
        position_ids: ``[B, S]`` (or ``[S]``) positions delimiting packed sequences.
        softmax_scale: the score scale; ``D ** -0.5`` when None.
        **kwargs: transformers' other flash-attention arguments; those in ``_UNSUPPORTED`` must be None.

    Returns:
        ``[B, S, H, D]``, in ``query``'s dtype.

    Raises:
        NotImplementedError: non-causal attention, a KV cache (``key`` longer than ``query``), or a sliding window,
            soft-capping, attention sinks or explicit ``cu_seq_lens``.
        ValueError: shapes that do not fit together.
    """
    unsupported = sorted(name for name in _UNSUPPORTED if kwargs.get(name) is not None)
    if unsupported:
        raise NotImplementedError(f"verl-stable varlen attention does not implement {unsupported}")
    if not is_causal:
        raise NotImplementedError("verl-stable varlen attention is causal only")
    batch, seq_len, heads, _ = query.shape
    if key.shape[1] != seq_len or query_length != seq_len:
        raise NotImplementedError(
            f"verl-stable varlen attention has no KV cache: query {seq_len} (query_length {query_length}) vs key "
            f"{key.shape[1]} tokens"
        )
    kv_heads = key.shape[2]
    if heads % kv_heads or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} / value {tuple(value.shape)} mismatch")
    if position_ids is None:
        seq = torch.ones(batch, seq_len, dtype=torch.int64, device=query.device)
    else:
        seq = sequence_ids(position_ids.reshape(-1, seq_len).expand(batch, seq_len))
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=query.device).tril()
    allowed = (seq[:, :, None] == seq[:, None, :]) & causal  # [B, S_q, S_k]
    if attention_mask is not None:
        # a real query never sees a padding key; a padding query sees itself (the diagonal), so no row is empty
        keys = attention_mask.to(torch.bool)[:, None, :] | torch.eye(seq_len, dtype=torch.bool, device=query.device)
        allowed = allowed & keys
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, H, S, D]
    if kv_heads != heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None], dropout_p=dropout, scale=softmax_scale
    )
    return out.transpose(1, 2)


def _counted(path: str) -> None:
    """Count a kernel call; the first of each path in a process prints one line, so a run's log shows that (and how)
    the kernel ran in each worker."""
    CALLS[path] += 1
    if CALLS[path] == 1:
        print(f"verl-stable: {ATTN_IMPLEMENTATION} attention kernel ran ({_describe_path(path)})", flush=True)


def _describe_path(path: str) -> str:
    if path != "ulysses":
        return "called directly, no verl patch"
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

    return f"under verl's Ulysses attention, sp={get_ulysses_sequence_parallel_world_size()}"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function registered as :data:`ATTN_IMPLEMENTATION` (transformers' attention-interface convention).

    Calls ``transformers.integrations.flash_attention._flash_attention_forward`` looked up now, so that verl's
    Ulysses wrapper runs when verl installed it (its all-to-all around the kernel, which :func:`register` made
    :func:`varlen_causal_attention` on CPU); where that entry is still transformers' own flash-attn kernel (verl's
    patch not applied: ``use_remove_padding=False`` at sp=1), the varlen kernel is called directly.

    Args:
        module: the attention module (its ``is_causal`` is used when ``is_causal`` is None).
        query: ``[B, H, S, D]``.
        key: ``[B, H_kv, S, D]``.
        value: ``[B, H_kv, S, D]``.
        attention_mask: what the mask interface made of the 2D padding mask (``flash_attention_mask``): None or
            ``[B, S]``.
        dropout: attention dropout probability.
        scaling: the score scale.
        is_causal: overrides ``module.is_causal``.
        **kwargs: ``position_ids`` and transformers' other flash-attention arguments.

    Returns:
        ``([B, S, H, D], None)``: the output and no attention weights.
    """
    from transformers import modeling_flash_attention_utils
    from transformers.integrations import flash_attention

    entry = flash_attention._flash_attention_forward
    if entry is modeling_flash_attention_utils._flash_attention_forward:
        entry = _direct
    out = entry(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attention_mask,
        query_length=query.shape[2],
        is_causal=getattr(module, "is_causal", True) if is_causal is None else is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        **{k: v for k, v in kwargs.items() if k in ("position_ids", *_UNSUPPORTED)},
    )
    return out, None


def _direct(*args: Any, **kwargs: Any) -> torch.Tensor:
    _counted("direct")
    return varlen_causal_attention(*args, **kwargs)


def ulysses_kernel(original: Any) -> Any:
    """The kernel for verl's Ulysses wrapper: :func:`varlen_causal_attention` for CPU tensors, ``original`` else."""

    def kernel(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if query.device.type != "cpu":
            return original(query, *args, **kwargs)
        _counted("ulysses")
        return varlen_causal_attention(query, *args, **kwargs)

    kernel.__verl_stable_original__ = original  # type: ignore[attr-defined]
    kernel.__name__ = kernel.__qualname__ = "verl_stable_ulysses_kernel"
    return kernel


def register_attention() -> list[str]:
    """Register :data:`ATTN_IMPLEMENTATION` with transformers (attention function, and flash-attention's mask kind:
    None or the 2D padding mask). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, flash_attention_mask)
    return [f"attention:{ATTN_IMPLEMENTATION}"]


def install_ulysses_kernel() -> list[str]:
    """Make :func:`varlen_causal_attention` the kernel verl's Ulysses wrapper calls for CPU tensors. Idempotent."""
    import importlib

    patch = importlib.import_module(VERL_PATCH_MODULE)
    current = patch._flash_attention_forward
    if not hasattr(current, "__verl_stable_original__"):
        # patch: varlen_attention (verl_stable.compat.catalogue)
        patch._flash_attention_forward = ulysses_kernel(current)
    return [f"ulysses_kernel:{ATTN_IMPLEMENTATION}"]


def register() -> list[str]:
    """The CPU runtime's attention step: only where the CPU platform is selected; waits for each module's import.

    Returns:
        What was registered, or will be on the import of its module.
    """
    if not cpu_selected():
        return []
    from verl_stable.compat.import_hooks import when_imported

    done = []
    for module, callback in ((TRANSFORMERS_MODULE, register_attention), (VERL_PATCH_MODULE, install_ulysses_kernel)):
        hook = when_imported(module, callback, deferred_errors="log")
        done += hook.result if hook.fired else [f"{callback.__name__} (on import of {module})"]
    return done


# ---------------------------------------------------------------------------------------------------------------------
# Contracts: the verl / transformers interfaces the kernel is reached through, checked by name (``verl-stable doctor``).


def _ulysses_hook_point() -> str:
    import importlib

    patch = importlib.import_module(VERL_PATCH_MODULE)
    if not hasattr(patch, "_flash_attention_forward"):
        raise ContractError(f"{VERL_PATCH_MODULE}._flash_attention_forward (the kernel under Ulysses) missing")
    src = inspect.getsource(patch._ulysses_flash_attention_forward)
    if "_flash_attention_forward(" not in src or "gather_seq_scatter_heads" not in src:
        raise ContractError("verl's _ulysses_flash_attention_forward no longer calls _flash_attention_forward")
    src = inspect.getsource(patch.apply_monkey_patch)
    if "flash_attention._flash_attention_forward = _ulysses_flash_attention_forward" not in src:
        raise ContractError("apply_monkey_patch no longer patches transformers.integrations.flash_attention")
    return "apply_monkey_patch wraps flash_attention._flash_attention_forward around monkey_patch's kernel"


def _attention_interface() -> str:
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    for obj, attr in ((AttentionInterface, "register"), (ALL_MASK_ATTENTION_FUNCTIONS, "register")):
        if not callable(getattr(obj, attr, None)):
            raise ContractError(f"{obj!r}.{attr} missing")
    if not hasattr(flash_attention, "_flash_attention_forward"):
        raise ContractError("transformers.integrations.flash_attention._flash_attention_forward missing")
    return "AttentionInterface / mask interface registrable; flash-attention entry present"


CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "ulysses_hook_point", "verl's Ulysses wrapper calls monkey_patch._flash_attention_forward", _ulysses_hook_point
    ),
    Contract("attention_interface", "transformers' attention / mask interfaces and flash entry", _attention_interface),
)


def check_contracts(names: tuple[str, ...] | list[str] | None = None) -> list[ContractResult]:
    """Run the attention module's contracts (all by default); never raises."""
    return contracts.check(CONTRACTS, names)
