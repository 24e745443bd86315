"""``verl-stable recipe``: bad names, malformed or unknown overrides are refused with a message, never a traceback.

``check`` answers with its verdict (exit 1 and one line per problem); ``path``, ``show`` and ``run-cpu`` refuse a
bad argument with exit code 2 before anything is composed, built or started.
"""

from __future__ import annotations

import pytest

from verl_stable import recipe_cli
from verl_stable import recipes as R
from verl_stable.toy import launch

EXPECTED_KEY = "expected a key of verl's ppo_trainer or of verl-stable"


def _refused(argv: list[str], capsys) -> str:
    """Run ``verl-stable recipe ARGV``, assert exit code 2; return stderr."""
    with pytest.raises(SystemExit) as info:
        recipe_cli.main(argv, out=lambda _: None)
    assert info.value.code == 2
    return capsys.readouterr().err


def _check(argv: list[str]) -> tuple[int, list[str]]:
    lines: list[str] = []
    return recipe_cli.main(["check", *argv], out=lines.append), lines


@pytest.fixture
def no_run(monkeypatch):
    """Building assets or starting verl fails the test."""

    def fail(*args, **kwargs):
        raise AssertionError("work started although the input should have been refused")

    monkeypatch.setattr(launch, "ensure_assets", fail)
    monkeypatch.setattr(launch, "run_main_ppo", fail)


# ------------------------------------------------------------------------------------------------ check: added keys
def test_check_reports_a_typo_behind_plus():
    rc, lines = _check(["fsdp/minirl_n4_r3", "+data.train_batchsize=512"])
    assert rc == 1
    assert f"  - unknown key data.train_batchsize (added by an override; {EXPECTED_KEY})" in lines
    assert lines[-1] == "fsdp/minirl_n4_r3: 1 problem(s)"


@pytest.mark.parametrize(
    "override",
    [
        "+verl_stable.routing.share_prompt_row=false",  # verl-stable's rollout-routing option, misspelt
        "+actor_rollout_ref.rollout.engine_kwargs.hf.precison=fp8",  # the hf backend's option, misspelt
        "+trainer.v1.trainer_mdoe=stable_sync",
    ],
)
def test_check_reports_typos_in_sections_verl_does_not_convert(override):
    rc, lines = _check(["fsdp/minirl_onpolicy", override])
    key = override.lstrip("+").split("=")[0]
    assert rc == 1 and f"  - unknown key {key} (added by an override; {EXPECTED_KEY})" in lines


def test_check_accepts_keys_verl_or_verl_stable_define():
    rc, lines = _check(
        [
            "fsdp/minirl_onpolicy",
            "+ray_kwargs.ray_init._temp_dir=/tmp/ray_x",  # passed whole to ray.init
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # an empty mapping in verl's YAML
            "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=a.B",  # a dataclass field verl's YAML omits
            "+actor_rollout_ref.rollout.engine_kwargs.hf.precision=fp8",
            "+verl_stable.routing.share_prompt_rows=false",
            "+verl_stable.routing.share_prompt_rows_min_bytes=0",
        ]
    )
    assert (rc, lines) == (0, ["fsdp/minirl_onpolicy: OK"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["+verl_stable.routing.on_invalid=bogus"], "verl_stable.routing.on_invalid must be one of"),
        (
            ["+verl_stable.routing.share_prompt_rows_min_bytes=-1"],
            "verl_stable.routing.share_prompt_rows_min_bytes must be >= 0, got int -1",
        ),
        (
            ["actor_rollout_ref.rollout.name=hf", "+actor_rollout_ref.rollout.engine_kwargs.hf.precision=fp9"],
            "hf rollout backend: unknown rollout precision 'fp9'; expected one of",
        ),
        (
            [
                "actor_rollout_ref.rollout.name=vllm",
                "+actor_rollout_ref.rollout.engine_kwargs.vllm.corrupt_routing_every=-2",
            ],
            "vllm rollout: actor_rollout_ref.rollout.engine_kwargs.vllm.corrupt_routing_every (fault injection) must be >= 0",
        ),
    ],
)
def test_check_reports_bad_values_of_verl_stable_options(overrides, expected):
    rc, lines = _check(["fsdp/minirl_onpolicy", *overrides])
    assert rc == 1 and any(expected in line for line in lines), lines


def test_check_reports_an_override_that_does_not_compose():
    rc, lines = _check(["fsdp/minirl_onpolicy", "data.train_batchsize=512"])  # no '+': hydra refuses
    assert rc == 1
    assert lines[0].startswith("  - the overrides do not compose on the recipe: ConfigCompositionException")
    assert "data.train_batchsize" in lines[0]


