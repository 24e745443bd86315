"""verl on CPU: a CPU platform and the `hf` rollout backend, registered into verl."""
