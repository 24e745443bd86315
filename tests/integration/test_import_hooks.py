"""``when_imported``: the one mechanism by which plugin steps register into verl once verl imports a module."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from verl_stable.compat import import_hooks
from verl_stable.compat.import_hooks import hooks_restored, pending_hooks, when_imported

FAKE = "vs_fake_engines"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A fake package on ``sys.path``; pending hooks, the finder and ``sys.modules`` restored afterwards."""
    package = tmp_path / FAKE
    package.mkdir()
    (package / "__init__.py").write_text("LOADED = True\n")
    (package / "sub.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with hooks_restored():
        try:
            yield package
        finally:
            for name in [n for n in sys.modules if n == FAKE or n.startswith(f"{FAKE}.") or n == "vs_virtual"]:
                del sys.modules[name]


def _module_attr(name: str, attr: str):
    return lambda: getattr(sys.modules[name], attr)


def test_runs_at_once_when_the_module_is_already_imported():
    calls = []
    hook = when_imported("json", lambda: calls.append("ran") or ["registered"])
    assert hook.fired and hook.result == ["registered"] and calls == ["ran"]
    assert not hook.pending and pending_hooks("json") == []
    with pytest.raises(RuntimeError, match="boom"):  # at once, the error is the caller's
        when_imported("json", lambda: (_ for _ in ()).throw(RuntimeError("boom")))


def test_runs_right_after_the_first_import_and_leaves_no_trace():
    finders = list(sys.meta_path)
    hook = when_imported(FAKE, _module_attr(FAKE, "LOADED"))
    assert hook.pending and not hook.fired and import_hooks.finder_installed()
    import vs_fake_engines

    assert hook.fired and hook.result is True and hook.error is None and pending_hooks(FAKE) == []
    assert [f for f in sys.meta_path if f is not import_hooks._FINDER] == [
        f for f in finders if f is not import_hooks._FINDER
    ]  # nothing else was added or left behind
    # the module keeps its own loader: reload, resources and inspection see no wrapper
    assert isinstance(vs_fake_engines.__loader__, importlib.machinery.SourceFileLoader)
    assert vs_fake_engines.__spec__.loader is vs_fake_engines.__loader__


def test_the_finder_leaves_sys_meta_path_with_the_last_pending_hook():
    with hooks_restored():
        for hook in pending_hooks():  # e.g. the trainer step waiting for verl's V1 package in this process
            hook.uninstall()
        assert not import_hooks.finder_installed()
        hook = when_imported(FAKE, _module_attr(FAKE, "LOADED"))
        assert import_hooks.finder_installed()
        import vs_fake_engines  # noqa: F401

        assert hook.fired and not import_hooks.finder_installed()


def test_a_submodule_target_fires_after_its_own_code():
    hook = when_imported(f"{FAKE}.sub", _module_attr(f"{FAKE}.sub", "VALUE"))
    import vs_fake_engines  # noqa: F401 - the parent alone does not fire it

    assert not hook.fired
    import vs_fake_engines.sub  # noqa: F401

    assert hook.fired and hook.result == 3


def test_idempotent_while_pending_and_callbacks_run_in_registration_order():
    order = []

    def first():
        order.append("first")

    assert when_imported(FAKE, first) is when_imported(FAKE, first)
    when_imported(FAKE, lambda: order.append("second"))
    assert len(pending_hooks(FAKE)) == 2
    import vs_fake_engines  # noqa: F401

    assert order == ["first", "second"]
    when_imported(FAKE, first)  # imported now: runs again, so the callback itself must be idempotent
    assert order == ["first", "second", "first"]


def test_uninstall_and_context_manager_cancel_a_pending_hook():
    calls = []
    with when_imported(FAKE, lambda: calls.append(1)) as hook:
        assert hook.pending
    assert not hook.pending and pending_hooks(FAKE) == []
    other = when_imported(FAKE, lambda: calls.append(2))
    other.uninstall()
    other.uninstall()  # no-op the second time
    import vs_fake_engines  # noqa: F401

    assert calls == [] and not hook.fired and not other.fired


def test_hooks_restored_puts_back_pending_hooks_and_the_finder():
    kept = when_imported(FAKE, lambda: None)
    with hooks_restored():
        kept.uninstall()
        when_imported(f"{FAKE}.other", lambda: None)
        assert pending_hooks(FAKE) == []
    assert pending_hooks(FAKE) == [kept] and pending_hooks(f"{FAKE}.other") == []
    assert import_hooks.finder_installed()


def test_a_deferred_error_fails_the_import_by_default_after_running_every_hook():
    ran = []

    def broken():
        raise RuntimeError("engine key already held")

    failing = when_imported(FAKE, broken)
    when_imported(FAKE, lambda: ran.append("after"))
    with pytest.raises(RuntimeError, match="engine key already held"):
        import vs_fake_engines  # noqa: F401
    assert failing.fired and isinstance(failing.error, RuntimeError) and ran == ["after"]


def test_a_deferred_error_is_only_logged_when_asked(caplog):
    def broken():
        raise RuntimeError("registry changed")

    hook = when_imported(FAKE, broken, deferred_errors="log")
    with caplog.at_level(logging.WARNING, logger="verl_stable"):
        import vs_fake_engines

    assert vs_fake_engines.LOADED and isinstance(hook.error, RuntimeError)
    assert "registry changed" in caplog.text and f"after importing {FAKE}" in caplog.text


def test_a_failing_module_keeps_its_hook_for_the_next_successful_import(isolated: Path):
    (isolated / "__init__.py").write_text("raise ImportError('not yet')\n")
    hook = when_imported(FAKE, _module_attr(FAKE, "LOADED"))
    with pytest.raises(ImportError, match="not yet"):
        import vs_fake_engines  # noqa: F401
    assert hook.pending and not hook.fired
    (isolated / "__init__.py").write_text("LOADED = 'second try'\n")
    importlib.invalidate_caches()
    sys.modules.pop(FAKE, None)
    importlib.import_module(FAKE)
    assert hook.result == "second try"


class _VirtualFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a module from memory, as an editable-install or vendoring finder would: not found by ``PathFinder``."""

    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == "vs_virtual" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.ORIGIN = "virtual"


def test_the_module_is_found_by_the_other_finders_not_only_by_path(monkeypatch):
    virtual = _VirtualFinder()
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, virtual])
    hook = when_imported("vs_virtual", _module_attr("vs_virtual", "ORIGIN"))
    import vs_virtual

    assert hook.result == "virtual" and vs_virtual.__loader__ is virtual


def test_an_unknown_error_policy_is_refused():
    with pytest.raises(ValueError, match="deferred_errors must be 'raise' or 'log'"):
        when_imported(FAKE, lambda: None, deferred_errors="ignore")
