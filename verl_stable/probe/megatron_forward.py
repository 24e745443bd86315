"""The training side of the probe on verl's Megatron path: verl's Megatron model on the sampled tokens, without replay
and with R3 replay of the rollout's routing by verl's own router replay (``--train-engine megatron``).

The same contract as :class:`~verl_stable.probe.training.TrainingForward` (per rollout a
:class:`~verl_stable.probe.training.Scored`), computed as verl's Megatron engine computes it, at world size one, inside
the Megatron CPU runtime (:func:`~verl_stable.cpu.megatron.runtime.megatron_cpu_runtime`, a gloo world of one rank):

* the model: ``AutoBridge.from_config`` of ``verl.models.mcore.mbridge`` (verl's ``vanilla_mbridge`` path, with the
  local-spec bridges of :mod:`verl_stable.cpu.megatron.bridge`: Qwen3 and Qwen3-MoE), ``set_extra_args`` with the CPU
  actor's ``override_transformer_config`` (:data:`verl_stable.cpu.megatron.options.TRANSFORMER_CONFIG`), routing
  replay enabled on the config as verl's engine enables it, ``make_megatron_module`` and ``bridge.load_weights``;
* the dtype: verl's Megatron engine has no autocast; ``actor.megatron.dtype`` (verl's default ``bfloat16``) is the
  parameter dtype: the bridge builds the model in it, ``TransformerConfig.bf16`` is set and ``make_megatron_module``
  wraps it in megatron's ``Float16Module`` (bf16 parameters and activations, the logits upcast to fp32 on output).
  ``--train-dtype bf16`` is that; ``fp32`` is ``actor.megatron.dtype=float32`` (no wrapper), the lab's actor;
* the forward: one sequence (prompt + response) per call through verl's ``gptmodel_forward_model_engine`` (packed
  THD, ``use_remove_padding``), ``log pi(y_t)`` by verl's ``vocab_parallel_log_probs_from_logits`` on the fp32 logits
  at ``P + t - 1`` (verl's logits processor at temperature 1);
* routing, per pass, read from each router's output (its ``routing_map``: the experts the dispatcher sends each row
  to): without replay the routers' own choice; with R3 the rollout's routes aligned by verl's
  ``align_r3_router_replay_data``, masked by ``build_r3_replay_mask`` (the last row stays native: it feeds no
  log-prob) and set on the routers by ``set_router_replay_data`` under ``REPLAY_FORWARD``, exactly the calls of verl's
  ``forward_step``. The router's own choice under replay (what it hides) is the top-k verl's routing function
  computes on the same scores for its replay mask (:class:`~verl_stable.integration.megatron_audit.NativeChoiceTap`).

Needs megatron-core and mbridge, and a model type with a local-spec bridge
(:func:`verl_stable.probe.checks.check_train_engine` refuses otherwise). The model runs on the host whatever
``--device`` says (the Megatron CPU runtime). Open it as a context manager, or call :meth:`MegatronForward.close`: it
holds the runtime, the process group and verl's replay patch until then.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_stable.probe.checks import check_train_engine
from verl_stable.probe.inference import Rollout
from verl_stable.probe.training import TRAIN_DTYPES, Scored

if TYPE_CHECKING:
    from verl_stable.routing import RoutingLayout

__all__ = ["MEGATRON_DTYPES", "MegatronForward"]

MEGATRON_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
"""``--train-dtype`` -> verl's ``actor.megatron.dtype`` (verl's default: ``bfloat16``)."""


@contextlib.contextmanager
def _world_of_one(seed: int) -> Iterator[None]:
    """torch.distributed (gloo, one rank) and megatron's parallel groups, seeded as verl's engine seeds them."""
    import torch.distributed as dist

    from verl_stable.cpu.megatron.world import gloo_megatron_world

    if dist.is_initialized():
        raise RuntimeError("--train-engine megatron needs its own process group; torch.distributed is initialised")
    with tempfile.TemporaryDirectory(prefix="verl_stable_probe_") as tmp:
        with gloo_megatron_world(0, 1, f"{tmp}/store", seed=seed):
            yield


def _routed_ids(routing_map: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[rows, experts]`` bool -> ``[rows, top_k]`` expert ids, ascending; ``-1`` where a row has fewer experts."""
    ranked = torch.sort(routing_map.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :top_k]
    return torch.where(routing_map.gather(1, ranked), ranked, -1).sort(dim=-1).values.cpu()


