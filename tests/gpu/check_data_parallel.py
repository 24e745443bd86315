"""Device check: R3 and R2 router replay under data parallelism, dp = 1 against dp = N on one node, in verl's main_ppo.

Not collected by pytest. Runs verl's own trainer (``python -m verl.trainer.main_ppo`` in a subprocess, as
:func:`verl_stable.toy.launch.run_main_ppo` does) on a tiny Qwen3-MoE built here from a config
(:func:`verl_stable.toy.assets.ensure_assets` with :func:`verl_stable.toy.launch.asset_spec` ``("vllm")``: a head size
vLLM serves), twice per regime -- one actor rank and one rollout replica, then N of each -- and compares the runs:

* ``r3``: R3 replays the rollout's routing, sent through the compact transport (the agent-loop manager
  :data:`verl_stable.transport.options.MANAGER_FQN`, which also seeds every sample), ``trainer.v1.trainer_mode=
  stable_sync``, ``balance_batch`` and dynamic batch sizes; one update per step (the batch is the mini-batch).
* ``r2``: the shipped ``recipes/fsdp/minirl_n2_r2.yaml`` (R2, N = 2 update mini-steps), the same manager,
  ``balance_batch`` and dynamic batch sizes small enough to cut each rank's share into several micro-batches.

Rollout: verl's vLLM (``rollout.name=vllm``, one GPU per replica) with ``--device cuda``; with ``--device cpu`` the
project's CPU runtime (:func:`verl_stable.toy.launch.cpu_overrides`: gloo, fake Ray GPUs, the ``hf`` rollout), so the
script itself runs on any machine. Both runs of a pair share one geometry, sized for the larger dp (every rank gets
samples). The tests ``tests/integration/test_data_parallel_e2e.py`` and ``..._r2_e2e.py`` make the same comparison
at dp = 2 on CPU.

Checks, one PASS / FAIL line each:

1. every run logged every step; the dp = N run placed N actor ranks and N rollout replicas, the dp = 1 run one replica
   (distinct actor pids in the log); r2 ran two update mini-steps per step;
2. every step of every run: ``stable/routing/disagreement`` == 0 (and each ``update_<i>/disagreement``): every rank
   and micro-batch used the replayed experts; ``stable/routing/coverage/response_replayed`` == 1.0;
3. the same samples at dp = 1 and dp = N (``critic/score/mean``, ``response_length/mean`` equal up to float32
   summation order, 1e-6): per-sample seeds make a sample independent of the replica that drew it;
4. coverage row counts (``response_rows``, ``response_replayed_rows``, ``prompt_rows``, ``prompt_replayed_rows``) of
   the dp = N run, summed over its ranks, equal the dp = 1 run's: no row lost or counted twice across ranks;
5. step 1 (both runs hold the same initial weights): ``rollout_corr/training_log_ppl`` (the old log-probs over the
   whole batch) equal within the tolerance below, and for r3 ``actor/pg_loss`` too. r2's ``pg_loss`` is not compared:
   every rank cuts its own share into the two mini-batches, so a mini-step holds different samples at different dp
   (see ``test_data_parallel_r2_e2e.py``).

Tolerance of check 5. Both devices run verl's FSDP actor in bf16 (its default ``param_dtype``; 8 significant bits,
unit roundoff 2^-9 ~ 2e-3), and at dp = 1 and dp = N the same tokens pass in micro-batches of different shapes
(``balance_batch``, dynamic batch sizes). CPU: |a - b| <= max(1e-6, 1e-5 |a|), the e2e tests' -- PyTorch's CPU
kernels compute a row alike whatever the micro-batch's shape (measured: the runs differ by summation order only).
GPU: |a - b| <= max(1e-2, 5e-3 |a|): cuBLAS / Triton pick GEMM kernels and split-K reductions by shape, so a token's
log-prob moves by a few roundings of logits of order one, up to ~1e-2. ``training_log_ppl`` (~3 here) averages that
over the batch: 5e-3 relative is ~2.5 unit roundoffs. ``pg_loss`` (r3) is -mean_t A_t ratio_t over the batch's
tokens (verl's ``token-mean``, GRPO advantages, |A| < 2 in groups of 4): the part -mean_t A_t is the same in both runs
(the same samples), the rest, A_t (ratio_t - 1) with ratio = pi / pi_old equal to 1 up to that noise (either sign),
averages to well under 1e-2 -- an absolute bound, since the loss itself is near 0 (a group's advantages sum to 0).

On GPU, vLLM runs batch-invariant (``VLLM_BATCH_INVARIANT=1``, compute capability >= 8.0/9.0, see vLLM's docs), so a
replica serving 1/N of the requests computes the same logits as one serving all; set ``VLLM_BATCH_INVARIANT=0`` in the
environment to see the check without it. Cross-run checks 3-4 are required at every step on CPU, at step 1 on GPU:
after the first bf16 update the runs' weights may part by a rounding, and then a later step may sample differently
(printed as INFO, not a failure; 4 still runs whenever the samples agree).

Run (one node with >= 8 GPUs, verl and vLLM installed):  python tests/gpu/check_data_parallel.py
Run (CPU runtime, hf rollout, several minutes):         python tests/gpu/check_data_parallel.py --device cpu --dp 2
Exit code 0 iff every check passed (2: the node cannot run the check).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REGIMES = ("r3", "r2")
R2_RECIPE = "minirl_n2_r2"
R2_MAX_TOKENS = 40  # token budget per micro-batch (actor and log-prob pass): sequences are up to 20 tokens
R3_MAX_TOKENS = 256
SAMPLE_KEYS = ("critic/score/mean", "response_length/mean")
SAMPLE_ABS = 1e-6  # the same samples: batch means equal up to float32 summation order
COVERAGE_KEYS = tuple(
    f"stable/routing/coverage/{k}"
    for k in ("response_rows", "response_replayed_rows", "prompt_rows", "prompt_replayed_rows")
)
DISAGREEMENT = "stable/routing/disagreement"
_UPDATE_DISAGREEMENT = re.compile(r"stable/routing/update_\d+/disagreement")
RESPONSE_REPLAYED = "stable/routing/coverage/response_replayed"
LOG_PPL = "rollout_corr/training_log_ppl"
PG_LOSS = "actor/pg_loss"
ROLLOUT_SERVER = {"cpu": "HFRolloutServer", "cuda": "vLLMHttpServer"}  # the Ray actor class of one rollout replica
ACTOR_RANK = "WorkerDict"  # verl's colocated worker: one per actor rank


@dataclass(frozen=True)
class Tolerance:
    """``|a - b| <= max(abs, rel * max(|a|, |b|))``."""

    rel: float
    abs: float

    def close(self, a: float, b: float) -> bool:
        return abs(a - b) <= max(self.abs, self.rel * max(abs(a), abs(b)))

    def __str__(self) -> str:
        return f"rel {self.rel:g}, abs {self.abs:g}"


TOLERANCES = {"cpu": Tolerance(rel=1e-5, abs=1e-6), "cuda": Tolerance(rel=5e-3, abs=1e-2)}  # why: module docstring


@dataclass(frozen=True)
class Check:
    status: str  # PASS | FAIL | INFO (INFO never fails the script)
    name: str
    detail: str = ""

    def line(self) -> str:
        return f"[{self.status}] {self.name}" + (f" - {self.detail}" if self.detail else "")


def _check(name: str, ok: bool, detail: str = "") -> Check:
    return Check("PASS" if ok else "FAIL", name, detail)


def _get(row: dict, key: str) -> float | None:
    value = row.get(key)
    return None if value is None else float(value)


def _fmt(value: float | None) -> str:
    return "missing" if value is None else f"{value:.9g}"


# ---------------------------------------------------------------------------------------------------- the comparison


def within_run(rows: Sequence[dict], *, label: str, steps: int, regime: str) -> list[Check]:
    """Checks of one run's per-step metrics that hold whatever the dp: all steps logged, exact replay, full coverage."""
    logged = [r.get("step") for r in rows]
    out = [_check(f"{label}: logged steps 1..{steps}", logged == list(range(1, steps + 1)), f"steps {logged}")]
    bad = []
    for row in rows:
        keys = [DISAGREEMENT, *sorted(k for k in row if _UPDATE_DISAGREEMENT.fullmatch(k))]
        bad += [f"step {row.get('step')} {k}={_fmt(_get(row, k))}" for k in keys if _get(row, k) != 0.0]
    out.append(
        _check(f"{label}: {DISAGREEMENT} == 0 (and update_<i>) at every step", bool(rows) and not bad, "; ".join(bad))
    )
    values = [_get(r, RESPONSE_REPLAYED) for r in rows]
    out.append(
        _check(
            f"{label}: {RESPONSE_REPLAYED} == 1.0 at every step",
            bool(rows) and all(v == 1.0 for v in values),
            ", ".join(_fmt(v) for v in values),
        )
    )
    if regime == "r2":
        two = [
            "stable/routing/update_1/disagreement" in r and "stable/routing/update_2/disagreement" not in r
            for r in rows
        ]
        out.append(_check(f"{label}: two update mini-steps per step (N = 2)", bool(rows) and all(two)))
    return out


