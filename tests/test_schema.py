"""The typed schema of verl-stable's keys: strict types, switches that mean what they say, one reading everywhere.

Each issue case is checked at the runtime reader that uses the key (the monitored trainer's ``StableConfig``, the
routing workers' options, the ``hf`` / vLLM servers' options, the losses' config sections) and at preflight, which
must refuse exactly what the runtime refuses, naming the key. A property test feeds random YAML scalars to every key
of every section: each is either refused with the key named or read as exactly the value given.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_stable import schema
from verl_stable.backends.hf.options import resolve_options
from verl_stable.backends.vllm_cpu.rollout import VllmCpuError, routing_fault_every
from verl_stable.monitor.guard import Guard
from verl_stable.monitor.step import MonitorConfig, StableConfig, StepMonitor
from verl_stable.routing.codecs import ON_INVALID
from verl_stable.schema import ConfigError
from verl_stable.transport.options import RolloutRoutingOptions

LOSS = "actor_rollout_ref.actor.policy_loss"


# --- the issue's silent cases: quoted booleans and lists, switches written as false -------------------------------


@pytest.mark.parametrize("quoted", ["false", "False", "off", "no", "0", "true"])
def test_a_quoted_boolean_is_refused_by_every_reader(quoted):
    with pytest.raises(ConfigError, match=r"engine_kwargs\.hf\.sync_weights must be a bool"):
        resolve_options({"engine_kwargs": {"hf": {"sync_weights": quoted}}})
    with pytest.raises(ConfigError, match=r"verl_stable\.routing\.share_prompt_rows must be a bool"):
        RolloutRoutingOptions.from_config({"verl_stable": {"routing": {"share_prompt_rows": quoted}}})
    with pytest.raises(ConfigError, match=r"stable\.guard\.enable must be a bool"):
        StableConfig.from_dict({"guard": {"enable": quoted}})
    with pytest.raises(ConfigError, match=rf"{LOSS}\.minirl\.allow_missing_rollout_is_weights must be a bool"):
        _loss_config({"minirl": {"allow_missing_rollout_is_weights": quoted}})


def test_null_is_not_a_boolean():
    # it read as false before: a key written without a value must not switch anything off
    with pytest.raises(ConfigError, match=r"sync_weights must be a bool \(true/false\), got NoneType None"):
        resolve_options({"engine_kwargs": {"hf": {"sync_weights": None}}})


@pytest.mark.parametrize(
    ("block", "monitor_on", "guard_on"),
    [
        (False, False, False),
        (True, True, True),
        (None, True, True),
        ({"guard": False}, True, False),
        ({"monitor": False}, False, True),
        ({"monitor": False, "guard": False}, False, False),
        ({"guard": True, "monitor": True}, True, True),
    ],
)
def test_switches_written_as_false_turn_things_off(block, monitor_on, guard_on):
    config = StableConfig.from_dict(block)
    monitor = StepMonitor(config)
    assert config.monitor.enable is monitor_on
    assert (monitor.guard is not None) is guard_on
    if guard_on:  # the default rules, stop rules included, are there only when the guard is on
        assert {r.name for r in monitor.guard.rules} >= {"non_finite", "train_inference_kl"}


def test_a_string_is_not_a_list_of_taus():
    # tuple('25') would be (2.0, 5.0)
    with pytest.raises(ConfigError, match=r"stable\.monitor\.taus must be a list, got str '25'"):
        StableConfig.from_dict({"monitor": {"taus": "25"}})
    assert StableConfig.from_dict({"monitor": {"taus": [2, 5]}}).monitor.taus == (2.0, 5.0)


# --- preflight says yes, the run dies later: each is now refused where the runtime reads it --------------------------


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"monitor": {"taus": [0.5]}}, r"stable\.monitor\.taus\.0 must be > 1"),
        (
            {"monitor": {"taus": [2, 2.0000001]}},
            r"stable\.monitor\.taus must print distinctly as extreme_frac_tau<tau:g> \(they give \['2', '2'\]\)",
        ),
        ({"monitor": {"entropy_window": 2.5}}, r"stable\.monitor\.entropy_window must be an int, got float 2\.5"),
        ({"monitor": {"entropy_window": 10**9}}, r"stable\.monitor\.entropy_window must be <= 100000"),
        ({"monitor": {"routing_interval": 0.5}}, r"stable\.monitor\.routing_interval must be an int"),
        ({"monitor": {"replay_metrics_interval": True}}, r"stable\.monitor\.replay_metrics_interval must be an int"),
        ({"monitor": {"replay_metrics_interval": -2}}, r"stable\.monitor\.replay_metrics_interval must be >= 0"),
        ({"monitor": {"num_experts": 0}}, r"stable\.monitor\.num_experts must be >= 1"),
        ({"monitor": {"num_experts": "8"}}, r"stable\.monitor\.num_experts must be an int, got str"),
        ({"guard": {"rules": {"entropy_collapse": {"window": 10**20}}}}, r"entropy_collapse\.window must be <= "),
        (5, r"^stable must be a mapping of options \(or true / false\), got int 5$"),
        ({"monitr": {}}, r"stable\.monitr: unknown key \(known: guard, monitor\)"),
    ],
)
def test_the_stable_block_is_refused_at_startup_naming_the_key(block, message):
    with pytest.raises(ConfigError, match=message):
        StableConfig.from_dict(block)


def test_a_guard_window_the_schema_accepts_can_be_built():
    # the bound exists because the runtime builds a deque of that length: the largest accepted one must build
    guard = Guard.from_config({"rules": {"entropy_collapse": {"window": schema.MAX_WINDOW}}})
    assert {r.name: r.window for r in guard.rules}["entropy_collapse"] == schema.MAX_WINDOW
    StepMonitor(StableConfig.from_dict({"monitor": {"entropy_window": schema.MAX_WINDOW}}))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_threads": -4}, r"hf\.num_threads must be >= 1, got int -4"),
        ({"max_batch_size": 2.9}, r"hf\.max_batch_size must be an int, got float 2\.9"),
        ({"router_noise": math.inf}, r"hf\.router_noise must be a finite number"),
        ({"precision": ""}, r"hf\.precision must not be empty"),
    ],
)
def test_hf_options_are_refused_not_rounded(options, message):
    with pytest.raises(ConfigError, match=message):
        resolve_options({"engine_kwargs": {"hf": options}})


def test_vespo_constants_out_of_range_are_refused_when_the_config_is_built():
    with pytest.raises(ConfigError, match=rf"{LOSS}\.vespo\.c1_pos must be >= 0"):
        _loss_config({"vespo": {"c1_pos": -1}})
    from verl_stable.integration.losses import VespoLossConfig

    with pytest.raises(ConfigError, match=rf"{LOSS}\.vespo\.c2_neg must be a finite number"):
        VespoLossConfig(c2_neg=math.nan)  # built in code: the same schema


def test_the_verl_stable_section_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"^verl_stable must be a mapping of options, got int 5$"):
        RolloutRoutingOptions.from_config({"verl_stable": 5})
    with pytest.raises(ConfigError, match=r"^verl_stable\.routing must be a mapping, got str 'x'$"):
        RolloutRoutingOptions.from_config({"verl_stable": {"routing": "x"}})


def test_the_vllm_fault_option_reads_through_the_schema_and_ignores_vllm_s_own_keys():
    assert routing_fault_every({"engine_kwargs": {"vllm": {"corrupt_routing_every": None, "max_num_seqs": 8}}}) == 0
    with pytest.raises(VllmCpuError, match=r"corrupt_routing_every \(fault injection\) must be an int, got str"):
        routing_fault_every({"engine_kwargs": {"vllm": {"corrupt_routing_every": "2"}}})


def test_the_schema_and_the_boundary_agree_on_the_invalid_policies():
    assert set(schema.RoutingOptions.model_fields["on_invalid"].annotation.__args__) == set(ON_INVALID)


def test_monitor_config_built_in_code_is_checked_by_the_same_schema():
    with pytest.raises(ConfigError, match=r"stable\.monitor\.entropy_window must be >= 2"):
        MonitorConfig(entropy_window=1)
    assert MonitorConfig(taus=[3, 4]).taus == (3.0, 4.0)


# --- preflight refuses what the runtime refuses ---------------------------------------------------------------------


PREFLIGHT_CASES = [
    ("++stable=5", r"stable must be a mapping"),
    ("++stable.monitor.taus=[0.5]", r"stable\.monitor\.taus\.0 must be > 1"),
    ("++stable.monitor.entropy_window=2.5", r"entropy_window must be an int"),
    ("++stable.monitor.routing_interval=0.5", r"routing_interval must be an int"),
    ("++stable.monitor.replay_metrics_interval='4'", r"replay_metrics_interval must be an int, got str"),
    ("++stable.monitor.num_experts=-3", r"num_experts must be >= 1"),
    ("++stable.guard.rules.entropy_collapse.window=100000000000000000000", r"window must be <= "),
    ("++stable.monitor.taus='25'", r"taus must be a list"),
    ("++verl_stable=5", r"verl_stable must be a mapping"),
    (f"++{LOSS}.minirl.allow_missing_rollout_is_weights='false'", r"allow_missing_rollout_is_weights must be a bool"),
    (f"++{LOSS}.vespo.c1_pos=-1", r"vespo\.c1_pos must be >= 0"),
]


@pytest.mark.parametrize(("override", "message"), PREFLIGHT_CASES)
def test_preflight_refuses_before_anything_starts_naming_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        _preflight_cpu_run(f"{LOSS}._target_=verl_stable.integration.losses.StablePolicyLossConfig", override)


@pytest.mark.parametrize(
    "override",
    ["++stable=false", "++stable.guard=false", "++stable.monitor=false", "++stable.monitor.taus=[2,3]"],
)
def test_preflight_accepts_what_the_runtime_accepts(override):
    cfg = _preflight_cpu_run(override)
    StableConfig.from_trainer_config(cfg)  # the runtime reading of the same composed config


@pytest.mark.parametrize(
    "override",
    [
        "algorithm.rollout_correction.rollout_is_threshold=abc",
        "data.train_batch_size='512'",
    ],
)
def test_recipe_check_reports_verl_values_of_the_wrong_type_without_a_traceback(override, capsys):
    from verl_stable.recipe_cli import main

    assert main(["check", "fsdp/minirl_n4_r3", override]) == 1
    out = capsys.readouterr().out
    assert "Traceback" not in out and override.split("=")[0] in out


# --- property: every key either refused by name or read as exactly the value given ----------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "false", "true", "off", "25", "1e-2", "raise", "skip_sample", "fp32", "nan", "x"]),
    st.lists(st.one_of(st.integers(-3, 9), st.floats(-3, 9), st.text(max_size=2)), max_size=3),
)

SECTIONS = {
    schema.MonitorOptions: "stable.monitor",
    schema.RoutingOptions: "verl_stable.routing",
    schema.HFEngineOptions: "actor_rollout_ref.rollout.engine_kwargs.hf",
    schema.MiniRLOptions: f"{LOSS}.minirl",
    schema.VespoOptions: f"{LOSS}.vespo",
    schema.RuleOptions: "stable.guard.rules.r",
}


def _same(given_value, read):
    if isinstance(given_value, list):
        return list(read) == given_value
    if isinstance(given_value, bool) or isinstance(read, bool):
        return type(given_value) is type(read) and given_value == read
    if isinstance(read, float) and isinstance(given_value, (int, float)):
        return read == float(given_value) and math.isfinite(read)
    return type(given_value) is type(read) and given_value == read


@settings(max_examples=400, deadline=None)
@given(model=st.sampled_from(list(SECTIONS)), data=st.data())
def test_every_key_is_refused_by_name_or_read_exactly(model, data):
    key = data.draw(st.sampled_from(sorted(model.model_fields)))
    value = data.draw(SCALARS)
    where = SECTIONS[model]
    try:
        parsed = schema.parse(model, {key: value}, where)
    except ConfigError as exc:
        assert f"{where}.{key}" in str(exc)
        return
    read = getattr(parsed, key)
    if model is schema.RuleOptions and key == "threshold" and isinstance(value, str):
        assert read == float(value)  # the one documented conversion (PyYAML's reading of 1e-2)
    elif model is schema.RuleOptions and key == "metrics" and isinstance(value, str):
        assert read == (value,)  # one name for a list of one
    elif value is None:
        assert read is None or read == model.model_fields[key].default  # null: the key's default
    else:
        assert _same(value, read), (key, value, read)


def _preflight_cpu_run(*extra):
    """The preflight of ``verl-stable run`` (verl's main_ppo on the CPU runtime, its monitored trainer) with ``extra``
    overrides."""
    from verl_stable.recipes import preflight
    from verl_stable.toy import launch

    monitored = "trainer.v1.trainer_mode=stable_sync"
    return preflight([*launch.cpu_overrides(launch.asset_paths("/tmp/unused")), monitored, *extra])


def _loss_config(sections):
    """verl's own conversion of an actor config's policy_loss node to the project's dataclass (as its workers do)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    node = OmegaConf.create({"_target_": "verl_stable.integration.losses.StablePolicyLossConfig", **sections})
    try:
        return omega_conf_to_dataclass(node)
    except Exception as exc:  # hydra wraps what __post_init__ raised; the schema's refusal is the cause
        cause = exc
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        raise (cause or exc) from None


def test_the_configuration_doc_lists_every_key_of_the_schema():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "reference" / "configuration.md").read_text()
    sections = {
        schema.MonitorOptions: "### `stable.monitor`",
        schema.GuardOptions: "### `stable.guard`",
        schema.RuleOptions: "A rule (`stable.guard.rules.<name>`)",
        schema.RoutingOptions: "### `verl_stable.routing`",
        schema.HFEngineOptions: "### `actor_rollout_ref.rollout.engine_kwargs.hf`",
        schema.VllmEngineOptions: "### `actor_rollout_ref.rollout.engine_kwargs.vllm`",
        schema.MiniRLOptions: "### `actor_rollout_ref.actor.policy_loss.minirl`",
        schema.VespoOptions: "### `actor_rollout_ref.actor.policy_loss.minirl`",
    }
    for model, heading in sections.items():
        assert heading in doc, heading
        table = doc[doc.index(heading) :].split("\n#", 1)[0]
        for name in model.model_fields:
            assert f"`{name}`" in table or f".{name}`" in table, (heading, name)


def test_the_guard_read_alone_is_a_switch_too():
    # Guard.from_config documents `false` as {enable: false}: the same rule as inside `stable`
    assert Guard.from_config(False).rules == ()
    assert Guard.from_config(True).rules == Guard.from_config({}).rules
