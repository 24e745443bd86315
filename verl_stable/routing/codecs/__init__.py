"""Engine-boundary codecs for routed experts: vLLM, SGLang and verl layouts in, validated compact rows out.

Every inference engine reports, per generated sequence, the top-k expert ids that each token was routed to in
each decoder layer. The formats differ in dtype, in which layers they cover and in which token rows they hold:

* vLLM 0.24 ``CompletionOutput.routed_experts``: uint8 (<= 256 experts) or uint16 numpy,
  ``[prompt_len - prompt_start + n_output - 1, num_hidden_layers, top_k]``. Dense layers are zero rows; the last
  sampled token was never fed through the model, so it has no row; ``SamplingParams.routed_experts_prompt_start``
  skips the first ``prompt_start`` prompt rows. The OpenAI endpoint returns the same array as base64 ``.npy``.
* SGLang 0.5.12 ``meta_info["routed_experts"]``: base64 of flat int32 (or the dtype named by
  ``meta_info["routed_experts_dtype"]`` on newer servers) covering token positions
  ``[routed_experts_start_len, seqlen - 1)`` for every decoder layer.
* verl 0.9.1 ``routed_experts``: int16 ``[prompt_len + response_len, num_hidden_layers, top_k]`` per sample
  (zero rows where nothing was recorded), stacked either left/right padded to a fixed width or as a jagged tensor.

All of them decode to :class:`RoutedRows`: the ids of the contiguous token positions ``[start, start + rows)``
for the MoE layers only (MoE-layer ordinal ``m`` is absolute decoder layer ``layout.moe_layers[m]``), stored in the
smallest unsigned dtype that holds ``num_experts - 1``. Positions outside ``[start, stop)`` have no recorded routing;
a replay uses the model's own routing there and counts them.

One module per concern, every name re-exported here (``from verl_stable.routing.codecs import X`` is the API):

* :mod:`.common`: :class:`RoutedRows`, id validation against a layout and the layout helpers all engines share
  (the error classes are defined in :mod:`verl_stable.routing.errors`, the layout-free checks in
  :mod:`verl_stable.routing.checks` and :mod:`verl_stable.routing.payload_checks`);
* :mod:`.vllm`, :mod:`.sglang`, :mod:`.verl`: one engine's decoders and (fixture) encoders each;
* :mod:`.rows`: partial-rollout joins and the token-aligned :class:`~verl_stable.routing.trace.RoutingTrace`;
* :mod:`.policy`: ``on_invalid`` (raise, or skip and count) around any decoder.

Nothing here imports verl, vLLM or SGLang.
"""

from verl_stable.routing.codecs.common import (
    DuplicateExpertError,
    ExpertIdRangeError,
    LayerMapError,
    RoutedRows,
    RoutingFormatError,
    RowCountError,
    ZeroRoutingError,
    smallest_uint_dtype,
    validate_ids,
    validate_rows,
)
from verl_stable.routing.codecs.policy import ON_INVALID, BoundaryStats, decode_with_policy
from verl_stable.routing.codecs.rows import concat_partial_rollout, rows_to_trace, trace_to_rows
from verl_stable.routing.codecs.sglang import decode_sglang, encode_sglang
from verl_stable.routing.codecs.verl import decode_verl_batch, decode_verl_sample, encode_verl_batch, encode_verl_sample
from verl_stable.routing.codecs.vllm import decode_vllm, decode_vllm_openai, encode_vllm

__all__ = [
    "BoundaryStats",
    "decode_with_policy",
    "rows_to_trace",
    "trace_to_rows",
    "DuplicateExpertError",
    "ExpertIdRangeError",
    "LayerMapError",
    "ON_INVALID",
    "RoutedRows",
    "RoutingFormatError",
    "RowCountError",
    "ZeroRoutingError",
    "concat_partial_rollout",
    "decode_sglang",
    "decode_verl_sample",
    "decode_verl_batch",
    "decode_vllm",
    "decode_vllm_openai",
    "encode_sglang",
    "encode_verl_batch",
    "encode_verl_sample",
    "encode_vllm",
    "smallest_uint_dtype",
    "validate_ids",
    "validate_rows",
]
