"""Everything that imports verl (and, where present, vLLM / SGLang): thin adapters into verl's registries.

Importing any module of this package imports verl first, here. ``import verl`` loads our plugin
(:mod:`verl_stable.integration.plugin`), which imports every registration step's module; were verl imported first
from inside one of those modules instead (``losses`` imports verl at its top), the plugin would run while that module
is half-initialised: its own step could not register and every step importing it would fail (the replay engine imports
``losses``). Importing verl before any module of this package starts keeps registration independent of import order.
When verl is itself importing the plugin this binds the partly initialised ``verl`` and does nothing else.
"""

import verl  # noqa: F401 - imported for its side effect: the plugin registers before any module here runs
