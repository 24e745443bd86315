"""The compat catalogue lists every patch and every overridden private verl method, and the doctor checks them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import verl_stable
from verl_stable.compat import catalogue as C
from verl_stable.compat import catalogue_check as K
from verl_stable.compat import catalogue_overrides as O

PACKAGE = Path(verl_stable.__file__).parent
MARKER = re.compile(r"^\s*# patch: (\w+) \(verl_stable\.compat\.catalogue\)$", re.M)


def _markers() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for name in MARKER.findall(path.read_text()):
            assert name not in found, f"marker {name} twice: {found[name]} and {module}"
            found[name] = module
    return found


def test_every_patch_site_is_catalogued_and_every_entry_has_its_site():
    markers = _markers()
    catalogued = {p.name: p.applied_in for p in C.PATCHES}
    assert len(catalogued) == len(C.PATCHES), "duplicate patch names"
    assert markers == catalogued


def _stable_classes() -> list[type]:
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_stable.integration import trainer  # noqa: F401 - registers the stable_* trainers
    from verl_stable.integration.rollout import agent_loop
    from verl_stable.toy import interactions

    modes = ("stable_sync", "stable_colocate_async", "stable_separate_async")
    return [
        *(get_trainer_cls(m) for m in modes),
        agent_loop.CompactRoutingAgentLoopWorkerTQ,
        agent_loop.CompactRoutingAgentLoopManagerTQ,
        interactions._loop_class(),
    ]


def test_every_private_verl_method_we_override_is_catalogued():
    """Walk our subclasses of verl classes: a private method defined by us and by a verl base must be listed."""
    listed = {(o.base, o.method) for o in O.OVERRIDES}
    seen = set()
    for cls in _stable_classes():
        ours = [k for k in cls.__mro__ if k.__module__.startswith("verl_stable")]
        theirs = [k for k in cls.__mro__ if not k.__module__.startswith(("verl_stable", "builtins", "abc"))]
        for klass in ours:
            for name in vars(klass):
                if not name.startswith("_") or name.startswith(("__", "_stable")) or name == "_abc_impl":
                    continue
                base = next((b for b in theirs if name in vars(b)), None)
                if base is not None:
                    seen.add((f"{base.__module__}.{base.__qualname__}", name))
    assert seen, "no override found: the walk itself is broken"
    assert seen <= listed, f"not in the catalogue: {sorted(seen - listed)}"


def test_every_catalogued_override_is_defined_by_its_owner():
    for override in O.OVERRIDES:
        module, _, cls = override.owner.rpartition(".")
        source = (PACKAGE.parent / (module.replace(".", "/") + ".py")).read_text()
        assert re.search(rf"class {cls}\b", source), override.owner
        assert re.search(rf"def {override.method}\(", source), (override.owner, override.method)


def test_the_installed_packages_meet_the_catalogue():
    results = K.check()
    assert len(results) == len(C.PATCHES) + len(O.OVERRIDES)
    assert [r for r in results if not r.ok] == []


def test_a_changed_signature_or_a_missing_target_is_reported_by_name(monkeypatch):
    override = O.OVERRIDES[0]
    resigned = O.Override(override.base, override.method, (*override.params, "extra"), "x", "y", "z")
    gone = C.Patch("gone", "verl.trainer.ppo.v1.trainer_base.PPOTrainer._no_such_method", "process", "m", "w", "r")
    monkeypatch.setattr(O, "OVERRIDES", (resigned,))
    monkeypatch.setattr(C, "PATCHES", (gone,))
    by_name = {r.name: r for r in K.check()}
    assert not by_name["patch:gone"].ok and "_no_such_method" in by_name["patch:gone"].detail
    bad = by_name[f"override:{override.method}"]
    assert not bad.ok and "now takes" in bad.detail and "extra" in bad.detail


def test_an_uninstalled_requirement_is_not_checked(monkeypatch):
    patch = C.Patch("absent", "no_such_package.thing", "process", "m", "w", "r", requires="no-such-distribution")
    monkeypatch.setattr(C, "PATCHES", (patch,))
    monkeypatch.setattr(O, "OVERRIDES", ())
    (result,) = K.check()
    assert result.ok and "not installed" in result.detail


def test_resolve_names_what_is_missing():
    with pytest.raises(AttributeError):
        K.resolve("verl.workers.engine.base.EngineRegistry.no_such")
    with pytest.raises(ImportError):
        K.resolve("no_such_top_level_package.x")
