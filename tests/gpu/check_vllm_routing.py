"""GPU check: a real vLLM 0.24 run's ``routed_experts`` decode through verl-stable's codecs and transport.

Not collected by pytest (needs CUDA and vLLM). Run on a GPU machine with vLLM installed:

    python tests/gpu/check_vllm_routing.py            # builds a tiny random Qwen3-MoE (dense layer 0) locally
    python tests/gpu/check_vllm_routing.py --model /path/to/Qwen3-30B-A3B --max-tokens 64

What it checks, exiting non-zero on the first failure:

1. every completion's ``routed_experts`` has the documented shape ``[prompt_len + n_output - 1, num_hidden_layers,
   top_k]``, uint8/uint16, zero rows for dense layers, and passes :func:`decode_vllm` validation (ids in range,
   distinct, no all-zero MoE rows);
2. ``SamplingParams(routed_experts_prompt_start=s)`` drops exactly the first ``s`` prompt rows and leaves the rest
   identical to the run without an offset (same seed, greedy);
3. the ``rollout.n`` completions of one prompt report identical prompt rows (what group packing relies on), and
   packing stores them once;
4. the routing agrees with the Hugging Face model's own top-k on the same tokens for most (token, layer) rows
   (bf16 numerics move a few percent; prints the agreement).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
import torch


def build_tiny_model(path: str) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        mlp_only_layers=[0],
        max_position_embeddings=2048,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def hf_topk(model_path: str, sequences: list[list[int]], layout) -> list[np.ndarray]:
    """The HF model's own top-k ids per token and MoE layer (set semantics), ``[T, L, K]`` per sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda().eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            result = model(torch.tensor([seq], device="cuda"), output_router_logits=True)
            logits = [r for r in result.router_logits if r is not None]
            assert len(logits) == layout.num_moe_layers, (len(logits), layout.num_moe_layers)
            ids = torch.stack([lg.float().topk(layout.top_k, dim=-1).indices for lg in logits], dim=1)
            out.append(ids.cpu().numpy())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF MoE checkpoint; default: a tiny random Qwen3-MoE")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--min-agreement", type=float, default=0.8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        print(f"SKIP: vLLM not installed ({exc})")
        return 0
    from transformers import AutoConfig

    from verl_stable.routing.codecs import decode_vllm
    from verl_stable.routing.families import layout_from_config
    from verl_stable.transport.packed import PackedRouting

    model_path = args.model or tempfile.mkdtemp(prefix="tiny_qwen3_moe_")
    if args.model is None:
        build_tiny_model(model_path)
    layout = layout_from_config(AutoConfig.from_pretrained(model_path))
    print(f"layout: {layout}")
    llm = LLM(
        model=model_path,
        skip_tokenizer_init=True,
        enable_return_routed_experts=True,
        enforce_eager=True,
        gpu_memory_utilization=0.5,
        dtype="bfloat16",
    )
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 4000, size=int(rng.integers(8, 40))).tolist() for _ in range(3)]
    failures = []

    def check(cond: bool, what: str) -> None:
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    # 1 + 3: shapes, validation, identical prompt rows within a group, packing
    sampled = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0, detokenize=False)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampled)
    decoded, prompt_lens, groups, sequences = [], [], [], []
    for g, res in enumerate(results):
        p = len(res.prompt_token_ids)
        for comp in res.outputs:
            raw = comp.routed_experts
            n_out = len(comp.token_ids)
            check(
                raw is not None and raw.shape == (p + n_out - 1, layout.num_hidden_layers, layout.top_k),
                f"prompt {g}: shape {None if raw is None else raw.shape} == ({p}+{n_out}-1, "
                f"{layout.num_hidden_layers}, {layout.top_k}), dtype {None if raw is None else raw.dtype}",
            )
            rows = decode_vllm(raw, prompt_len=p, response_len=n_out, layout=layout)  # raises on any defect
            decoded.append(rows)
            prompt_lens.append(p)
            groups.append(g)
            sequences.append(list(res.prompt_token_ids) + list(comp.token_ids))
        first = decoded[-len(res.outputs)].ids[:p]
        check(
            all(np.array_equal(r.ids[:p], first) for r in decoded[-len(res.outputs) :]),
            f"prompt {g}: the {len(res.outputs)} completions report identical prompt rows",
        )
    packed = PackedRouting.pack(decoded, prompt_lens, groups, layout)
    check(packed.stats.prompt_rows_stored == sum(len(p) for p in prompts), "packing stores each prompt once")
    check(all(_same(a, b) for a, b in zip(packed.unpack(), decoded, strict=True)), "packing round-trips")

    # 2: prompt offset, greedy so both runs generate the same tokens
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False)
    full = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], greedy)[0].outputs[0]
    offset = 5
    shifted_params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, detokenize=False, routed_experts_prompt_start=offset
    )
    shifted = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], shifted_params)[0].outputs[0]
    p0 = len(prompts[0])
    a = decode_vllm(full.routed_experts, prompt_len=p0, response_len=len(full.token_ids), layout=layout)
    b = decode_vllm(
        shifted.routed_experts,
        prompt_len=p0,
        response_len=len(shifted.token_ids),
        layout=layout,
        prompt_start=offset,
    )
    check(list(full.token_ids) == list(shifted.token_ids), "greedy runs with and without offset generate the same")
    check(b.start == offset and np.array_equal(a.ids[offset:], b.ids), "routed_experts_prompt_start drops rows")

    # 4: agreement with the HF model on the same tokens (rows the engine recorded)
    del llm
    torch.cuda.empty_cache()
    reference = hf_topk(model_path, sequences[:4], layout)
    agree = total = 0
    for rows, ref in zip(decoded[:4], reference, strict=False):
        ours = np.sort(rows.ids.astype(np.int64), axis=-1)
        theirs = np.sort(ref[rows.start : rows.stop], axis=-1)
        agree += int((ours == theirs).all(axis=-1).sum())
        total += ours.shape[0] * ours.shape[1]
    print(f"HF agreement: {agree}/{total} = {agree / max(total, 1):.3f} of (token, MoE layer) expert sets")
    check(agree / max(total, 1) >= args.min_agreement, f"agreement >= {args.min_agreement}")
    print("PASS" if not failures else f"{len(failures)} FAILURES")
    return 1 if failures else 0


def _same(a, b) -> bool:
    return a is not None and a.start == b.start and np.array_equal(a.ids, b.ids)


if __name__ == "__main__":
    sys.exit(main())
