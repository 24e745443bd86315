"""The recipes compose on verl 0.9.1's real hydra config, convert to verl's config dataclasses, and are their regime.

Every recipe in ``recipes/{fsdp,megatron}/`` is composed with hydra's compose API exactly as
``python -m verl.trainer.main_ppo --config-path=... --config-name=...`` composes it, run through verl's own
``validate_config`` (what ``main_ppo`` runs first) and converted with verl's ``omega_conf_to_dataclass`` (what verl's
workers do). The values that define each regime are read back from the *dataclasses* and compared with a table
written here independently of :mod:`verl_stable.recipes`. A typo anywhere in a recipe must fail: deliberately broken
copies are composed and must be rejected. The same regimes are composed for the CPU runtime; one end-to-end run of a
recipe through verl's trainer on CPU is marked ``e2e``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from omegaconf import OmegaConf

from verl_stable import recipe_cli
from verl_stable import recipes as R
from verl_stable.cpu.megatron import options as megatron_options
from verl_stable.toy import launch

CHECKOUT = Path(__file__).resolve().parents[2]

# regime -> (loss_mode, N, router_replay.mode, rollout routing export): the paper's table (arXiv 2512.01374 + VESPO)
EXPECTED = {
    "minirl_onpolicy": ("minirl", 1, "disabled", False),
    "minirl_n2_r2": ("minirl", 2, "R2", False),
    "minirl_n4_r3": ("minirl", 4, "R3", True),
    "vespo": ("vespo", 8, "disabled", False),
}
ALL = [(backend, regime) for backend in ("fsdp", "megatron") for regime in EXPECTED]
IDS = [f"{b}/{r}" for b, r in ALL]


@pytest.fixture(scope="module")
def composed():
    return {(b, r): R.compose_recipe(b, r) for b, r in ALL}


@pytest.fixture(scope="module")
def converted(composed):
    return {key: R.verl_configs(cfg, validate=True) for key, cfg in composed.items()}


@pytest.fixture(scope="module")
def bases():
    return {backend: R.compose_base(backend) for backend in ("fsdp", "megatron")}


def test_module_table_matches_the_paper_table():
    assert list(R.REGIMES) == list(EXPECTED)
    for name, (loss, n, replay, export) in EXPECTED.items():
        r = R.REGIMES[name]
        assert (r.loss_mode, r.staleness, r.router_replay, r.rollout_routing_export) == (loss, n, replay, export)
        assert r.train_batch_size == 64 * n
        assert r.accepts_staleness(n)
    assert not R.REGIMES["minirl_onpolicy"].accepts_staleness(2)
    assert not R.REGIMES["minirl_n4_r3"].accepts_staleness(3)
    assert R.REGIMES["minirl_n4_r3"].accepts_staleness(8)
    assert not R.REGIMES["minirl_n4_r3"].accepts_staleness(4.5)


def test_every_regime_has_a_recipe_for_each_backend():
    listed = R.list_recipes()
    assert [(b, r) for b, r, _ in listed] == ALL
    for backend, regime, path in listed:
        assert path == R.recipes_dir() / backend / f"{regime}.yaml" and path.is_file()
        assert R.recipe_base(path) == {"fsdp": "ppo_trainer", "megatron": "ppo_megatron_trainer"}[backend]
        # the searchpath is declared in the recipe itself, so verl's main_ppo composes it with --config-path only
        raw = OmegaConf.load(path)
        assert list(raw.hydra.searchpath) == ["pkg://verl.trainer.config"]


@pytest.mark.parametrize(("backend", "regime"), ALL, ids=IDS)
def test_recipe_composes_on_verls_trainer_config(composed, backend, regime):
    cfg = composed[(backend, regime)]
    # verl's own defaults are there (the recipe is an overlay, not a copy) ...
    assert cfg.trainer.device == "cuda" and cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.actor_rollout_ref.actor.strategy == {"fsdp": "fsdp", "megatron": "megatron"}[backend]
    # ... and main_ppo's own check passes
    assert R.regime_mismatches(cfg, regime) == []


@pytest.mark.parametrize(("backend", "regime"), ALL, ids=IDS)
def test_recipe_sets_only_keys_verl_knows(bases, backend, regime):
    assert R.unknown_recipe_keys(R.recipe_path(backend, regime), bases[backend]) == []


@pytest.mark.parametrize(("backend", "regime"), ALL, ids=IDS)
def test_regime_values_in_verls_dataclasses(composed, converted, backend, regime):
    from verl.trainer.config import AlgoConfig
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config import EngineRouterReplayConfig, FSDPActorConfig, McoreActorConfig, RolloutConfig

    from verl_stable.integration.losses import StablePolicyLossConfig
    from verl_stable.monitor.guard import Guard

    loss, n, replay, export = EXPECTED[regime]
    cfg, v = composed[(backend, regime)], converted[(backend, regime)]
    actor = v.actor
    assert isinstance(actor, {"fsdp": FSDPActorConfig, "megatron": McoreActorConfig}[backend])
    assert isinstance(v.rollout, RolloutConfig) and isinstance(v.algorithm, AlgoConfig)
    assert isinstance(v.rollout_correction, RolloutCorrectionConfig)

    # loss, trust region, aggregation, no KL, entropy for the monitor
    assert isinstance(actor.policy_loss, StablePolicyLossConfig)
    assert actor.policy_loss.loss_mode == loss
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.27)
    assert actor.loss_agg_mode == "seq-mean-token-sum"
    assert not actor.use_kl_loss and actor.entropy_coeff == 0 and actor.calculate_entropy
    if loss == "minirl":
        assert actor.policy_loss.minirl.allow_missing_rollout_is_weights is False
    else:
        k = actor.policy_loss.vespo
        assert (k.c1_pos, k.c2_pos, k.c1_neg, k.c2_neg) == (2.0, 3.0, 3.0, 2.0)

    # routing replay in the engine config the engine reads (actor.engine is fsdp_config / megatron)
    assert isinstance(actor.engine.router_replay, EngineRouterReplayConfig)
    assert actor.engine.router_replay.mode == replay
    assert v.rollout.enable_rollout_routing_replay is export

    # estimator and rollout correction: w = min(pi_old / mu, 5) per token, pi_old recomputed (decoupled)
    assert v.algorithm.adv_estimator == "minirl" and not v.algorithm.use_kl_in_reward
    rc = v.rollout_correction
    assert (rc.rollout_is, float(rc.rollout_is_threshold), rc.rollout_rs, rc.bypass_mode) == ("token", 5.0, None, False)
    assert v.rollout.calculate_log_probs

    # the paper's geometry: mini-batch 64 prompts x 16 samples, N mini-batches per rollout batch
    assert actor.ppo_mini_batch_size == 64 and actor.ppo_epochs == 1 and v.rollout.n == 16
    assert cfg.data.train_batch_size == 64 * n
    assert cfg.data.train_batch_size // actor.ppo_mini_batch_size == n

    # monitor and guard: the monitored trainer, the guard's rules built from the recipe's block
    assert cfg.trainer.v1.trainer_mode == "stable_sync"
    assert v.stable.monitor.enable and v.stable.guard_enable
    rules = {r.name: r for r in Guard.from_config(v.stable.guard).rules}
    assert rules["entropy_collapse"].threshold == 0.25 and rules["entropy_collapse"].action == "stop_checkpoint"
    assert rules["train_inference_kl"].threshold == 0.01 and rules["train_inference_kl"].action == "stop"


def test_the_monitored_trainer_mode_is_one_verl_stable_registers():
    from verl_stable.integration import trainer

    assert R.TRAINER_MODE.removeprefix("stable_") in trainer.BASE_TRAINERS


@pytest.mark.parametrize("loss_mode", ["minirl", "vespo"])
def test_loss_and_estimator_of_the_recipes_are_registered_in_verl(loss_mode):
    import verl  # noqa: F401 - loads the verl.plugins entry point
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    from verl_stable.integration import advantages, losses

    assert get_policy_loss_fn(loss_mode) is losses.POLICY_LOSSES[loss_mode]
    assert get_adv_estimator_fn(R.ADV_ESTIMATOR) is advantages.ADVANTAGE_ESTIMATORS[R.ADV_ESTIMATOR]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.train_batch_size=256", "staleness N"),
        ("actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3", "router_replay.mode"),
        ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "loss_agg_mode"),
        ("algorithm.rollout_correction.rollout_is_threshold=2.0", "rollout_is_threshold"),
        ("algorithm.rollout_correction.bypass_mode=true", "bypass_mode"),
        ("actor_rollout_ref.actor.clip_ratio_high=0.2", "clip_ratio_high"),
        ("actor_rollout_ref.rollout.n=8", "rollout.n"),
        ("trainer.v1.trainer_mode=sync", "trainer_mode"),
    ],
)
def test_regime_check_names_what_an_override_breaks(composed, override, expected):
    cfg = copy.deepcopy(composed[("fsdp", "minirl_n2_r2")])
    key, value = override.split("=")
    OmegaConf.update(cfg, key, yaml.safe_load(value))
    problems = R.regime_mismatches(cfg, "minirl_n2_r2")
    assert len(problems) == 1 and expected in problems[0], problems


def test_scaling_n_keeps_the_r3_regime():
    cfg = R.compose_recipe("fsdp", "minirl_n4_r3", ["data.train_batch_size=512"])  # as a command-line override
    assert R.staleness(cfg) == 8 and R.regime_mismatches(cfg, "minirl_n4_r3") == []
    assert R.regime_mismatches(cfg, "minirl_n2_r2") != []


# ------------------------------------------------------------------------------------------------ unknown keys fail
def _broken_copy(tmp_path: Path, key: str, value) -> Path:
    """A copy of fsdp/minirl_n2_r2 with one more key (a typo), written where hydra composes it from."""
    raw = OmegaConf.load(R.recipe_path("fsdp", "minirl_n2_r2"))
    if key:
        OmegaConf.update(raw, key, value, force_add=True)
    path = tmp_path / "broken.yaml"
    OmegaConf.save(raw, path)
    return path


def _problems(path: Path) -> list[str]:
    problems = [f"unknown key {k}" for k in R.unknown_recipe_keys(path)]
    try:
        R.verl_configs(R.compose_file(path), validate=False)
    except Exception as exc:  # noqa: BLE001 - whatever verl raises is the rejection we want
        problems.append(f"{type(exc).__name__}: {exc}")
    return problems


def test_an_unmodified_copy_has_no_problems(tmp_path):
    assert _problems(_broken_copy(tmp_path, "", None)) == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        # converted by verl's workers: the frozen dataclasses reject the key
        ("actor_rollout_ref.actor.clip_ratio_hihg", 0.27),
        ("actor_rollout_ref.actor.fsdp_config.router_replay.mdoe", "R2"),
        ("actor_rollout_ref.rollout.enable_rollout_routing_replays", True),
        ("algorithm.adv_estimater", "minirl"),
        ("algorithm.rollout_correction.rollout_is_treshold", 5.0),
        # verl-stable's own sections, converted by its dataclasses
        ("actor_rollout_ref.actor.policy_loss.minirl.allow_missing_is_weights", True),
        ("stable.guard.rules.entropy_collapse.treshold", 0.2),
        ("stable.monitor.entropy_windw", 3),
        # sections verl never converts: only the comparison with verl's composed config catches these
        ("trainer.v1.trainer_mdoe", "stable_sync"),
        ("data.train_batch_sizes", 128),
        # a node whose dataclass has fields verl's YAML leaves out: only real fields pass
        ("actor_rollout_ref.rollout.agent.agent_loop_manager_clas", "x"),
    ],
)
def test_an_unknown_key_anywhere_in_a_recipe_fails(tmp_path, key, value):
    problems = _problems(_broken_copy(tmp_path, key, value))
    leaf = key.rsplit(".", 1)[1]
    assert problems and any(leaf in p for p in problems), problems


def test_a_dataclass_field_missing_from_verls_yaml_is_known(tmp_path):
    from verl_stable.transport.options import uses_compact_routing

    key = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
    manager = "verl_stable.integration.rollout.CompactRoutingAgentLoopManagerTQ"
    assert _problems(_broken_copy(tmp_path, key, manager)) == []
    cfg = R.compose_file(R.recipe_path("fsdp", "minirl_n4_r3"))
    assert OmegaConf.select(cfg, key) == manager and uses_compact_routing(cfg)  # R3 moves routing compact
    assert not uses_compact_routing(R.compose_file(R.recipe_path("fsdp", "minirl_n2_r2")))


def test_verls_conversion_itself_rejects_an_unknown_actor_key(tmp_path):
    cfg = R.compose_file(_broken_copy(tmp_path, "actor_rollout_ref.actor.clip_ratio_hihg", 0.27))
    from verl.utils.config import omega_conf_to_dataclass

    with pytest.raises(Exception, match="clip_ratio_hihg"):
        omega_conf_to_dataclass(OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref.actor, resolve=True)))


def test_bad_names_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown regime"):
        R.recipe_path("fsdp", "minirl_n3")
    with pytest.raises(ValueError, match="unknown backend"):
        R.parse_recipe_name("deepspeed/minirl_n2_r2")
    assert R.parse_recipe_name("minirl_n2_r2") == ("fsdp", "minirl_n2_r2")
    assert R.parse_recipe_name("megatron/vespo.yaml") == ("megatron", "vespo")
    checkout = CHECKOUT / "recipes"
    assert R.recipes_dir() == checkout
    monkeypatch.setenv(R.RECIPES_ENV, str(tmp_path))  # set, but no recipes there: an error, not a silent fallback
    with pytest.raises(FileNotFoundError, match=R.RECIPES_ENV):
        R.recipes_dir()
    monkeypatch.setenv(R.RECIPES_ENV, str(checkout))
    assert R.recipes_dir() == checkout
    monkeypatch.delenv(R.RECIPES_ENV)
    raw = OmegaConf.load(R.recipe_path("fsdp", "vespo"))
    raw.defaults = ["_self_"]
    OmegaConf.save(raw, tmp_path / "nobase.yaml")
    with pytest.raises(ValueError, match="defaults must list exactly one"):
        R.recipe_base(tmp_path / "nobase.yaml")


def test_cli(capsys):
    assert recipe_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == len(ALL) and "megatron/minirl_n4_r3" in out
    assert recipe_cli.main(["command", "megatron/vespo"]) == 0
    assert capsys.readouterr().out.split()[-1] == "--config-name=vespo"
    assert recipe_cli.main(["check", "fsdp/minirl_onpolicy"]) == 0
    assert recipe_cli.main(["check", "fsdp/minirl_onpolicy", "data.train_batch_size=128"]) == 1
    assert "staleness N" in capsys.readouterr().out


def test_python_m_verl_stable_recipes_runs_the_recipe_command():
    """Launch scripts and the docs run ``python -m verl_stable.recipes``; it is ``verl-stable recipe``."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "verl_stable.recipes", "path", "fsdp/vespo"], capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == str(R.recipe_path("fsdp", "vespo"))