def across_runs(
    one: Sequence[dict], many: Sequence[dict], *, label: str, regime: str, tol: Tolerance, strict_steps: int | None
) -> list[Check]:
    """Checks that the dp = N run (``many``) sampled, covered and computed what the dp = 1 run (``one``) did.

    Args:
        strict_steps: steps 1..strict_steps must sample the same (None: every step); a later step whose samples
            differ is reported as INFO and its coverage counts are not compared.
    """
    out = []
    if len(one) != len(many):
        out.append(_check(f"{label}: both runs logged the same steps", False, f"{len(one)} vs {len(many)} rows"))
    for row1, rown in zip(one, many, strict=False):
        step = row1.get("step")
        strict = strict_steps is None or (isinstance(step, int) and step <= strict_steps)
        pairs = {k: (_get(row1, k), _get(rown, k)) for k in SAMPLE_KEYS}
        same = all(a is not None and b is not None and abs(a - b) <= SAMPLE_ABS for a, b in pairs.values())
        detail = ", ".join(f"{k} {_fmt(a)} vs {_fmt(b)}" for k, (a, b) in pairs.items())
        if strict or same:
            out.append(_check(f"{label} step {step}: same samples at dp=1 and dp=N", same, detail))
        else:
            out.append(Check("INFO", f"{label} step {step}: samples parted after a bf16 update (not required)", detail))
            continue
        counts = {k: (_get(row1, k), _get(rown, k)) for k in COVERAGE_KEYS}
        ok = all(a is not None and a == b and a > 0 for a, b in counts.values())
        detail = ", ".join(f"{k.rsplit('/', 1)[1]} {_fmt(a)} vs {_fmt(b)}" for k, (a, b) in counts.items())
        out.append(_check(f"{label} step {step}: coverage rows summed over ranks equal dp=1's", ok, detail))
    if one and many:
        keys = (LOG_PPL, PG_LOSS) if regime == "r3" else (LOG_PPL,)
        for key in keys:
            a, b = _get(one[0], key), _get(many[0], key)
            ok = a is not None and b is not None and tol.close(a, b)
            diff = "" if a is None or b is None else f", |diff| {abs(a - b):.3g}"
            out.append(_check(f"{label} step 1: {key} equal ({tol})", ok, f"{_fmt(a)} vs {_fmt(b)}{diff}"))
    return out


