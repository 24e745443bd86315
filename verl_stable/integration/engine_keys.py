"""Selecting a verl-stable engine class for one of verl's ``EngineRegistry`` keys, never taking another's key.

verl's ``EngineRegistry.get_engine_cls`` looks up ``(device, vendor)`` before the device-only key where verl registers
its own engines, so a subclass registered for ``(device, vendor)`` is selected without replacing verl's registration.
The FSDP replay engine (:mod:`.fsdp_engine`) and the Megatron replay-metrics engine (:mod:`.megatron_replay`) both
register that way.
"""

from __future__ import annotations


def hold_engine_key(model_type: str, backend: str, key: tuple[str, str], cls: type, purpose: str) -> str:
    """Register ``cls`` for ``(model_type, backend, key)`` unless it holds that key already (idempotent).

    Args:
        model_type: verl's model type (``language_model``).
        backend: verl's engine backend (``fsdp``, ``megatron`` ...).
        key: ``(device, vendor)``.
        cls: the engine class.
        purpose: what ``cls`` brings, for the error message.

    Returns:
        ``engine:<model_type>/<backend>/<device>:<vendor>``.

    Raises:
        RuntimeError: another class already holds the key.
    """
    from verl.workers.engine.base import EngineRegistry

    existing = EngineRegistry._engines.get(model_type, {}).get(backend, {}).get(key)
    if existing is None:
        EngineRegistry.register(model_type=model_type, backend=backend, device=key[0], vendor=key[1])(cls)
    elif existing is not cls:
        raise RuntimeError(
            f"engine key ({model_type}, {backend}, {key}) is already held by {existing.__module__}."
            f"{existing.__qualname__}; {purpose} cannot be installed"
        )
    return f"engine:{model_type}/{backend}/{key[0]}:{key[1]}"
