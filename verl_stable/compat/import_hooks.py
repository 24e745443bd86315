"""Run a callback right after a module is imported: how verl-stable registers into verl lazily.

verl loads the plugin (:mod:`verl_stable.integration.plugin`) in every process it starts, but most of what we
register subclasses verl classes whose modules are expensive to import (verl's engines fix the device at import
time, its V1 trainer package pulls in the whole trainer stack) and that only some processes ever import. A plugin
step therefore says "register when verl imports X"::

    hook = when_imported("verl.workers.engine", register_engine)
    if hook.fired:  # X was already imported: the callback ran now
        return hook.result

This module owns that mechanism and its state: the callbacks still waiting for their module (:func:`pending_hooks`)
and the single finder on ``sys.meta_path`` that serves all of them. The finder is there only while a callback is
waiting; it asks the rest of ``sys.meta_path`` for the module's spec and wraps the loader so that the callback runs
once the module's code has run, then hands the module its own loader back. Tests restore everything with
:func:`hooks_restored`, or remove one registration with :meth:`ImportHook.uninstall` (a hook is also a context
manager that uninstalls itself on exit).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal

logger = logging.getLogger("verl_stable")

DeferredErrors = Literal["raise", "log"]


class ImportHook:
    """One :func:`when_imported` registration: pending until its module is imported, then fired.

    Attributes:
        module_name: the module whose import runs the callback.
        callback: called with no argument once that module is imported.
        deferred_errors: what an exception of a callback run *inside the import* does: ``"raise"`` propagates it
            out of the import statement (as an error in the module itself would), ``"log"`` logs a warning and
            lets the import succeed. A callback run at once always propagates to the :func:`when_imported` caller.
        fired: whether the callback ran (successfully or not).
        result: what the callback returned, once it fired.
        error: what the callback raised, once it fired, or ``None``.
    """

    def __init__(self, module_name: str, callback: Callable[[], Any], deferred_errors: DeferredErrors) -> None:
        self.module_name = module_name
        self.callback = callback
        self.deferred_errors: DeferredErrors = deferred_errors
        self.fired = False
        self.result: Any = None
        self.error: Exception | None = None

    @property
    def pending(self) -> bool:
        """Whether the callback still waits for its module."""
        with _LOCK:
            return any(hook is self for hook in _PENDING.get(self.module_name, ()))

    def uninstall(self) -> None:
        """Stop waiting for the module (no-op once fired); the finder leaves ``sys.meta_path`` with the last hook."""
        with _LOCK:
            hooks = _PENDING.get(self.module_name, [])
            hooks[:] = [hook for hook in hooks if hook is not self]
            if not hooks:
                _PENDING.pop(self.module_name, None)
            _sync_finder()

    def __enter__(self) -> ImportHook:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "fired" if self.fired else "pending" if self.pending else "uninstalled"
        return f"ImportHook({self.module_name!r}, {_describe(self.callback)}, {state})"

    def _fire(self) -> Any:
        try:
            self.result = self.callback()
        except Exception as exc:
            self.error = exc
            raise
        finally:
            self.fired = True
        return self.result


def when_imported(
    module_name: str, callback: Callable[[], Any], *, deferred_errors: DeferredErrors = "raise"
) -> ImportHook:
    """Run ``callback`` now if ``module_name`` is imported, else right after its first import completes.

    Idempotent while pending: registering the same callback for the same module again returns the pending hook
    instead of adding a second one. Once the module is imported every call runs the callback again (a plugin step
    may run several times in one process), so the callback must itself be idempotent.

    Args:
        module_name: the full dotted name of the module to wait for.
        callback: called with no argument; its return value is kept in :attr:`ImportHook.result`.
        deferred_errors: see :class:`ImportHook`.

    Returns:
        The hook: ``fired`` with ``result`` set when the callback ran now, else pending.

    Raises:
        Exception: Whatever ``callback`` raises when it runs now.
        ValueError: If ``deferred_errors`` is neither ``"raise"`` nor ``"log"``.
    """
    if deferred_errors not in ("raise", "log"):
        raise ValueError(f"deferred_errors must be 'raise' or 'log', got {deferred_errors!r}")
    with _LOCK:
        for hook in _PENDING.get(module_name, ()):
            if hook.callback == callback:
                return hook
        hook = ImportHook(module_name, callback, deferred_errors)
        if module_name not in sys.modules:
            _PENDING.setdefault(module_name, []).append(hook)
            _sync_finder()
            return hook
    hook._fire()  # outside the lock: the callback may import modules that have hooks of their own
    return hook


def pending_hooks(module_name: str | None = None) -> list[ImportHook]:
    """The hooks still waiting, for one module or for all, in registration order."""
    with _LOCK:
        if module_name is not None:
            return list(_PENDING.get(module_name, ()))
        return [hook for hooks in _PENDING.values() for hook in hooks]


def finder_installed() -> bool:
    """Whether this module's finder is on ``sys.meta_path`` (exactly while a hook is pending)."""
    return any(finder is _FINDER for finder in sys.meta_path)


