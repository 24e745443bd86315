"""``verl-stable probe``: measure the training-inference mismatch of a user's own HF checkpoint before a run.

Which switch does *my* model need? The probe samples completions with a rollout engine as verl runs it (the
project's ``hf`` backend at a rollout precision, or vLLM), scores the sampled tokens with the forward verl's FSDP
actor runs (the HF model in the training dtype), without replay and with R3 replay of the rollout's routing, and
reports KL(mu||pi) k3, F(tau), the IS-weight tail and the routing flips per MoE layer, with what they mean for the
recipes (docs/probe.md).

Modules, one concept each: ``checks`` (the model, engine and precision verdicts; :class:`ProbeInputError`),
``prompts`` (built-in prompts and verl's parquet format), ``inference`` (the rollout: ``hf`` engine and the
:class:`Rollout` record), ``vllm_engine`` (vLLM in a process of its own), ``training`` (the actor's forward, capture
and R3 replay), ``metrics`` (the monitor's formulas on the probe's tensors, with sampling errors), ``advice`` (the
lab's findings and the verdict per regime), ``report`` (markdown, JSON, figure), ``runner`` (the probe, start to
end) and ``cli`` (the command line).
"""