def test_unknown_override_keys_library_function():
    assert R.unknown_override_keys("fsdp", "vespo", ["+data.train_batchsize=1", "data.train_batch_size=8"]) == [
        "data.train_batchsize"
    ]


@pytest.mark.parametrize(
    ("key", "known"),
    [
        ("data.train_batch_size", True),
        ("data.train_batchsize", False),
        ("ray_kwargs.ray_init.num_gpus", True),
        ("ray_kwargs.ray_init.runtime_env.env_vars.X", True),
        ("actor_rollout_ref.model.override_config.attn_implementation", True),
        ("actor_rollout_ref.rollout.agent.agent_loop_manager_class", True),
        ("actor_rollout_ref.rollout.agent.agent_loop_manager_clas", False),
        ("actor_rollout_ref.rollout.engine_kwargs.hf.max_batch_size", True),
        ("actor_rollout_ref.rollout.engine_kwargs.hf.max_batch", False),
        ("verl_stable.routing.on_invalid", True),
        ("verl_stable.routing.oninvalid", False),
        ("verl_stable.rooting.on_invalid", False),
        ("stable.monitor.anything", True),  # StableConfig checks it on conversion
        ("data.train_batch_size.x", False),  # below a scalar
        ("nonsense", False),
    ],
)
def test_is_known_key(key, known):
    assert R.is_known_key(R.compose_base("fsdp"), key) is known


# ------------------------------------------------------------------------------------------------ refusals (exit 2)
@pytest.mark.parametrize("action", ["path", "command", "show", "check", "run-cpu"])
def test_unknown_recipe_name_is_refused(action, capsys, no_run):
    err = _refused([action, "fsdp/minirl_n9"], capsys)
    assert "unknown regime 'minirl_n9'; known: ['minirl_onpolicy', 'minirl_n2_r2', 'minirl_n4_r3', 'vespo']" in err


def test_unknown_backend_is_refused(capsys):
    err = _refused(["check", "deepspeed/vespo"], capsys)
    assert "unknown backend 'deepspeed'; known: ['fsdp', 'megatron']" in err


@pytest.mark.parametrize("action", ["show", "check", "run-cpu"])
@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("data.train_batch_size", "missing EQUAL"),
        ("=512", "has no key"),
        ("a b=1", "is malformed"),
    ],
)
def test_override_that_is_not_key_value_is_refused(action, override, reason, capsys, no_run):
    err = _refused([action, "fsdp/vespo", override], capsys)
    assert f"override {override!r}" in err and reason in err
    assert "expected key=value, +key=value, ++key=value or ~key" in err


@pytest.mark.parametrize("action", ["list", "show", "check"])
def test_an_unknown_option_is_refused(action, capsys):
    err = _refused([action, *(["fsdp/vespo"] if action != "list" else []), "--steps=3"], capsys)
    assert "unrecognized arguments: --steps=3" in err


def test_show_refuses_an_override_that_does_not_compose(capsys):
    err = _refused(["show", "fsdp/vespo", "data.nope=1"], capsys)
    assert "the overrides do not compose on fsdp/vespo: ConfigCompositionException" in err and "data.nope" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
        (["--steps", "x"], "argument --steps: expected an integer >= 1, got 'x'"),
        (
            ["+data.train_batchsize=512"],
            "unknown config key(s) ['data.train_batchsize']: expected keys of verl's ppo_trainer or of verl-stable",
        ),
        (["data.nope=1"], "the overrides do not compose on recipe"),
        (
            ["+actor_rollout_ref.rollout.engine_kwargs.hf.precision=fp9"],
            "hf rollout backend: unknown rollout precision 'fp9'; expected one of",
        ),
    ],
)
def test_run_cpu_refuses_before_anything_is_built(tmp_path, capsys, no_run, args, expected):
    err = _refused(["run-cpu", "fsdp/vespo", "--workdir", str(tmp_path / "w"), *args], capsys)
    assert expected in err
    assert not (tmp_path / "w").exists()


def test_run_cpu_refuses_an_unknown_rollout_engine(tmp_path, capsys, no_run):
    err = _refused(["run-cpu", "megatron/minirl_n4_r3", "--engine", "sglang", "--workdir", str(tmp_path / "w")], capsys)
    assert "argument --engine: invalid choice: 'sglang' (choose from 'hf', 'vllm')" in err
    assert not (tmp_path / "w").exists()