class MegatronForward:
    """verl's Megatron actor forward on rollouts (module docstring).

    Args:
        model_dir: the Hugging Face checkpoint.
        train_dtype: a key of :data:`MEGATRON_DTYPES`.
        model_type: its ``model_type`` (refused without a local-spec bridge).
        layout: its routing layout (None: a dense model, nothing captured or replayed).
        seed: megatron's RNG seed (nothing random runs in a forward without dropout).

    Raises:
        ProbeInputError: megatron-core / mbridge not importable, or no local-spec bridge for ``model_type``.
    """

    def __init__(
        self, model_dir: str | Path, train_dtype: str, model_type: str, layout: RoutingLayout | None, seed: int = 0
    ) -> None:
        if train_dtype not in MEGATRON_DTYPES:
            raise ValueError(f"train_dtype must be one of {sorted(MEGATRON_DTYPES)}, got {train_dtype!r}")
        check_train_engine("megatron", model_type)
        self.layout = layout
        self._stack = contextlib.ExitStack()
        try:
            self._open(str(model_dir), train_dtype, seed)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, model_dir: str, train_dtype: str, seed: int) -> None:
        from verl_stable.cpu.megatron.runtime import megatron_cpu_runtime
        from verl_stable.integration.megatron_replay_patch import verl_router_replay_patch

        self._stack.enter_context(warnings.catch_warnings())
        # megatron-core and mbridge announce their fallbacks from Transformer Engine / apex and deprecated config
        # defaults; none is about what the probe measures
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)\.")
        self._stack.enter_context(megatron_cpu_runtime())
        self._stack.enter_context(_world_of_one(seed))
        self._replay = self._stack.enter_context(verl_router_replay_patch()) if self.layout is not None else None
        self.module, self.tf_config = _build(model_dir, train_dtype, replay=self._replay is not None)

    def close(self) -> None:
        """Release the model, verl's replay patch, the process group and the runtime (idempotent)."""
        self.module = None
        self._stack.close()

    def __enter__(self) -> MegatronForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.no_grad()
    def score(self, rollout: Rollout, replay: bool = False) -> Scored:
        """``log pi`` of the rollout's sampled tokens and the routing of the pass; ``replay``: R3 with its routing.

        Raises:
            ValueError: ``replay`` for a rollout without routing (a dense model, an engine without export).
        """
        from verl.models.mcore.model_forward import gptmodel_forward_model_engine
        from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits

        if replay and (rollout.routing is None or self.layout is None):
            raise ValueError("R3 replay needs the rollout's routed experts; this rollout has none")
        tokens = torch.tensor(list(rollout.prompt_ids) + list(rollout.response_ids), dtype=torch.long)
        prompt_len = len(rollout.prompt_ids)
        nested = torch.nested.nested_tensor([tokens], layout=torch.jagged)
        with self._routing(rollout, nested, replay) as (natural, used):
            logits = gptmodel_forward_model_engine(self.module, nested, multi_modal_inputs={}, data_format="thd")
        logits = logits.unbind()[0].float()
        logp = vocab_parallel_log_probs_from_logits(logits[prompt_len - 1 : -1], tokens[prompt_len:]).cpu()
        if self.layout is None:
            return Scored(logp, None, None)
        return Scored(logp, self._trace(natural, len(tokens)), self._trace(used, len(tokens)))

    def _trace(self, per_layer: dict[int, torch.Tensor], num_tokens: int) -> torch.Tensor:
        """``{MoE ordinal: [rows, top_k]}`` -> ``[num_tokens, moe_layers, top_k]`` int64 (the packed rows are the
        sequence's tokens at world size one: no padding)."""
        layers = [per_layer[i] for i in range(len(self.layout.moe_layers))]
        if any(ids.shape[0] != num_tokens for ids in layers):
            raise RuntimeError(f"routers saw {[ids.shape[0] for ids in layers]} rows for {num_tokens} tokens")
        return torch.stack(layers, dim=1).to(torch.long)

    @contextlib.contextmanager
    def _routing(
        self, rollout: Rollout, nested: torch.Tensor, replay: bool
    ) -> Iterator[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]]:
        """``(natural, used)``: per MoE ordinal the router's own choice and the experts used, filled by the forward;
        under ``replay`` the rollout's routes set on the routers as verl's ``forward_step`` sets them."""
        natural: dict[int, torch.Tensor] = {}
        used: dict[int, torch.Tensor] = {}
        if self.layout is None:
            yield natural, used
            return
        from verl.utils.megatron.router_replay_patch import RouterReplayAction
        from verl.utils.megatron.router_replay_utils import (
            align_r3_router_replay_data,
            build_r3_replay_mask,
            iter_model_routers,
            set_router_replay_data,
        )

        from verl_stable.integration.megatron_audit import NativeChoiceTap

        ordinal = {layer + 1: i for i, layer in enumerate(self.layout.moe_layers)}  # router layer_number is 1-based
        top_k = self.layout.top_k
        native: dict[int, torch.Tensor] = {}
        handles: list[Any] = []

        def hook(router: Any, args: Any, output: Any) -> None:
            ids = _routed_ids(output[1], top_k)
            used[ordinal[router.layer_number]] = ids
            own = native.pop(id(router.router_replay), None)
            natural[ordinal[router.layer_number]] = ids if own is None else own.sort(dim=-1).values.cpu()

        from megatron.core.transformer.moe.router import TopKRouter

        routers = [
            m for m in self._gpt().decoder.modules() if isinstance(m, TopKRouter) and m.router_replay is not None
        ]
        try:
            for router in routers:
                handles.append(router.register_forward_hook(hook))
                handles.append(NativeChoiceTap(router.router_replay, native))
            if replay:
                routes = torch.as_tensor(rollout.routing, dtype=torch.long)  # [P + R - 1, moe_layers, top_k]
                targets = align_r3_router_replay_data(
                    torch.nested.as_nested_tensor([routes], layout=torch.jagged), nested
                )
                mask = build_r3_replay_mask(nested, torch.ones(1, len(rollout.response_ids), dtype=torch.long))
                for _, replayer in iter_model_routers(self._gpt()):
                    replayer.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                set_router_replay_data(targets, None, self.tf_config, 0, replay_mask=mask, model=self._gpt())
            yield natural, used
        finally:
            for handle in handles:
                handle.remove()
            for _, replayer in iter_model_routers(self._gpt()):
                replayer.clear_router_replay_action()
                # a forward-only pass never pops the targets its backward would replay: drop them with the targets
                replayer.target_topk_idx = replayer.target_replay_mask = None
                replayer.replay_backward_list.clear()
                replayer.replay_backward_mask_list.clear()

    def _gpt(self) -> Any:
        """The ``GPTModel`` inside megatron's ``Float16Module`` (bf16), or the model itself (fp32)."""
        from verl.utils.megatron_utils import unwrap_model

        return unwrap_model(self.module)


