"""Offline checks of vLLM's CPU build against the transformers model it serves: routed experts and weight reload.

Run as a program (vLLM starts engine processes with ``spawn``, so it must own ``__main__``)::

    python -m verl_stable.backends.vllm_cpu.probe --family qwen3_moe --dtype float32 [--reload] [--no-kernel-reset]

It builds a tiny random MoE of that family (head size 32: vLLM's CPU attention refuses 16), samples a few
completions with ``enable_return_routed_experts``, decodes each completion's routed experts with the project's own
codec (:func:`verl_stable.routing.codecs.decode_vllm`), and compares them with the routing the transformers model
itself takes on the same tokens (:func:`verl_stable.routing.capture`), row by row as expert *sets* (vLLM does not sort
the ids of a row). It also compares vLLM's sampled-token log-probs with the transformers model's. It prints one JSON
object.

``--reload`` starts vLLM on dummy weights and then loads the checkpoint through the same layerwise reload that verl's
weight sync uses on CPU (:func:`verl_stable.backends.vllm_cpu.worker.reload_layerwise`), in two buckets, as verl's bucketed
transfer does: the engine must then serve exactly the checkpoint (``synced_tensors`` sent, ``renamed_names`` of them
renamed for vLLM, e.g. Mixtral's ``mlp`` blocks). ``--no-kernel-reset`` leaves out the CPU MoE kernel rebuild, to show
the vLLM bug it works around.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
DTYPES = ("float32", "bfloat16")


def build_model(out_dir: str | os.PathLike, family: str, seed: int = 0) -> Path:
    """Save a random tiny MoE of ``family`` (4 layers, 16 experts, top-4, head size 32) to ``out_dir``."""
    import torch
    import transformers as tf

    common = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        )  # fmt: skip
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            **{k: v for k, v in common.items() if k != "head_dim"}, intermediate_size=128, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=False,
        )  # fmt: skip
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mixtral":
        config = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4)
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    torch.manual_seed(seed)
    model = cls(config).float()
    # transformers' default init (std 0.02) leaves router logits nearly tied; a larger router scale gives routing
    # decisions with margins, as trained models have, so that exact agreement is a meaningful check.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                param.normal_(0.0, 0.5)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def _reload_from_checkpoint(worker: Any, model_dir: str, reset_kernels: bool) -> dict[str, int]:
    """Runs inside vLLM's worker (``collective_rpc``): load ``model_dir`` as verl's weight sync would send it (the live
    transformers module's names through verl's ``unfuse_moe_params``). Returns how many tensors were sent and how many
    names the worker extension renamed for vLLM (:func:`verl_stable.backends.vllm_cpu.worker.checkpoint_name_mapper`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    from verl_stable.backends.vllm_cpu.worker import checkpoint_name_mapper, reload_layerwise

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = list(unfuse_moe_params(hf.state_dict().items(), hf.config.model_type))
    half = len(weights) // 2
    model_runner = worker.model_runner
    models = [(model_runner.model, model_runner.vllm_config.model_config)]
    mapper = checkpoint_name_mapper(name for name, _ in model_runner.model.named_modules())
    renamed = sum(mapper(name) != name for name, _ in weights) if mapper else 0
    reload_layerwise(models, iter([weights[:half], weights[half:]]), reset_kernels=reset_kernels)
    return {"tensors": len(weights), "renamed": renamed}


def probe(family: str, dtype: str = "float32", reload: bool = False, reset_kernels: bool = True) -> dict[str, Any]:
    """Sample with vLLM and compare routing and log-probs with the transformers model (see the module docstring)."""
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from verl_stable.routing import capture, layout_from_config
    from verl_stable.routing.codecs import decode_vllm

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a local function
    os.environ["VERL_PLATFORM"] = "cpu"  # the reload imports verl in vLLM's worker: it must find vllm-cpu (alias)
    with tempfile.TemporaryDirectory(prefix="vllm_probe_") as tmp:
        model_dir = build_model(tmp, family)
        layout = layout_from_config(AutoConfig.from_pretrained(str(model_dir)))
        start = time.perf_counter()
        llm = LLM(
            model=str(model_dir), dtype=dtype, enforce_eager=True, enable_return_routed_experts=True,
            skip_tokenizer_init=True, max_model_len=128, seed=0, load_format="dummy" if reload else "auto",
        )  # fmt: skip
        engine_start_s = time.perf_counter() - start
        sync: dict[str, int] = {}
        if reload:
            sync = llm.collective_rpc(_reload_from_checkpoint, args=(str(model_dir), reset_kernels))[0]
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 64, size=int(n)).tolist() for n in rng.integers(4, 20, size=8)]
        params = SamplingParams(max_tokens=12, temperature=1.0, logprobs=0, seed=0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        equal = total = 0
        max_diff = 0.0
        for prompt, out in zip(prompts, outputs, strict=True):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            rows = decode_vllm(
                completion.routed_experts, prompt_len=len(prompt), response_len=len(tokens), layout=layout
            )
            ids = torch.tensor([prompt + tokens])
            with torch.no_grad(), capture(hf) as rec:
                logits = hf(ids).logits[0].float()
            own = rec.trace.to_tensor()[rows.start : rows.stop]  # [rows, moe_layers, top_k]
            got = torch.from_numpy(rows.ids.astype(np.int64))
            same = (own.sort(-1).values == got.sort(-1).values).all(-1)
            equal += int(same.sum())
            total += same.numel()
            logp = torch.log_softmax(logits, -1)
            for t, token in enumerate(tokens):
                ref = float(logp[len(prompt) - 1 + t, token])
                max_diff = max(max_diff, abs(ref - completion.logprobs[t][token].logprob))
    from verl_stable.backends.vllm_cpu.rollout import installed_version

    return {
        "family": family,
        "dtype": dtype,
        "reload": reload,
        "kernel_reset": reset_kernels,
        "synced_tensors": sync.get("tensors", 0),
        "renamed_names": sync.get("renamed", 0),
        "vllm_cpu": installed_version(),
        "rows": total,
        "rows_equal": equal / max(1, total),
        "logprob_max_abs_diff": max_diff,
        "engine_start_s": round(engine_start_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_stable.backends.vllm_cpu.probe", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--reload", action="store_true", help="start on dummy weights, load through the weight sync")
    parser.add_argument("--no-kernel-reset", action="store_true", help="reload without the CPU MoE kernel rebuild")
    args = parser.parse_args(argv)
    result = probe(args.family, args.dtype, reload=args.reload, reset_kernels=not args.no_kernel_reset)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
