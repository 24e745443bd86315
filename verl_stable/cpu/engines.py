"""verl's FSDP training engines, registered for device ``"cpu"``.

verl 0.9.1 registers ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` for ``cuda`` and ``npu`` only; torch FSDP2
(``fully_shard``) works on CPU with gloo, so the same classes serve the CPU platform. Registration goes through the
public ``EngineRegistry.register`` decorator, which refuses duplicate keys, so an existing ``cpu`` entry (ours from an
earlier call, or someone else's engine) is left alone.
"""

from __future__ import annotations

from verl_stable.cpu.platform import cpu_selected

DEVICE = "cpu"
BACKENDS = ("fsdp", "fsdp2")
# model_type -> class name in verl.workers.engine.fsdp.transformer_impl
ENGINES = {"language_model": "FSDPEngineWithLMHead", "value_model": "FSDPEngineWithValueHead"}


def register(force: bool = False) -> list[str]:
    """Register the FSDP engines for device cpu (idempotent).

    Only done in processes that selected the CPU platform (importing the engine module is slow and useless
    elsewhere), unless ``force``.
    """
    if not (force or cpu_selected()):
        return []
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    done = []
    for model_type, class_name in ENGINES.items():
        engine_cls = getattr(transformer_impl, class_name)
        table = EngineRegistry._engines.get(model_type, {})
        missing = [b for b in BACKENDS if DEVICE not in table.get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device=DEVICE)(engine_cls)
        done += [f"engine:{model_type}/{b}/{DEVICE}" for b in BACKENDS]
    return done