def actor_pids(log: str, name: str) -> set[str]:
    """Distinct pids of the Ray actors of class ``name`` that wrote to the log (Ray prefixes ``(name pid=...)``)."""
    return set(re.findall(rf"\({re.escape(name)} pid=(\d+)[,)]", log))


def placement(logs: dict[int, str], *, label: str, device: str, dp: int) -> list[Check]:
    server = ROLLOUT_SERVER[device]
    ranks, replicas = len(actor_pids(logs[dp], ACTOR_RANK)), len(actor_pids(logs[dp], server))
    single = len(actor_pids(logs[1], server))
    return [
        _check(
            f"{label}: dp={dp} run placed {dp} actor ranks and {dp} rollout replicas, dp=1 one replica",
            ranks == dp and replicas == dp and single == 1,
            f"{ACTOR_RANK} {ranks}, {server} {replicas}; dp=1: {server} {single}",
        )
    ]


# --------------------------------------------------------------------------------------------------------- the runs


def gpu_runtime_overrides(batch_invariant: str) -> list[str]:
    """verl on one GPU node: FSDP2 actor ranks and verl's vLLM rollout, one GPU per rank and replica."""
    from verl_stable.toy.trainer_process import job_env_overrides

    return [
        "trainer.device=cuda",
        "trainer.nnodes=1",
        "actor_rollout_ref.actor.strategy=fsdp2",
        # padded sequences and sdpa, as on CPU: the attention path is not under test, and flash-attn stays optional
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.rollout.enforce_eager=True",  # a tiny model: no CUDA-graph capture time
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        *job_env_overrides({"VLLM_BATCH_INVARIANT": batch_invariant}),
    ]