@contextmanager
def hooks_restored() -> Iterator[None]:
    """Restore the pending hooks, and with them the finder's presence on ``sys.meta_path``, on exit."""
    with _LOCK:
        saved = {name: list(hooks) for name, hooks in _PENDING.items()}
    try:
        yield
    finally:
        with _LOCK:
            _PENDING.clear()
            _PENDING.update(saved)
            _sync_finder()


def _describe(callback: Callable[[], Any]) -> str:
    module = getattr(callback, "__module__", None)
    name = getattr(callback, "__qualname__", None) or repr(callback)
    return f"{module}.{name}" if module else name


# module name -> hooks waiting for it; guarded by _LOCK. Restorable through hooks_restored().
_PENDING: dict[str, list[ImportHook]] = {}
_LOCK = threading.RLock()
_SEARCHING = threading.local()  # names this thread is resolving through the other finders (re-entrancy guard)


def _sync_finder() -> None:
    """Put the finder first on ``sys.meta_path`` while a hook is pending; remove it otherwise. Holds ``_LOCK``."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    if _PENDING:
        # first: the spec must come through us before PathFinder (or an editable-install finder) answers
        sys.meta_path.insert(0, _FINDER)


def _fire_pending(module_name: str) -> None:
    """Run the hooks of a module whose code just ran (every one, even after a failure), then re-raise if asked."""
    with _LOCK:
        hooks = _PENDING.pop(module_name, [])
        _sync_finder()
    first_error: Exception | None = None
    for hook in hooks:
        try:
            result = hook._fire()
        except Exception as exc:
            if hook.deferred_errors == "log":
                logger.warning(
                    "verl-stable: %s after importing %s failed: %s", _describe(hook.callback), module_name, exc
                )
            elif first_error is None:
                first_error = exc
        else:
            logger.info("verl-stable: %s after importing %s: %s", _describe(hook.callback), module_name, result)
    if first_error is not None:
        raise first_error


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, plus the pending hooks once the module's code has run."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # a failing module keeps its hooks pending: a later, successful import still fires them
        self.inner.exec_module(module)
        # from here on the module looks as if it had been imported without us (reload, resources, inspection)
        if module.__spec__ is not None and module.__spec__.loader is self:
            module.__spec__.loader = self.inner
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.inner
        _fire_pending(module.__name__)

    def __getattr__(self, name: str) -> Any:
        # while the module's code runs it sees this loader: get_resource_reader, is_package ... are the real one's
        return getattr(self.inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a module that has pending hooks, found by the other finders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        searching: set[str] = getattr(_SEARCHING, "names", set())
        if fullname not in _PENDING or fullname in searching:
            return None
        _SEARCHING.names = searching | {fullname}
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            _SEARCHING.names = searching
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # nothing we can run code after: the import proceeds as if we were not here
        spec.loader = _HookedLoader(spec.loader)
        return spec

    def _find_elsewhere(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


_FINDER = _PostImportFinder()
