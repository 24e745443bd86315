"""Registration into verl does not depend on which module a process imports first, and fails loudly where it matters.

Each case runs in a fresh interpreter: what is registered is decided once per process, by the first import.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# After the first import: load verl's engines (as a worker does) and report what the plugin registered.
_REPORT = """
from verl.workers.engine import EngineRegistry
from verl.trainer.ppo import core_algos
plugin = sys.modules["verl_stable.integration.plugin"]  # the instance verl loaded; importing it again reruns nothing
engines = EngineRegistry._engines["language_model"]
print(json.dumps({
    "steps": {name: plugin.STATUS[name].ok if name in plugin.STATUS else None for name, _ in plugin.REGISTRATION_STEPS},
    "errors": {name: st.error.strip().splitlines()[-1] for name, st in plugin.STATUS.items() if st.error},
    "engines": {b: getattr(engines[b].get(("cpu", "cpu")), "__name__", None) for b in ("fsdp", "fsdp2")},
    "losses": sorted({"minirl", "vespo"} & set(core_algos.POLICY_LOSS_REGISTRY)),
}))
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "first",
    [
        "verl_stable.integration.losses",  # imports verl at its top: verl's plugin ran while it was half-initialised
        "verl_stable.integration.advantages",
        "verl_stable.integration.fsdp_engine",
        "verl_stable.integration.plugin",
        "verl",
    ],
)
def test_every_step_registers_whatever_module_is_imported_first(first):
    proc = _run(f"import json, sys\nimport {first}\n{_REPORT}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}
    assert all(report["steps"].values()), report["steps"]
    assert report["engines"] == {"fsdp": "FSDPEngineWithLMHeadReplay", "fsdp2": "FSDPEngineWithLMHeadReplay"}
    assert report["losses"] == ["minirl", "vespo"]


# The replay engine's step fails at plugin time (its module cannot be imported: a real ImportError, injected by
# blocking one of our modules, verl untouched); then a worker asks verl's registry for an FSDP engine.
_FAILED_STEP = """
import sys
sys.modules["verl_stable.integration.fsdp_replay"] = None  # `import` of it now raises ImportError
import {first}
from verl.workers.config import FSDPEngineConfig
from verl.workers.config.engine import EngineRouterReplayConfig
from verl.workers.engine import EngineRegistry

def new(router_replay):
    try:
        EngineRegistry.new(
            model_type="language_model", backend="{backend}", model_config=None,
            engine_config=FSDPEngineConfig(strategy="{backend}", router_replay=router_replay),
            optimizer_config=None, checkpoint_config=None,
        )
    except Exception as exc:
        return f"{{type(exc).__name__}}: {{exc}}"
    return "built"

print(repr(new(EngineRouterReplayConfig(mode="{mode}"))))
print(repr(new(EngineRouterReplayConfig(mode="disabled"))))
"""


@pytest.mark.parametrize(
    ("first", "backend", "mode"),
    [
        ("verl", "fsdp", "R3"),
        ("verl_stable.integration.losses", "fsdp2", "R2"),
        ("verl_stable.integration.plugin", "fsdp", "R2"),
    ],
)
def test_replay_requested_after_a_failed_registration_raises_naming_the_step(first, backend, mode):
    proc = _run(_FAILED_STEP.format(first=first, backend=backend, mode=mode))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registration step 'fsdp_router_replay' (verl_stable.integration.fsdp_engine) failed" in proc.stderr
    with_replay, without_replay = (eval(line) for line in proc.stdout.strip().splitlines()[-2:])  # noqa: S307
    assert with_replay.startswith("ReplayEngineUnavailableError: "), with_replay
    assert f"router_replay.mode={mode}" in with_replay
    assert "plugin step 'fsdp_router_replay' (verl_stable.integration.fsdp_engine) failed" in with_replay
    assert "verl_stable.integration.fsdp_replay" in with_replay  # the cause, not just "something failed"
    # Without replay, verl's own engine is built as before (it fails on the None configs of this test, in verl).
    assert "fsdp_router_replay" not in without_replay and without_replay != "built"


def test_the_guard_covers_the_engines_the_replay_step_registers():
    # plugin.py mirrors these instead of importing fsdp_engine, whose import is one of the failures it guards against
    from verl_stable.integration import fsdp_engine, plugin

    assert plugin.REPLAY_MODEL_TYPE == fsdp_engine.MODEL_TYPE
    assert plugin.REPLAY_BACKENDS == fsdp_engine.BACKENDS
    assert dict(plugin.REGISTRATION_STEPS)[plugin.REPLAY_STEP] == fsdp_engine.__name__
    assert issubclass(plugin.ReplayEngineUnavailableError, RuntimeError)
