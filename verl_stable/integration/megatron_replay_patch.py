"""verl's Megatron router replay for one block: ``apply_router_replay_patch`` applied, megatron-core's classes restored.

verl 0.9.1 replays MoE routing on Megatron through ``verl.utils.megatron.router_replay_patch.apply_router_replay_patch``:
every ``TopKRouter`` built afterwards from a config with routing replay enabled holds a verl ``RouterReplay`` that
records, replays or partly replays (``replay_mask``) top-k expert choices. verl's Megatron engine applies it once in
its constructor and never removes it; it replaces ``TopKRouter.__init__`` / ``routing``, ``TransformerConfig.__init__``
(and its ``__signature__``) and ``MoEAlltoAllTokenDispatcher.preprocess`` for the rest of the process.

A process that builds verl's Megatron model outside verl's engine -- the probe's Megatron training side
(:mod:`verl_stable.probe.megatron_forward`), the router-replay tests -- needs that same replay for a span only:
:func:`verl_router_replay_patch` applies verl's function and, on exit, puts back every attribute it may have set (an
attribute that was not in a class's own ``__dict__`` is deleted again) and clears verl's global router list. Models
built inside keep their ``RouterReplay`` objects after the block; new ones are built without.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["PATCHED_ATTRIBUTES", "verl_router_replay_patch"]

_MISSING = object()

PATCHED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "megatron.core.transformer.moe.router.TopKRouter": (
        "__init__",
        "routing",
        "_hash_routing",
        "_router_replay_patched",
    ),
    "megatron.core.transformer.transformer_config.TransformerConfig": ("__init__", "_verl_router_patched"),
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher": ("preprocess", "_preprocess_patched"),
}
"""The class attributes verl 0.9.1's ``apply_router_replay_patch`` sets (by class path), all restored on exit."""


def _resolve(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def verl_router_replay_patch() -> Iterator[type]:
    """verl's ``apply_router_replay_patch()`` for the block (it has no undo): megatron-core's classes restored after.

    Yields:
        verl's ``RouterReplay`` class (its ``router_instances`` list is cleared on exit).
    """
    from megatron.core.transformer.moe import router as router_module
    from verl.utils.megatron import router_replay_patch as verl_patch

    classes = {path: _resolve(path) for path in PATCHED_ATTRIBUTES}
    saved = [
        (cls, name, vars(cls).get(name, _MISSING)) for path, cls in classes.items() for name in PATCHED_ATTRIBUTES[path]
    ]
    module_replay = vars(router_module).get("RouterReplay", _MISSING)  # verl's DeepSeek-V4 branch rebinds it
    config_init = classes["megatron.core.transformer.transformer_config.TransformerConfig"].__init__
    signature = vars(config_init).get("__signature__", _MISSING)  # verl sets it on the original function
    with contextlib.redirect_stdout(None):  # "Applying Router Replay Patch..."
        # patch: megatron_router_replay_block (verl_stable.compat.catalogue)
        verl_patch.apply_router_replay_patch()
    try:
        yield verl_patch.RouterReplay
    finally:
        for cls, name, value in saved:
            if value is _MISSING:
                if name in vars(cls):
                    delattr(cls, name)
            else:
                setattr(cls, name, value)
        if module_replay is _MISSING:
            vars(router_module).pop("RouterReplay", None)
        else:
            router_module.RouterReplay = module_replay
        if signature is _MISSING:
            vars(config_init).pop("__signature__", None)
        else:
            config_init.__signature__ = signature
        verl_patch.RouterReplay.router_instances.clear()
