"""Weight sync into the ``hf`` rollout model: vLLM-style weight names -> the Hugging Face model's (fused) parameters.

verl's weight sync hands the rollout unfused MoE experts under vLLM names (``...mlp.experts.{e}.gate_proj.weight``);
transformers 5 keeps them fused as ``gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I].
:class:`WeightLoader` writes each incoming tensor into its slice of the fused parameter, re-quantising its rows (fp8,
fp8_w8a8, int4) and re-adding the fixed inference-only router perturbation when one is configured.
"""

from __future__ import annotations

import re

import torch

from verl_stable.backends.hf.precision import (
    QUANTISED,
    canonical_precision,
    fp8_weight_names,
    is_router_weight,
    quantize_weight,
    router_perturbation,
)

EXPERT_NAME_RE = re.compile(
    r"^(?P<base>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
"""An unfused expert weight as verl sends it: ``<base>.mlp.experts.<e>.{gate,up,down}_proj.weight``."""


class WeightLoader:
    """Writes streamed ``(name, tensor)`` pairs into a HF model, re-packing unfused MoE experts.

    Each slice is written in place, so no expert buffering is needed; fp8 re-quantises per output row, and the rows
    of a gate/up slice are rows of the fused ``gate_up_proj``, so quantising a slice equals quantising the fused
    tensor.
    """

    def __init__(self, model: torch.nn.Module, precision: str, router_noise: float = 0.0) -> None:
        self.params = dict(model.named_parameters())
        self.params.update(dict(model.named_buffers()))
        self.precision = canonical_precision(precision)
        self.fp8_names = set(fp8_weight_names(model)) if self.precision in QUANTISED else set()
        self.router_noise = float(router_noise)
        self.loaded: set[str] = set()

    def target(self, name: str) -> tuple[str, tuple]:
        """(model parameter name, index into it) for an incoming weight name. Raises KeyError if unknown."""
        if name in self.params:
            return name, ()
        m = EXPERT_NAME_RE.match(name)
        if m:
            base, expert, proj = m["base"], int(m["expert"]), m["proj"]
            if proj == "down_proj":
                fused = f"{base}.down_proj"
                if fused in self.params:
                    return fused, (expert,)
            else:
                fused = f"{base}.gate_up_proj"
                if fused in self.params:
                    half = self.params[fused].shape[-2] // 2
                    rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
                    return fused, (expert, rows)
        raise KeyError(f"weight {name!r} has no counterpart in the rollout model (hf backend weight-name contract)")

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` into the model parameter (or slice) that ``name`` stands for.

        Raises:
            KeyError: ``name`` has no counterpart in the model.
            ValueError: the shapes differ.
        """
        target_name, index = self.target(name)
        dst = self.params[target_name][index] if index else self.params[target_name]
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} -> {target_name}{list(index)}: shape {tuple(tensor.shape)} != {tuple(dst.shape)}"
            )
        value = tensor.detach().to(device=dst.device)
        if target_name in self.fp8_names:
            value = quantize_weight(value, self.precision, dst.dtype)
        if self.router_noise and is_router_weight(target_name):
            value = value.float() + router_perturbation(target_name, value, self.router_noise).float()
        dst.copy_(value.to(dst.dtype))
        self.loaded.add(target_name)