# ------------------------------------------------------------------------------------------------ launch scripts
LAUNCH = CHECKOUT / "recipes" / "launch"
ARGV_SHIM = """#!/bin/sh
for a in "$@"; do printf '%s\\n' "$a"; done > "$ARGV_OUT"
"""


def _launch_argv(tmp_path: Path, script: str, *args: str, **env: str) -> tuple[int, list[str]]:
    """Run a launch script with a ``python3`` shim first on PATH that records its argv instead of training."""
    import subprocess

    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "python3").write_text(ARGV_SHIM)
    (shim / "python3").chmod(0o755)
    out = tmp_path / "argv.txt"
    full_env = {**os.environ, **env, "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}", "ARGV_OUT": str(out)}
    proc = subprocess.run(["bash", str(LAUNCH / script), *args], env=full_env, capture_output=True, text=True)
    return proc.returncode, (out.read_text().splitlines() if out.exists() else [])


def _compose_launch(argv: list[str]):
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"], argv[:4]
    config_path = argv[2].removeprefix("--config-path=")
    config_name = argv[3].removeprefix("--config-name=")
    return R.compose_file(Path(config_path) / f"{config_name}.yaml", argv[4:]), Path(config_path).name, config_name


@pytest.mark.parametrize(
    ("script", "regime", "n", "gpus"),
    [
        ("qwen3_30b_a3b_fsdp.sh", "minirl_onpolicy", None, 32),
        ("qwen3_30b_a3b_fsdp.sh", "minirl_n2_r2", None, 32),
        ("qwen3_30b_a3b_fsdp.sh", "minirl_n4_r3", "8", 32),
        ("qwen3_30b_a3b_fsdp.sh", "vespo", None, 32),
        ("qwen3_30b_a3b_megatron.sh", "minirl_n4_r3", None, 32),
        ("small_moe_fsdp.sh", "minirl_n2_r2", None, 8),
    ],
)
def test_launch_script_composes_into_its_regime_with_the_paper_geometry(tmp_path, script, regime, n, gpus):
    env = {"N": n} if n else {}
    rc, argv = _launch_argv(tmp_path, script, regime, "trainer.total_training_steps=7", **env)
    assert rc == 0 and argv
    cfg, backend, name = _compose_launch(argv)  # hydra refuses any override key verl's config lacks
    assert (backend, name) == ("megatron" if "megatron" in script else "fsdp", regime)
    assert R.regime_mismatches(cfg, regime) == []  # with the paper's 64 x 16 mini-batch
    expected_n = int(n) if n else EXPECTED[regime][1]
    assert R.staleness(cfg) == expected_n and cfg.data.train_batch_size == 64 * expected_n
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == gpus
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.trainer.total_training_steps == 7  # extra args win
    if script.startswith("qwen3_30b_a3b"):
        assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-30B-A3B"
        assert cfg.data.max_prompt_length + cfg.data.max_response_length == 32768  # 32k tokens
        assert cfg.actor_rollout_ref.rollout.quantization == "fp8"  # FP8 inference ...
        assert cfg.actor_rollout_ref.actor.get("fsdp_config", {}).get("dtype", "bfloat16") == "bfloat16"  # BF16 train
        assert cfg.stable.monitor.num_experts == 128
    v = R.verl_configs(cfg)  # and verl accepts it
    assert v.actor.engine.router_replay.mode == EXPECTED[regime][2]


