"""The probe's ``vllm`` engine: vLLM samples the completions in a process of its own and returns them with their
routed experts.

vLLM starts its engine processes with ``spawn`` and keeps memory (on a GPU: most of it) until its process ends, so it
runs as a program (``python -m verl_stable.probe.vllm_engine REQUEST.json OUT_DIR``, as
:mod:`verl_stable.backends.vllm_cpu.probe` does for the doctor) and the training forward starts after it exited.
:func:`sample_vllm` writes the request, runs it and reads the answer back: ``result.json`` (tokens, log-probs, finish
reasons) and ``routing.npz`` (one ``[P + R - 1, decoder layers, top_k]`` array per sample, vLLM's
``CompletionOutput.routed_experts``), read with ``allow_pickle=False``.

The engine as verl's vLLM rollout runs it: the checkpoint at ``dtype`` (fp8: ``quantization="fp8"``, vLLM's dynamic
W8A8 on a GPU), ``enable_return_routed_experts`` for a MoE, token ids in (``skip_tokenizer_init``), temperature 1
without top-k / top-p, ``logprobs=0`` (the sampled token's log-prob), one seed per sample, the checkpoint's eos ids as
stop tokens (kept in the output, as verl keeps them). On the CPU build: eager mode, a 1 GiB KV cache unless
``VLLM_CPU_KVCACHE_SPACE`` says otherwise, no thread binding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from verl_stable.probe.inference import Rollout, decode_routing, sample_seed

__all__ = ["VLLM_DTYPES", "ProbeEngineError", "sample_vllm"]

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
"""``dtype`` of vLLM per rollout precision (fp8 adds ``quantization="fp8"``)."""
DEFAULT_TIMEOUT_S = 3600


class ProbeEngineError(RuntimeError):
    """The rollout engine failed to start or to sample (a model vLLM cannot serve, no memory ...)."""


def _failure_line(text: str) -> str:
    """The most telling line of a failed engine's output: the last one naming an error, else the last one."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(no output)"])[-1][:400]


def sample_vllm(
    model_dir: str | Path,
    prompts: Mapping[int, Sequence[int]],
    prompt_of_sample: Sequence[int],
    *,
    precision: str,
    max_tokens: int,
    seed: int,
    eos_ids: Sequence[int],
    layout: Any | None,
    progress: Callable[[int], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Rollout]:
    """Sample one completion per entry of ``prompt_of_sample`` with vLLM (module docstring); the arguments are
    :func:`verl_stable.probe.inference.sample_hf`'s.

    Raises:
        ProbeEngineError: vLLM exited with an error or ran past ``timeout_s``; the message is its telling line.
    """
    longest = max(len(p) for p in prompts.values())
    request = {
        "model": str(model_dir),
        "precision": precision,
        "prompts": [list(map(int, prompts[i])) for i in prompt_of_sample],
        "seeds": [sample_seed(seed, s) for s in range(len(prompt_of_sample))],
        "seed": int(seed),
        "max_tokens": int(max_tokens),
        "max_model_len": int(longest + max_tokens),
        "eos_ids": [int(i) for i in eos_ids],
        "routing": layout is not None,
    }
    with tempfile.TemporaryDirectory(prefix="verl_stable_probe_vllm_") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(request))
        cmd = [sys.executable, "-m", "verl_stable.probe.vllm_engine", str(req), tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_engine_env())
        except subprocess.TimeoutExpired:
            raise ProbeEngineError(f"vLLM ran past {timeout_s:g} s") from None
        result_file = Path(tmp) / "result.json"
        if proc.returncode != 0 or not result_file.is_file():
            raise ProbeEngineError(f"vLLM exited {proc.returncode}: {_failure_line(proc.stderr + proc.stdout)}")
        result = json.loads(result_file.read_text())
        arrays = np.load(Path(tmp) / "routing.npz", allow_pickle=False) if layout is not None else None
        rollouts = []
        for s, index in enumerate(prompt_of_sample):
            prompt = list(prompts[index])
            tokens = result["token_ids"][s]
            routing = None
            if arrays is not None:
                routing = decode_routing(arrays[f"s{s}"], len(prompt), len(tokens), layout)
            rollouts.append(Rollout(index, prompt, tokens, result["logp"][s], routing, result["finish"][s]))
    if progress is not None:
        progress(len(rollouts))
    return rollouts


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run(request: dict[str, Any], out_dir: Path) -> None:
    """The program's body: start vLLM once, sample every request, write the answer (module docstring)."""
    from vllm import LLM, SamplingParams

    from verl_stable.probe.checks import vllm_cpu_build

    cpu = vllm_cpu_build()
    precision = request["precision"]
    llm = LLM(
        model=request["model"],
        dtype=VLLM_DTYPES[precision],
        quantization="fp8" if precision == "fp8" else None,
        enforce_eager=cpu,
        enable_return_routed_experts=bool(request["routing"]),
        skip_tokenizer_init=True,
        max_model_len=request["max_model_len"],
        seed=request["seed"],
    )
    params = [
        SamplingParams(
            max_tokens=request["max_tokens"],
            temperature=1.0,
            top_p=1.0,
            logprobs=0,
            seed=s,
            stop_token_ids=request["eos_ids"],
        )
        for s in request["seeds"]
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False)
    tokens, logps, finish, arrays = [], [], [], {}
    for s, output in enumerate(outputs):
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        tokens.append(ids)
        logps.append([float(completion.logprobs[t][token].logprob) for t, token in enumerate(ids)])
        finish.append("stop" if completion.finish_reason == "stop" else "length")
        if request["routing"]:
            if completion.routed_experts is None:
                raise RuntimeError("vLLM returned no routed_experts although enable_return_routed_experts was set")
            arrays[f"s{s}"] = np.asarray(completion.routed_experts)
    np.savez(out_dir / "routing.npz", **arrays)
    (out_dir / "result.json").write_text(json.dumps({"token_ids": tokens, "logp": logps, "finish": finish}))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m verl_stable.probe.vllm_engine REQUEST.json OUT_DIR``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m verl_stable.probe.vllm_engine REQUEST.json OUT_DIR", file=sys.stderr)
        return 2
    _run(json.loads(Path(args[0]).read_text()), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