def _key(item: str) -> str:
    return item.split("=", 1)[0].lstrip("+~")


def run_overrides(
    regime: str, *, device: str, dp: int, geometry_dp: int, assets: Any, steps: int, run_dir: Path
) -> list[str]:
    """main_ppo's arguments for one run: the regime on the tiny assets, ``dp`` actor ranks and rollout replicas.

    The CPU builders of :mod:`verl_stable.toy.launch` give the model, data, reward and geometry; on GPU their
    CPU-runtime settings (platform, fake GPUs, gloo, the ``hf`` rollout) are replaced by :func:`gpu_runtime_overrides`.
    The batch is sized by ``geometry_dp`` (the pair's larger dp), so both runs of a pair train on the same batch.
    """
    from verl_stable import recipes
    from verl_stable.toy import launch
    from verl_stable.transport.options import MANAGER_FQN

    head: list[str] = []
    if regime == "r3":
        prompts = max(4, geometry_dp)  # the batch is the mini-batch: one update per step
        ov = launch.cpu_overrides(
            assets, steps=steps, batch_size=prompts, precision="bf16", routing_capture=True, metrics_logger=("file",)
        )
    else:
        path = recipes.recipe_path("fsdp", R2_RECIPE)
        head = [f"--config-path={path.parent}", f"--config-name={path.stem}"]
        ov = launch.regime_overrides(R2_RECIPE, assets, steps=steps, mini_batch_prompts=max(2, geometry_dp))
    if device == "cuda":
        cpu_only = {_key(o) for o in (*launch.RUNTIME_OVERRIDES, *launch.engine_overrides("hf", "bf16", True))}
        batch_invariant = os.environ.get("VLLM_BATCH_INVARIANT", "1")
        ov = [o for o in ov if _key(o) not in cpu_only] + gpu_runtime_overrides(batch_invariant)
    ov += [
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        'trainer.logger=["file"]',
        f"trainer.n_gpus_per_node={dp}",
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER_FQN}",  # compact, seeded
        "+verl_stable.routing.share_prompt_rows_min_bytes=0",  # share every group: the path under test
        "trainer.balance_batch=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
    ]
    if regime == "r3":
        ov += [
            "+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3",
            "trainer.v1.trainer_mode=stable_sync",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={R3_MAX_TOKENS}",
        ]
    else:  # the recipe is R2 in stable_sync mode already
        ov += [
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={R2_MAX_TOKENS}",
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={R2_MAX_TOKENS}",
        ]
    if device == "cpu":
        ov.append(f"ray_kwargs.ray_init.num_gpus={dp}")  # one fake GPU per actor rank and rollout replica
    return head + ov


def compose(args: Sequence[str]) -> Any:
    """The config main_ppo would compose from ``args``, checked by :func:`verl_stable.recipes.preflight` (keys, verl's
    own ``validate_config`` with its batch arithmetic at this dp); raises ValueError before anything starts."""
    from verl_stable import recipes

    config = dict(a.removeprefix("--").split("=", 1) for a in args if a.startswith("--config-"))
    recipe = Path(config["config-path"]) / f"{config['config-name']}.yaml" if config else None
    return recipes.preflight([a for a in args if not a.startswith("--config-")], recipe=recipe)