def test_run_cpu_with_vllm_builds_the_assets_vllm_serves(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "ensure_assets", lambda path, spec: seen.update(spec=spec))
    monkeypatch.setattr(launch, "run_main_ppo", lambda args, *a, **k: seen.update(args=args) or _Done())
    assert launch.run_recipe("minirl_n4_r3", tmp_path / "w", backend="megatron", engine="vllm") == 0
    assert seen["spec"] == launch.asset_spec("vllm", actor="megatron")  # head size 32; a pad row Megatron can train
    assert "actor_rollout_ref.rollout.name=vllm" in seen["args"]
    assert "--config-name=minirl_n4_r3" in seen["args"]


class _Done:
    returncode = 0


def test_run_cpu_refuses_a_file_as_workdir(tmp_path, capsys, no_run):
    target = tmp_path / "f"
    target.write_text("x")
    err = _refused(["run-cpu", "vespo", "--workdir", str(target)], capsys)
    assert f"workdir {target} is a file; expected a directory" in err


def test_run_recipe_refuses_bad_arguments(tmp_path, no_run):
    with pytest.raises(ValueError, match=r"steps must be an integer >= 1, got 0"):
        launch.run_recipe("vespo", tmp_path, steps=0)
    with pytest.raises(ValueError, match=r"unknown task 'sort'; expected one of \('copy', 'add', 'max'\)"):
        launch.run_recipe("vespo", tmp_path, task="sort")
    with pytest.raises(ValueError, match="unknown regime"):
        launch.run_recipe("minirl_n9", tmp_path)


def test_run_cpu_refuses_what_verls_conversion_would_reject_at_run_time(tmp_path, capsys, no_run):
    err = _refused(["run-cpu", "vespo", "--workdir", str(tmp_path), "+stable.monitor.entropy_windw=3"], capsys)
    # verl-stable's own section is refused by its schema, before verl's conversion, naming the key and the known ones
    assert "stable.monitor.entropy_windw: unknown key (known: enable, entropy_window," in err


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
@pytest.mark.parametrize("regime", list(R.REGIMES))
def test_run_cpu_preflight_accepts_every_shipped_recipe(tmp_path, monkeypatch, regime, backend):
    """The checks pass the real CPU argument list of both back ends; overrides after options reach verl, last."""
    import subprocess

    calls: list[list[str]] = []
    monkeypatch.setattr(launch, "ensure_assets", lambda root, spec=None: launch.asset_paths(root))
    monkeypatch.setattr(
        launch, "run_main_ppo", lambda args, workdir: calls.append(list(args)) or subprocess.CompletedProcess(args, 0)
    )
    argv = [
        "run-cpu",
        f"{backend}/{regime}",
        "--workdir",
        str(tmp_path),
        "--steps",
        "1",
        "trainer.val_before_train=True",
    ]
    assert recipe_cli.main(argv, out=lambda _: None) == 0
    assert calls and calls[0][-1] == "trainer.val_before_train=True"
    assert (f"--config-path={R.recipes_dir() / backend}") in calls[0]
    if backend == "megatron":  # the CPU actor's settings, none of the FSDP actor's
        assert "actor_rollout_ref.actor.megatron.vanilla_mbridge=True" in calls[0]
        assert "actor_rollout_ref.model.use_remove_padding=True" in calls[0]
        assert not [a for a in calls[0] if a.startswith("actor_rollout_ref.actor.strategy=")]


# ------------------------------------------------------------------------------------------------ untrusted recipe dirs
def test_list_with_a_recipes_dir_that_is_not_one_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(R.RECIPES_ENV, str(tmp_path))
    err = _refused(["list"], capsys)
    assert f"{R.RECIPES_ENV}={tmp_path} is not a verl-stable recipes directory (no fsdp/ in it)" in err


def test_list_with_a_recipe_missing_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "fsdp").mkdir()
    monkeypatch.setenv(R.RECIPES_ENV, str(tmp_path))
    err = _refused(["list"], capsys)
    assert "recipe fsdp/minirl_onpolicy is missing: " in err


def test_check_of_a_recipe_file_that_is_not_a_mapping_reports_it(tmp_path, monkeypatch):
    import shutil

    shutil.copytree(R.recipes_dir() / "fsdp", tmp_path / "fsdp")
    (tmp_path / "fsdp" / "vespo.yaml").write_text("- a\n- b\n")
    monkeypatch.setenv(R.RECIPES_ENV, str(tmp_path))
    rc, lines = _check(["fsdp/vespo"])
    assert rc == 1
    assert lines[0].startswith(f"  - cannot read the recipe {tmp_path / 'fsdp' / 'vespo.yaml'}: ")
    assert lines[-1].startswith("fsdp/vespo: ") and lines[-1].endswith("problem(s)")