def test_launch_script_refuses_an_n_outside_the_regime(tmp_path):
    rc, argv = _launch_argv(tmp_path, "qwen3_30b_a3b_fsdp.sh", "minirl_n4_r3", N="2")
    assert rc == 2 and argv == []
    rc, argv = _launch_argv(tmp_path, "small_moe_fsdp.sh", "minirl_n9")
    assert rc == 2 and argv == []


def test_cpu_launch_script_runs_the_recipe_cli(tmp_path):
    rc, argv = _launch_argv(tmp_path, "cpu_tiny_moe.sh", "minirl_n4_r3", "trainer.total_training_steps=1", STEPS="2")
    assert rc == 0
    assert argv[:3] == ["-m", "verl_stable.recipes", "run-cpu"]
    assert argv[-4:] == ["--steps", "2", "minirl_n4_r3", "trainer.total_training_steps=1"]


# ------------------------------------------------------------------------------------------------ the CPU runtime
FAKE_ASSETS = SimpleNamespace(model_dir="/nonexistent/model", train_file="/nonexistent/t.parquet", val_file="/v")


@pytest.mark.parametrize("regime", list(EXPECTED))
def test_cpu_version_of_each_regime_keeps_n_loss_and_replay(regime):
    loss, n, replay, export = EXPECTED[regime]
    overrides = launch.regime_overrides(regime, FAKE_ASSETS, mini_batch_prompts=2, group_size=4)
    cfg = R.compose_recipe("fsdp", regime, overrides)
    # the CPU runtime's settings ...
    assert cfg.trainer.device == "cpu" and cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.model.path == "/nonexistent/model"
    # ... with the regime unchanged except the (scaled-down) geometry
    assert R.regime_mismatches(cfg, regime, paper_geometry=False) == []
    assert R.staleness(cfg) == n and cfg.data.train_batch_size == 2 * n
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 2 and cfg.actor_rollout_ref.rollout.n == 4
    v = R.verl_configs(cfg)
    assert v.actor.policy_loss.loss_mode == loss and v.actor.engine.router_replay.mode == replay
    assert v.rollout.enable_rollout_routing_replay is export and v.algorithm.adv_estimator == "minirl"


