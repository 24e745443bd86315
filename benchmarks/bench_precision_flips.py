"""How often rollout precision flips MoE routing, and how far it moves the token distribution (CPU).

For each rollout setting -- a precision ``p`` of ``verl_stable.backends.hf.precision`` (bf16, fp16, fp8 weights, fp8
weights + activations ``fp8_w8a8``, ``int4`` weights: what the ``hf`` rollout backend samples with), optionally with
the inference-only router perturbation written ``p@sigma`` (``fp8@0.3``: fp8 weights, routers perturbed by
``0.3 * rms(W_g) * E``, labelled as the stand-in it is) -- a copy of an fp32 model is run on the same tokens as the
fp32 original. Reported against fp32:

* routing flips: the fraction of (token, MoE layer) decisions whose top-k expert *set* differs
  (``verl_stable.routing.capture`` + ``routing_disagreement``), and the fraction of tokens with a flip in any layer;
* ``KL(mu || pi_fp32)`` per token, exact over the vocabulary (``sum_v mu_v (log mu_v - log pi_v)``) and the k3
  estimate the monitor logs, ``E_{y ~ mu}[r - 1 - log r]`` with ``r = pi(y) / mu(y)`` at one token sampled from
  ``mu`` per position;
* ``max |d logp|``: the largest ``|log mu(y) - log pi(y)|`` over those sampled tokens;
* router margins, to explain the flips: per (token, layer) the fp32 gap between the k-th and (k+1)-th router logit,
  and the size of the precision's perturbation of the router logits, ``||z_p - z_fp32||_inf``. A decision can only
  flip where the perturbation reaches the margin; "margin < 2 |dz|" is that upper bound.

Each seed draws a new random model (or, with ``--checkpoint``, new tokens for the same model) and new tokens; the
table shows the mean over seeds and the [min, max] range.

Usage:

    python benchmarks/bench_precision_flips.py                       # random Qwen3-MoE: 4 layers, top-4 of 16
    python benchmarks/bench_precision_flips.py --init 0.1 --hidden 128  # a configurable random model
    python benchmarks/bench_precision_flips.py --checkpoint DIR      # a saved HF model (e.g. the lab's cold start)
    python benchmarks/bench_precision_flips.py --checkpoint DIR --tokens random
    python benchmarks/bench_precision_flips.py --checkpoint DIR --precisions fp8 fp8_w8a8 int4 fp8@0.1 fp8@0.3
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from verl_stable.backends.hf.precision import PRECISIONS as ALL_PRECISIONS
from verl_stable.backends.hf.precision import precision_copy
from verl_stable.routing import bind_model, capture, routing_disagreement

PRECISIONS = ("bf16", "fp16", "fp8")
METRICS = (
    ("flip", "routing flips (token, layer)", "{:.2%}"),
    ("flip_tok", "tokens with a flip", "{:.1%}"),
    ("kl", "KL(mu||pi) exact", "{:.2e}"),
    ("k3", "KL k3 (sampled)", "{:.2e}"),
    ("dlogp", "max |d logp|", "{:.2e}"),
    ("margin", "median fp32 margin", "{:.3f}"),
    ("dz", "median |dz|_inf", "{:.4f}"),
    ("tight", "margin < 2|dz|", "{:.2%}"),
)


def random_qwen3_moe(
    hidden: int, layers: int, experts: int, top_k: int, vocab: int, init: float, seed: int
) -> nn.Module:
    """A randomly initialised fp32 Qwen3-MoE (every layer sparse), eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=max(hidden // 2, 8),
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=max(hidden // 4, 8),
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        initializer_range=init,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def load_checkpoint(path: str | Path) -> tuple[nn.Module, object | None]:
    """An HF checkpoint directory in fp32 (eval mode) and its tokenizer, if the directory has one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a bare model directory: random tokens only
        tokenizer = None
    return model, tokenizer


def random_tokens(vocab: int, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[batch, length]`` uniform token ids in ``[3, vocab)`` (no padding) and an all-ones mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    return ids, torch.ones_like(ids)


def task_tokens(tokenizer: object, task: str, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In-distribution sequences of the lab's toy task: chat prompt + answer + eos, left-padded.

    Returns:
        ``(ids, attention_mask, response_positions)``; ``response_positions[b, t]`` marks the positions whose next
        token is a response token (answer, eos): the tokens a rollout samples and the monitor's KL is taken over.
    """
    from verl_stable.lab.coldstart import encode_examples
    from verl_stable.toy import tasks

    ids, attn, targets = encode_examples(tokenizer, tasks.make_examples(task, batch, seed=10_000 + seed))
    response = torch.zeros_like(targets)
    response[:, :-1] = targets[:, 1:]
    return ids, attn, response


@contextmanager
def router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect every MoE router's logits ``[rows, experts]`` (fp32), one entry per MoE layer, of one forward."""
    sites = bind_model(model).sites
    out: list[torch.Tensor] = [torch.empty(0)] * len(sites)
    handles = []
    for site in sites:

        def hook(_m: nn.Module, _a: object, result: object, _i: int = site.ordinal) -> None:
            logits = result[0] if isinstance(result, tuple) else result
            out[_i] = logits.detach().float().reshape(-1, logits.shape[-1])

        handles.append(site.module.register_forward_hook(hook))
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def _forward(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor):
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), capture(model) as rec, router_logits(model) as logits:
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions)
    return out.logits.float().log_softmax(-1), rec.trace, logits


