"""Set attributes of third-party modules and classes, remembering exactly what was there, to put it back.

Every fix of the Megatron CPU runtime replaces (or adds) a handful of attributes; :class:`AttributePatcher` records
each one as it is set so that :meth:`AttributePatcher.restore` returns the module or class to its own state: the
original object where there was one, no attribute where there was none (an added name, or a class attribute that was
only inherited). Fixes receive the runtime's patcher; they never restore anything themselves.
"""

from __future__ import annotations

from typing import Any

_MISSING = object()


class AttributePatcher:
    """An undo log of attribute assignments, restored in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering the attribute ``owner`` itself held (not one it inherits)."""
        self._undo.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def set_default(self, owner: Any, name: str, value: Any) -> bool:
        """Add ``owner.name = value`` only where ``owner`` has no such attribute; returns whether it was added."""
        if hasattr(owner, name):
            return False
        self.set(owner, name, value)
        return True

    def restore(self) -> None:
        """Put back every attribute set, last first; the log is empty afterwards."""
        while self._undo:
            owner, name, original = self._undo.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
