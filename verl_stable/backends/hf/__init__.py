"""The ``hf`` rollout back end: a Hugging Face model served to verl's agent loop with KV-cached sampling,
cross-request batching, routed-experts export and a chosen rollout precision."""