def test_cpu_overrides_of_the_megatron_actor_replace_the_fsdp_ones_and_an_unknown_backend_is_refused():
    fsdp = launch.regime_overrides("vespo", FAKE_ASSETS, backend="fsdp")
    megatron = launch.regime_overrides("vespo", FAKE_ASSETS, backend="megatron")
    assert "actor_rollout_ref.actor.strategy=fsdp2" in fsdp
    assert not [
        o
        for o in megatron
        if o.startswith(("actor_rollout_ref.actor.strategy=", "actor_rollout_ref.model.use_remove_padding=False"))
    ]
    for option in megatron_options.overrides():
        assert option in megatron
    # the rest (data, rollout, geometry) is the same for both back ends
    assert [o for o in fsdp if not o.startswith(launch.FSDP_ONLY_KEYS)] == [
        o for o in megatron if o not in megatron_options.overrides()
    ]
    with pytest.raises(ValueError, match=r"backend must be one of \('fsdp', 'megatron'\)"):
        launch.regime_overrides("vespo", FAKE_ASSETS, backend="deepspeed")


# The minirl_n2_r2 recipe runs end to end through verl's main_ppo in tests/integration/test_data_parallel_r2_e2e.py
# (at dp = 1 and 2), which checks the minirl loss, token IS weights, R2 replay and the monitor on it.
