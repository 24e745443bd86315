"""Stability metrics (pure functions, imported from :mod:`verl_stable.monitor.metrics`) and the guard that turns them
into verdicts (:mod:`verl_stable.monitor.guard`). Symbols: ``docs/reference/notation.md``."""