def precision_mismatch(
    reference: nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    precisions: Sequence[str],
    seed: int,
    scored: torch.Tensor | None = None,
) -> dict[str, dict[str, float]]:
    """Metrics of each precision copy of ``reference`` (fp32) against it on ``ids`` (see module docstring).

    Routing flips and margins count every valid token; the KL terms count the positions in ``scored`` ([B, S]
    bool, default: every valid position).

    Returns:
        ``{precision: {"flip", "flip_tok", "kl", "k3", "dlogp", "margin", "dz", "tight"}}``.
    """
    top_k = bind_model(reference).layout.top_k
    valid = attn.reshape(-1).bool()
    scored_rows = (attn.bool() if scored is None else scored.bool() & attn.bool()).reshape(-1)[valid]
    logp_ref, trace_ref, z_ref = _forward(reference, ids, attn)
    logp_ref = logp_ref.reshape(-1, logp_ref.shape[-1])[valid][scored_rows]
    z_ref = [z[valid] for z in z_ref]
    # fp32 margin between the k-th and (k+1)-th router logit, per (token, layer)
    margins = torch.stack(
        [z.topk(top_k + 1, dim=-1).values[:, -2] - z.topk(top_k + 1, dim=-1).values[:, -1] for z in z_ref]
    )
    results = {}
    for precision in precisions:
        model = precision_copy(reference, *parse_setting(precision))
        logp, trace, z = _forward(model, ids, attn)
        logp = logp.reshape(-1, logp.shape[-1])[valid][scored_rows]
        dz = torch.stack([(zp[valid] - zr).abs().amax(-1) for zp, zr in zip(z, z_ref, strict=True)])
        mu = logp.exp()
        kl = (mu * (logp - logp_ref)).sum(-1)
        g = torch.Generator().manual_seed(seed)
        y = torch.multinomial(mu, 1, generator=g)
        log_r = (logp_ref.gather(-1, y) - logp.gather(-1, y)).squeeze(-1)
        k3 = log_r.exp() - 1 - log_r
        flips = routing_disagreement(trace_ref, trace)
        results[precision] = {
            "flip": flips["overall"],
            "flip_tok": flips["token_any_layer"],
            "kl": float(kl.mean()),
            "k3": float(k3.mean()),
            "dlogp": float(log_r.abs().max()),
            "margin": float(margins.median()),
            "dz": float(dz.median()),
            "tight": float((margins < 2 * dz).double().mean()),
        }
    return results


def parse_setting(spec: str) -> tuple[str, float]:
    """``"fp8"`` -> ``("fp8", 0.0)``; ``"fp8@0.3"`` -> ``("fp8", 0.3)`` (precision, router perturbation sigma)."""
    precision, _, sigma = spec.partition("@")
    if precision not in ALL_PRECISIONS:
        raise argparse.ArgumentTypeError(f"unknown precision {precision!r}; expected one of {ALL_PRECISIONS}")
    try:
        noise = float(sigma) if sigma else 0.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"router perturbation in {spec!r} is not a number") from None
    if not noise >= 0:
        raise argparse.ArgumentTypeError(f"router perturbation in {spec!r} must be >= 0")
    return precision, noise


def _setting(spec: str) -> str:
    parse_setting(spec)
    return spec


def summarize(runs: list[dict[str, dict[str, float]]], precisions: Sequence[str], title: str) -> None:
    """Print one row per precision: mean [min, max] over seeds of every metric."""
    print(title)
    header = "  precision | " + " | ".join(label for _, label, _ in METRICS)
    print(header)
    for p in precisions:
        cells = []
        for key, _, fmt in METRICS:
            values = [r[p][key] for r in runs]
            mean = statistics.fmean(values)
            cells.append(f"{fmt.format(mean)} [{fmt.format(min(values))}, {fmt.format(max(values))}]")
        print(f"  {p:12s} | " + " | ".join(cells))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--precisions", nargs="+", default=list(PRECISIONS), type=_setting, help="settings p or p@sigma (see above)"
    )
    parser.add_argument("--checkpoint", default=None, help="HF model directory (default: a random Qwen3-MoE)")
    parser.add_argument(
        "--tokens",
        choices=("auto", "random", "task"),
        default="auto",
        help="auto: the lab task's sequences when --checkpoint has a tokenizer, else random",
    )
    parser.add_argument("--task", default="max", help="lab task for --tokens task (copy | add | max)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64, help="random-token sequence length")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--init", type=float, default=0.02, help="initializer_range of the random model")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    runs = []
    fixed = load_checkpoint(args.checkpoint) if args.checkpoint else None
    for seed in args.seeds:
        if fixed is None:
            model = random_qwen3_moe(args.hidden, args.layers, args.experts, args.top_k, args.vocab, args.init, seed)
            tokenizer = None
        else:
            model, tokenizer = fixed
        mode = args.tokens
        if mode == "auto":
            mode = "task" if tokenizer is not None else "random"
        if mode == "task":
            if tokenizer is None:
                raise SystemExit("--tokens task needs a --checkpoint directory with a tokenizer")
            ids, attn, scored = task_tokens(tokenizer, args.task, args.batch, seed)
        else:
            vocab = model.get_input_embeddings().weight.shape[0]
            (ids, attn), scored = random_tokens(vocab, args.batch, args.length, seed), None
        runs.append(precision_mismatch(model, ids, attn, args.precisions, seed, scored=scored))

    layout = bind_model(model).layout
    source = args.checkpoint or (f"random Qwen3-MoE (hidden {args.hidden}, init {args.init}, vocab {args.vocab})")
    summarize(
        runs,
        args.precisions,
        f"[flips] {source}: {layout.num_hidden_layers} layers, top-{layout.top_k} of {layout.num_experts} experts; "
        f"{mode} tokens, {int(attn.sum())} per seed; vs fp32, mean [min, max] over seeds {args.seeds}",
    )
    if mode == "task":
        print("  (KL, k3 and max |d logp| over the response positions only: answer and eos, as the monitor logs them)")


if __name__ == "__main__":
    main()
