"""Stability metrics (pure functions) and the guard that turns them into verdicts."""