def run_trainer(device: str, args: list[str], run_dir: Path, timeout_s: float) -> int:
    """``python -m verl.trainer.main_ppo args`` with its log and metrics in ``run_dir``; its exit code (124: timeout)."""
    from verl_stable.toy import trainer_process

    try:
        if device == "cpu":
            return trainer_process.run_main_ppo(args, run_dir, timeout_s=timeout_s).returncode
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.pop("VERL_PLATFORM", None)  # verl's own CUDA platform
        env.update(
            VERL_FILE_LOGGER_PATH=str(run_dir / "metrics.jsonl"),
            RAY_TMPDIR=str(trainer_process.ray_tmpdir(run_dir)),  # a Ray session of its own
            RAY_DEDUP_LOGS="0",  # every actor's lines, with its pid: the placement check counts them
        )
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args, *trainer_process.job_env(env, args)]
        with open(run_dir / "main_ppo.log", "w") as log:
            proc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        return proc.returncode
    except subprocess.TimeoutExpired:
        return 124


def device_problem(device: str, dp: int) -> str | None:
    """Why this machine cannot run the check in ``device`` mode at ``dp`` (None: it can)."""
    if device == "cpu":
        return None
    import importlib.util

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < dp:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return f"--dp {dp} needs {dp} CUDA devices on this node, found {found}"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dp", type=int, default=None, help="actor ranks and rollout replicas (cuda: 8, cpu: 2)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES)
    parser.add_argument("--workdir", default=None, help="assets and runs (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir's runs after a passing check")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per main_ppo run")
    args = parser.parse_args(argv)
    dp = args.dp if args.dp is not None else (8 if args.device == "cuda" else 2)
    if dp < 2 or args.steps < 1:
        parser.error("--dp must be >= 2 and --steps >= 1")
    problem = device_problem(args.device, dp)
    if problem:
        print(f"[FAIL] cannot run: {problem}")
        return 2

    from verl_stable.toy import launch
    from verl_stable.toy.assets import ensure_assets

    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vs_check_dp_")).resolve()
    made = [workdir / "assets", *(workdir / f"{regime}_dp{d}" for regime in args.regimes for d in (1, dp))]
    assets = ensure_assets(workdir / "assets", launch.asset_spec("vllm"))
    tol = TOLERANCES[args.device]
    strict_steps = None if args.device == "cpu" else 1
    checks: list[Check] = []

    def report(new: list[Check]) -> None:
        for c in new:
            print(c.line(), flush=True)
        checks.extend(new)

    print(f"device {args.device}, dp 1 vs {dp}, {args.steps} steps, workdir {workdir}", flush=True)
    for regime in args.regimes:
        label = f"{regime} dp=1|{dp}"
        rows, logs = {}, {}
        for d in (1, dp):
            run_dir = workdir / f"{regime}_dp{d}"
            ov = run_overrides(
                regime, device=args.device, dp=d, geometry_dp=dp, assets=assets, steps=args.steps, run_dir=run_dir
            )
            try:
                compose(ov)
            except ValueError as exc:
                report([_check(f"{regime} dp={d}: config composes and verl accepts it", False, str(exc))])
                rows[d], logs[d] = [], ""
                continue
            start = time.monotonic()
            code = run_trainer(args.device, ov, run_dir, args.timeout)
            took = time.monotonic() - start
            report([_check(f"{regime} dp={d}: main_ppo exited 0", code == 0, f"exit {code}, {took:.0f} s, {run_dir}")])
            metrics = run_dir / "metrics.jsonl"
            rows[d] = launch.read_metrics(metrics) if metrics.exists() else []
            logs[d] = (run_dir / "main_ppo.log").read_text(errors="ignore")
            if code != 0:
                print(logs[d][-3000:], flush=True)
            report(within_run(rows[d], label=f"{regime} dp={d}", steps=args.steps, regime=regime))
        report(placement(logs, label=label, device=args.device, dp=dp))
        report(across_runs(rows[1], rows[dp], label=label, regime=regime, tol=tol, strict_steps=strict_steps))

    failed = [c for c in checks if c.status == "FAIL"]
    passed = sum(c.status == "PASS" for c in checks)
    print(f"{passed}/{passed + len(failed)} checks passed" + (f"; {len(failed)} FAILED" if failed else ""))
    if failed or args.keep:
        print(f"runs kept in {workdir}")
    elif own_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    return 0 if passed and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
