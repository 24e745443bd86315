"""Helpers shared by test files in several folders, imported as plain functions (``from testkit.moe import ...``).

``tests/`` is on ``sys.path`` while pytest runs: ``tests/conftest.py`` sits in a folder without ``__init__.py``, so
pytest's default ``prepend`` import mode inserts it (and processes spawned from a test inherit that path).
Fixtures live in the ``conftest.py`` of the folder that uses them instead.
"""