def _build(model_dir: str, train_dtype: str, replay: bool) -> tuple[Any, Any]:
    """verl's Megatron model of ``model_dir`` with its weights (module docstring), and its ``TransformerConfig``."""
    from transformers import AutoConfig
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module, mapping_string_to_attn_backend

    from verl_stable.cpu.megatron.bridge import local_spec_bridges
    from verl_stable.cpu.megatron.options import TRANSFORMER_CONFIG

    dtype = TRAIN_DTYPES[train_dtype]
    hf_config = AutoConfig.from_pretrained(model_dir)
    with local_spec_bridges():
        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    bridge.set_extra_args(**mapping_string_to_attn_backend(dict(TRANSFORMER_CONFIG)))
    tf_config = bridge.config
    tf_config.fp16 = False
    tf_config.bf16 = dtype == torch.bfloat16
    if replay:  # as verl's engine enables it (megatron-core's flag where it has one)
        name = (
            "moe_enable_routing_replay" if hasattr(tf_config, "moe_enable_routing_replay") else "enable_routing_replay"
        )
        setattr(tf_config, name, True)
    with contextlib.redirect_stdout(io.StringIO()):  # megatron prints the parameter count: not the probe's output
        model, _ = make_megatron_module(
            McoreModuleWrapperConfig(wrap_with_ddp=False), tf_config=tf_config, hf_config=hf_config, bridge=bridge
        )
    bridge.load_weights(model, model_dir)
    return model[0].eval(), tf_config
