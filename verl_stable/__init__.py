"""verl-stable: stable reinforcement learning of (MoE) LLMs as a plugin for verl 0.9.1.

Importing this package does not import verl. verl loads :mod:`verl_stable.integration.plugin` by itself
through the ``verl.plugins`` entry point whenever ``import verl`` runs.
"""

__version__ = "0.1.0"

SUPPORTED_VERL_VERSION = "0.9.1"