@pytest.mark.parametrize("name", ["w,1", "w=1", "w{1}", "wörk"])
def test_run_cpu_refuses_a_workdir_hydra_cannot_carry(tmp_path, capsys, no_run, name):
    err = _refused(["run-cpu", "vespo", "--workdir", str(tmp_path / name)], capsys)
    assert f"workdir {str(tmp_path / name)!r} cannot be passed to verl in a hydra override; expected a path" in err


def test_run_cpu_refuses_a_workdir_below_a_file(tmp_path, capsys, no_run):
    (tmp_path / "f").write_text("mine")
    err = _refused(["run-cpu", "vespo", "--workdir", str(tmp_path / "f" / "w")], capsys)
    assert f"workdir {tmp_path / 'f' / 'w'} lies below the file {tmp_path / 'f'}; expected a directory" in err


@pytest.mark.parametrize(
    ("override", "bad"),
    [
        ("actor_rollout_ref.actor.clip_ratio_low=1.0", "eps_low=1.0"),  # lower ratio bound 0: the monitor refuses it
        ("actor_rollout_ref.actor.clip_ratio_high=-0.1", "eps_high=-0.1"),
    ],
)
def test_run_cpu_refuses_a_trust_region_the_monitor_would_reject_at_the_first_update(
    tmp_path, capsys, no_run, override, bad
):
    err = _refused(["run-cpu", "minirl_n4_r3", "--workdir", str(tmp_path), override], capsys)
    assert "actor.clip_ratio_low / clip_ratio_high (the trust region): need 0 <= eps_low < 1" in err and bad in err


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
    ],
)
def test_run_cpu_refuses_ulysses_which_would_attend_per_slice_on_cpu(tmp_path, capsys, no_run, override):
    err = _refused(["run-cpu", "minirl_n4_r3", "--workdir", str(tmp_path), override], capsys)
    assert "Ulysses sequence parallelism" in err and "on the CPU runtime" in err and "sequence parallel size 1" in err
    # the message names the fix: the packed run with the varlen kernel
    assert "actor_rollout_ref.model.use_remove_padding=True" in err and "attn_implementation=verl_stable_varlen" in err


ULYSSES_SP2 = [
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "trainer.n_gpus_per_node=2",
    "ray_kwargs.ray_init.num_gpus=2",
]


@pytest.mark.parametrize(
    "attention",
    [
        # packed with sdpa or eager: still per-slice attention
        [
            "actor_rollout_ref.model.use_remove_padding=True",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        ],
        [
            "actor_rollout_ref.model.use_remove_padding=True",
            "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        ],
        # the kernel without packing: verl's Ulysses path needs use_remove_padding
        [
            "actor_rollout_ref.model.use_remove_padding=False",
            "+actor_rollout_ref.model.override_config.attn_implementation=verl_stable_varlen",
        ],
    ],
)
def test_preflight_refuses_ulysses_on_cpu_without_the_packed_varlen_kernel(attention):
    overrides = [o for o in launch.cpu_overrides(launch.asset_paths("/tmp/unused")) if "attn_implementation" not in o]
    with pytest.raises(ValueError, match=r"Ulysses sequence parallelism .* on the CPU runtime") as info:
        R.preflight([*overrides, *attention, *ULYSSES_SP2])
    assert "use verl-stable's varlen kernel" in str(info.value)


def test_preflight_accepts_ulysses_on_cpu_with_the_packed_varlen_kernel():
    from verl_stable.cpu import attention
    from verl_stable.recipes.validate import ULYSSES_CPU_ATTENTION

    overrides = launch.cpu_overrides(launch.asset_paths("/tmp/unused"), attention="varlen")
    cfg = R.preflight([*overrides, *ULYSSES_SP2])
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    # the preflight's notion of "the kernel" is the CPU runtime's overrides
    expected = {f"{'+' if 'override_config' in k else ''}{k}={v}" for k, v in ULYSSES_CPU_ATTENTION.items()}
    assert expected == set(attention.OVERRIDES)


def test_run_cpu_refuses_a_workdir_in_a_symlink_loop(tmp_path, capsys, no_run):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    err = _refused(["run-cpu", "fsdp/vespo", "--workdir", str(tmp_path / "a")], capsys)
    assert f"workdir {tmp_path / 'a'} cannot be resolved (it runs into a symlink loop)" in err
    assert "Traceback" not in err
