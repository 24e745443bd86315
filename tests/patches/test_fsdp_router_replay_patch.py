"""The upstreamable FSDP router-replay diff (patches/verl-0.9.1-fsdp-router-replay.diff) against verl 0.9.1.

The diff is checked with ``git apply --check`` against the installed verl, then applied for real to a copy of the
installed ``verl/`` package (the diff's own tests and docs page land beside it, as in a verl checkout). Behaviour
checks run that patched verl in subprocesses (``PYTHONPATH=<copy>``, verl's external plugins off, so neither the
installed verl nor verl-stable's engine plugin is in the way); each subprocess first asserts that ``verl.__file__``
lies in the copy. References are independent of the patched code: plain forwards, verl-stable's own
``verl_stable.routing.replay`` (another implementation, which places rows by the attention mask), gradients of the
natural model, the unpatched installed verl (``disabled`` must reproduce it bit for bit), and verl's own config /
validation code. The diff's own tests inside verl's ``tests/`` tree run on the patched copy too.

Run as a script (``python this_file.py <check>|all <patched root>``) the module executes checks and prints one JSON
line; that is what the subprocess does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DIFF = REPO / "patches" / "verl-0.9.1-fsdp-router-replay.diff"
MAIN_DIFF = REPO / "patches" / "verl-main-fsdp-router-replay.diff"
OWN_TESTS = ("tests/utils/test_fsdp_router_replay_on_cpu.py", "tests/workers/test_fsdp_router_replay_engine_on_cpu.py")
TOUCHED = {
    "verl/utils/fsdp_router_replay.py",
    "verl/trainer/config/engine/fsdp.yaml",
    "verl/trainer/config/_generated_ppo_trainer.yaml",
    "verl/workers/engine/fsdp/transformer_impl.py",
    "verl/workers/engine_workers.py",
    "docs/advance/fsdp_router_replay.md",
    *OWN_TESTS,
}
# verl's main also lists the page in its docs index and names the FSDP key in its router-replay example README.
MAIN_TOUCHED = TOUCHED | {"docs/index.rst", "examples/router_replay/README.md"}
FAMILIES = ("qwen3_moe", "qwen3_5_moe_text", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe")


def _load_patched_tree():
    """``patches/tools/patched_tree.py`` (copy verl, apply a diff), loaded by path: ``patches/tools`` is no package."""
    if "patched_tree" in sys.modules:  # check_series.py, loaded by another test, loads it too: keep one module
        return sys.modules["patched_tree"]
    spec = importlib.util.spec_from_file_location("patched_tree", REPO / "patches" / "tools" / "patched_tree.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


pt = _load_patched_tree()


def _installed_site_packages() -> Path:
    import verl

    return Path(verl.__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- the diff
@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for `git apply`")
def test_diff_applies_cleanly_to_the_installed_verl(tmp_path):
    site = _installed_site_packages()
    # A venv inside a git work tree puts site-packages in that tree, where `git apply` would skip every path outside
    # the current directory (and pass vacuously); check_diff's ceiling keeps git from finding the enclosing repository,
    # and the bogus diff below proves that the check can fail here.
    checked = pt.check_diff(site, DIFF)
    assert checked.ok, checked.message
    bogus = tmp_path / DIFF.name
    bogus.write_text(
        DIFF.read_text().replace(
            " from verl.utils.device import get_device_id,", " from verl.utils.device import nothing,", 1
        )
    )
    assert bogus.read_text() != DIFF.read_text()
    assert not pt.check_diff(site, bogus).ok, "git apply --check must be able to fail here"


@pytest.mark.parametrize("diff,touched", [(DIFF, TOUCHED), (MAIN_DIFF, MAIN_TOUCHED)], ids=["0.9.1", "main"])
def test_diff_touches_only_the_planned_files_and_never_imports_verl_stable(diff, touched):
    text = diff.read_text()
    assert _touched(diff) == touched
    assert [line.split()[2][2:] for line in text.splitlines() if line.startswith("diff --git ")] == [
        line[len("+++ b/") :] for line in text.splitlines() if line.startswith("+++ b/")
    ], "every file section has its own diff --git header"
    added = [line for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert not [line for line in added if "verl_stable" in line], "upstream code must not depend on verl-stable"
    assert "agent_loop" not in text, "the agent loop belongs to the routing-transport diff"


def test_series_entries_name_the_switch_and_the_own_tests():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    series = tomllib.loads((REPO / "patches" / "series.toml").read_text())
    mine = {p["base"]: p for p in series["patch"] if p["feature"] == "fsdp-router-replay"}
    assert {base: p["file"] for base, p in mine.items()} == {"0.9.1": DIFF.name, "main": MAIN_DIFF.name}
    for entry in mine.values():
        assert entry["switch"] == "actor_rollout_ref.actor.fsdp_config.router_replay.mode"
        assert tuple(entry["own_tests"]) == OWN_TESTS


def _touched(diff: Path) -> set[str]:
    """Paths a diff writes (its ``+++ b/...`` headers)."""
    return {line[len("+++ b/") :].split("\t")[0] for line in diff.read_text().splitlines() if line.startswith("+++ b/")}


# The other diffs against verl 0.9.1 (the series names them verl-0.9.1-*; verl-main-* apply to verl's main).
OTHER_DIFFS = sorted(p for p in DIFF.parent.glob("verl-0.9.1-*.diff") if p != DIFF)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for `git apply`")
@pytest.mark.parametrize("other", OTHER_DIFFS, ids=[p.name for p in OTHER_DIFFS])
@pytest.mark.parametrize("mine_first", [True, False], ids=["this-first", "other-first"])
def test_diff_stacks_with_every_other_patch_in_either_order(tmp_path, other, mine_first):
    site = _installed_site_packages()
    for rel in _touched(DIFF) | _touched(other):
        if (site / rel).is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(site / rel, tmp_path / rel)
    for diff in (DIFF, other) if mine_first else (other, DIFF):
        applied = pt.apply_diff(tmp_path, diff)
        assert applied.ok, f"{diff.name} after the other one: {applied.message}"


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory) -> Path:
    """A copy of the installed verl package with the diff applied; returns the directory that holds ``verl/``."""
    if shutil.which("git") is None:
        pytest.skip("git is needed for `git apply`")
    try:  # the whole diff: its own tests and docs page land beside verl/, as in a verl checkout
        return pt.patched_copy(tmp_path_factory.mktemp("patched"), [DIFF], source=_installed_site_packages() / "verl")
    except pt.DiffDoesNotApply as exc:
        pytest.fail(str(exc))


def _run_check(root: Path, name: str, timeout: int = 480) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), VERL_USE_EXTERNAL_PLUGINS="none", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, name, str(root)], env=env, cwd=root, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"check {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_patched_module_is_applied_and_self_contained(patched_verl):
    module = patched_verl / "verl" / "utils" / "fsdp_router_replay.py"
    assert module.is_file()
    assert "verl_stable" not in module.read_text()
    assert "router_replay:" in (patched_verl / "verl/trainer/config/engine/fsdp.yaml").read_text()
    for test in OWN_TESTS:
        assert "verl_stable" not in (patched_verl / test).read_text()


def test_the_diffs_own_verl_tests_pass_on_the_patched_verl(patched_verl):
    env = dict(os.environ, PYTHONPATH=str(patched_verl), VERL_USE_EXTERNAL_PLUGINS="none", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(patched_verl), *OWN_TESTS],
        env=env,
        cwd=patched_verl,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "failed" not in proc.stdout.splitlines()[-1]


# ------------------------------------------------------------------------------------------------- checks
@pytest.fixture(scope="module")
def results(patched_verl) -> dict:
    """Every behaviour check, run in one subprocess (one interpreter start-up instead of four)."""
    return _run_check(patched_verl, "all")


@pytest.fixture(scope="module")
def controller_results(results) -> dict:
    return results["controller"]


def test_controller_record_replay_matches_verl_stable_for_every_family(controller_results):
    result = controller_results["families"]
    assert set(result) == set(FAMILIES)
    for family, r in result.items():
        assert r["recorded_shape"] == r["expected_shape"], family
        assert r["dense_layers_zero"], family
        assert r["record_keeps_logits"], family  # recording does not change outputs
        assert r["replay_own_is_identical"], family  # replaying the recorded routing reproduces the logits
        assert r["random_routing_changes_logits"], family
        assert r["max_diff_vs_verl_stable"] <= 1e-6, (family, r["max_diff_vs_verl_stable"])
        assert r["router_grad_norm"] > 0, family  # gradients reach the router under replay
        assert r["same_params_get_grads"], family
        assert r["max_grad_diff_vs_verl_stable"] <= 1e-5, (family, r["max_grad_diff_vs_verl_stable"])
        assert r["removed_restores_model"], family


def test_controller_errors_name_expected_and_received(controller_results):
    errors = controller_results["errors"]
    assert "expected [rows, num_hidden_layers, top_k] = [24, 3, 2]" in errors["bad_layers"]
    assert "expert id 8" in errors["out_of_range"] and "[0, 8)" in errors["out_of_range"]
    assert "routes 24 rows" in errors["row_count"] and "armed with 20 rows" in errors["row_count"]
    assert "does not support model_type 'qwen3'" in errors["dense_model"] and "qwen3_moe" in errors["dense_model"]
    assert "needs the micro-batch's routed_experts" in errors["replay_without_targets"]


def test_patched_config_composes_without_plus_and_converts_to_verl_dataclasses(results):
    result = results["config"]
    assert result["actor_mode"] == "R3"
    assert result["actor_engine_is_fsdp_config"]
    assert result["ref_mode"] == "disabled" and result["critic_mode"] == "disabled"
    assert result["generated_yaml_matches_compose"]
    assert "bypass_mode" in result["r2_bypass_error"]  # verl's own validation now covers the FSDP actor
    assert result["unknown_mode_error"].startswith("Invalid router_replay mode")


def test_patched_fsdp_engine_runs_r2_and_r3_through_verls_code_paths(results):
    r = results["engine"]
    assert r["engine_module"].startswith(r["root"]) and r["verl_stable_engine_not_loaded"]
    # R2 compute_log_prob: routed_experts in verl's layout, log-probs untouched.
    assert r["r2_record_logp_equal"] and r["r2_routed_dtype"] == "torch.int16"
    assert r["r2_routed_offsets_equal"] and r["r2_routed_shape"] == [21, 3, 2]
    assert r["r2_record_matches_verl_stable_capture"] and r["r2_dense_layer_zero"]
    # R2 update replays pi_old's routing: identical log-probs and gradients, router included.
    assert r["r2_update_logp_equal"] and r["r2_update_grads_equal"] and r["r2_router_grad_norm"] > 0
    # R3: packed, padded and pad_to_length layouts replay the rollout routing like verl-stable's replay.
    assert r["r3_packed_equal"] and r["r3_changes_logp"]
    assert r["r3_padded_equal"] and r["r3_pad_to_length_close"] and r["r3_missing_rows_equal"]
    # The worker's veto (reference pass) and the reference engine never replay.
    assert r["vetoed_is_natural"] and r["unflagged_is_natural"]  # replay needs the worker's flag, as in verl's engines
    assert r["forward_only_engine_mode"] == "disabled" and r["forward_only_engine_has_no_controller"]
    assert r["lora_reference_is_natural"] and r["lora_adapter_pass_replays"]
    # Errors are clear and leave the controller disarmed.
    assert "enable_rollout_routing_replay=True" in r["r3_without_routing"]
    assert "expected rows per sample [5, 7]" in r["misaligned"] and r["disarmed_after_error"]


def test_disabled_replay_leaves_verls_engine_bit_for_bit_unchanged(patched_verl):
    patched = _run_check(patched_verl, "plain")["plain"]
    unpatched = _run_check(_installed_site_packages(), "plain")["plain"]
    assert patched["verl_file"].startswith(str(patched_verl)) and not unpatched["verl_file"].startswith(
        str(patched_verl)
    )
    assert patched["mode"] == unpatched["mode"] == "disabled"
    assert patched["forward_keys"] == unpatched["forward_keys"] == ["log_probs"]  # no routed_experts
    for key in ("forward_log_probs", "update_log_probs", "grads"):
        assert patched[key] == unpatched[key], key
    assert len(patched["grads"]) > 10


def test_patched_engine_aligns_routing_with_ulysses_slices_on_two_ranks(results):
    r = results["ulysses"]
    assert r["exit_codes"] == [0, 0]
    assert r["rows_per_rank"] == [11, 11]  # 21 packed tokens + 1 Ulysses pad row, split over sp=2
    assert r["r3_gathered_equals_routing"]  # every rank replayed exactly its slice of the rollout routing
    assert r["r2_recorded_equals_gathered_natural"]  # RECORD output is gathered and unpadded like log_probs


# =========================================================================================== subprocess side
def _emit(result: dict) -> None:
    print(json.dumps(result))


def _import_patched(root: str):
    import verl

    assert verl.__file__.startswith(root), f"expected the patched verl under {root}, imported {verl.__file__}"
    from verl.utils import fsdp_router_replay

    assert fsdp_router_replay.__file__.startswith(root)
    return fsdp_router_replay


def _testkit():
    sys.path.insert(0, str(REPO / "tests" / "routing"))
    import routing_testkit

    return routing_testkit


def _random_routing(rows: int, num_layers: int, moe_layers, num_experts: int, top_k: int, seed: int):
    """[rows, num_layers, top_k] distinct random experts in MoE layers, zeros in dense layers."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, num_layers, top_k, dtype=torch.long)
    for layer in moe_layers:
        out[:, layer] = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(rows)])
    return out


def check_controller(root: str) -> dict:
    import torch

    rr_mod = _import_patched(root)
    from verl_stable.routing import RoutingTrace, replay

    kit = _testkit()
    torch.set_num_threads(1)
    results = {}
    for family in FAMILIES:
        model = kit.tiny_model(family)
        ids, mask = kit.padded_batch([5, 8, 3], width=8, left=False)
        token_rows = mask.bool().reshape(-1)
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask).logits
        rr = rr_mod.FSDPRouterReplay(model)
        rr.install()
        layers, top_k, experts, moe = rr.num_hidden_layers, rr.top_k, rr.num_experts, rr.moe_layers
        r = {"expected_shape": [ids.numel(), layers, top_k]}

        rr.begin_microbatch(rr_mod.RouterReplayAction.RECORD, token_rows)
        with torch.no_grad():
            recorded_logits = model(input_ids=ids, attention_mask=mask).logits
        recorded = rr.take_recorded()
        r["recorded_shape"] = list(recorded.shape)
        dense = [i for i in range(layers) if i not in moe]
        r["dense_layers_zero"] = not bool(recorded[:, dense].any()) if dense else True
        r["record_keeps_logits"] = torch.equal(recorded_logits, plain)

        rr.begin_microbatch(rr_mod.RouterReplayAction.REPLAY, token_rows, recorded)
        with torch.no_grad():
            r["replay_own_is_identical"] = torch.equal(model(input_ids=ids, attention_mask=mask).logits, plain)

        # A different routing; one real token has no data (zero row), as rollout engines leave the last token.
        routing = _random_routing(ids.numel(), layers, moe, experts, top_k, seed=3)
        routing[1] = 0
        rr.begin_microbatch(rr_mod.RouterReplayAction.REPLAY, token_rows, routing)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask).logits
        out[mask.bool()].logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        rr.remove()
        r["random_routing_changes_logits"] = not torch.allclose(out, plain)
        with torch.no_grad():
            r["removed_restores_model"] = torch.equal(model(input_ids=ids, attention_mask=mask).logits, plain)

        # Reference: verl-stable's replay with the valid tokens' MoE rows, the zero row marked as missing (-1).
        reference_rows = routing[token_rows][:, list(moe)]
        reference_rows[1] = -1
        trace = RoutingTrace.from_tensor(reference_rows, num_experts=experts)
        model.zero_grad()
        with replay(model, trace):
            ref = model(input_ids=ids, attention_mask=mask).logits
            ref[mask.bool()].logsumexp(-1).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        valid = mask.bool()
        r["max_diff_vs_verl_stable"] = float((out[valid] - ref[valid]).abs().max())
        r["router_grad_norm"] = float(sum(g.norm() for n, g in grads.items() if n.endswith("mlp.gate.weight")))
        r["same_params_get_grads"] = grads.keys() == ref_grads.keys()
        shared = grads.keys() & ref_grads.keys()
        r["max_grad_diff_vs_verl_stable"] = max(float((grads[n] - ref_grads[n]).abs().max()) for n in shared)
        results[family] = r
    return {"families": results, "errors": _errors(rr_mod, kit)}


def _errors(rr_mod, kit) -> dict:
    import torch

    model = kit.tiny_model("qwen3_moe")  # 3 decoder layers (layer 1 dense), 8 experts, top-2
    rr = rr_mod.FSDPRouterReplay(model)
    rr.install()
    ids, mask = kit.padded_batch([5, 8, 3], width=8, left=False)
    rows = torch.ones(ids.numel(), dtype=torch.bool)
    good = _random_routing(ids.numel(), 3, rr.moe_layers, 8, 2, seed=0)
    errors = {}

    def message(fn) -> str:
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "no error"

    replay = rr_mod.RouterReplayAction.REPLAY
    errors["bad_layers"] = message(lambda: rr.begin_microbatch(replay, rows, good[:, :2]))
    bad = good.clone()
    bad[4, 2, 0] = 8
    errors["out_of_range"] = message(lambda: rr.begin_microbatch(replay, rows, bad))
    errors["replay_without_targets"] = message(lambda: rr.begin_microbatch(replay, rows))
    rr.begin_microbatch(replay, rows[:20], good[:20])
    errors["row_count"] = message(lambda: model(input_ids=ids))
    dense = kit.AutoModelForCausalLM.from_config(
        kit.AutoConfig.for_model("qwen3", **{k: v for k, v in kit._COMMON.items()}, num_hidden_layers=1)
    )
    errors["dense_model"] = message(lambda: rr_mod.FSDPRouterReplay(dense))
    return errors


def check_config(root: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    _import_patched(root)
    import verl
    from verl.utils.config import _validate_router_replay_config, omega_conf_to_dataclass

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    batch = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    mode = "actor_rollout_ref.actor.fsdp_config.router_replay.mode="
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[*batch, mode + "R3"])
        plain = compose(config_name="ppo_trainer")
        r2 = compose(
            config_name="ppo_trainer",
            overrides=[*batch, mode + "R2", "algorithm.rollout_correction.bypass_mode=True"],
        )
        bad = compose(config_name="ppo_trainer", overrides=[*batch, mode + "R4"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    ref = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.fsdp_config)
    critic = omega_conf_to_dataclass(cfg.critic.fsdp)
    result = {
        "actor_mode": actor.fsdp_config.router_replay.mode,
        "actor_engine_is_fsdp_config": actor.engine is actor.fsdp_config,
        "ref_mode": ref.router_replay.mode,
        "critic_mode": critic.router_replay.mode,
    }
    with open_dict(plain):
        plain.pop("model_engine", None)
    generated = Path(config_dir, "_generated_ppo_trainer.yaml").read_text()
    body = "\n".join(line for line in generated.splitlines() if not line.startswith("#")).strip()
    result["generated_yaml_matches_compose"] = OmegaConf.to_yaml(plain).strip() == body
    try:
        _validate_router_replay_config(
            omega_conf_to_dataclass(r2.actor_rollout_ref.actor), r2.algorithm.get("rollout_correction")
        )
        result["r2_bypass_error"] = "no error"
    except ValueError as exc:
        result["r2_bypass_error"] = str(exc)
    try:
        omega_conf_to_dataclass(bad.actor_rollout_ref.actor)
        result["unknown_mode_error"] = "no error"
    except Exception as exc:  # noqa: BLE001 - hydra wraps the dataclass error
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        result["unknown_mode_error"] = str(cause)
    return result


ENGINE_LENGTHS = [5, 7, 3, 6]


def _engine_batch(lengths, routed=None, *, remove_padding=True, micro=2, seed=0, replay_flag=True):
    """A verl engine batch (nested, padding removed) with ``routed_experts`` when given.

    ``replay_flag`` is the ``enable_routing_replay`` verl's worker stamps on the batch when router replay is on
    (True for ``compute_log_prob`` / ``update_actor``, False for ``compute_ref_log_prob``); None leaves it out.
    """
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    nested = lambda values: torch.nested.nested_tensor_from_jagged(values, offsets)  # noqa: E731
    fields = {
        "input_ids": nested(torch.randint(3, 96, (total,), generator=gen)),
        "position_ids": nested(torch.cat([torch.arange(n) for n in lengths])),
        "loss_mask": nested(torch.ones(total, dtype=torch.int64)),
    }
    if routed is not None:
        fields["routed_experts"] = nested(routed)
    td = TensorDict(fields, batch_size=[len(lengths)])
    tu.assign_non_tensor(
        td,
        use_remove_padding=remove_padding,
        temperature=1.0,
        pad_token_id=0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro,
        return_model_output=True,
    )
    if replay_flag is not None:
        tu.assign_non_tensor(td, enable_routing_replay=replay_flag)
    return td


def _engine_kit():
    """A tiny Qwen3-MoE and a factory of verl's FSDPEngineWithLMHead around it (real __init__ / initialize, no FSDP
    wrap: sharding is out of scope on one CPU rank), on one gloo rank. Works on any verl, patched or not."""
    import tempfile
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager

    from verl_stable.cpu.platform import platform_class  # test infrastructure: verl's device helpers on CPU

    platform_manager._current_platform = platform_class()()
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp import transformer_impl

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0, world_size=1)
    model = _testkit().tiny_model("qwen3_moe", attn_implementation="sdpa")  # layers 0, 2 MoE; 1 dense; top-2 of 8
    model.save_pretrained(tmp / "model")
    model_config = HFModelConfig(path=str(tmp / "model"), load_tokenizer=False, use_remove_padding=True)

    def engine(mode, forward_only=False, pad_to_length=False, module=None):
        config = FSDPEngineConfig(
            router_replay=EngineRouterReplayConfig(mode=mode),
            forward_only=forward_only,
            use_torch_compile=False,
            pad_to_length=pad_to_length,
            pad_to_length_bucket=8,
            strategy="fsdp2",
        )
        eng = transformer_impl.FSDPEngineWithLMHead(
            model_config, config, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig()
        )

        def build_without_fsdp():
            eng.module, eng.optimizer, eng.lr_scheduler = model if module is None else module, None, None

        eng._build_model_optimizer = build_without_fsdp
        eng._autocast_dtype = torch.float32
        eng.initialize()
        return eng

    def run(eng, data, forward_only=True, loss=None):  # as verl's worker runs it: inside the eval / train scope
        scope = eng.eval_mode if forward_only else eng.train_mode
        with scope(disable_auto_offload=True, zero_grad_on_exit=False):  # no optimizer here
            out = eng.forward_backward_batch(data, loss_function=loss, forward_only=forward_only)
        return out["model_output"]

    def sum_logp(model_output, data, dp_group=None):
        return -model_output["log_probs"].values().sum(), {}

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    return SimpleNamespace(
        model=model, engine=engine, run=run, sum_logp=sum_logp, grads=grads, module=transformer_impl, dist=dist
    )


def check_plain(root: str) -> dict:
    """verl's FSDP engine with router replay left at its default: log-probs and gradients as raw bytes (hex digests),
    so that the patched verl can be compared bit for bit with the unpatched installed one."""
    import hashlib

    import torch
    import verl

    assert verl.__file__.startswith(root), (root, verl.__file__)
    k = _engine_kit()
    from verl.workers.config import FSDPEngineConfig

    digest = lambda t: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()  # noqa: E731
    eng = k.engine(FSDPEngineConfig().router_replay.mode)  # the default mode of this verl
    rows = _random_routing(sum(ENGINE_LENGTHS), 3, (0, 2), 8, 2, seed=1).to(torch.int16)
    # A batch as verl's trainer hands it over when the rollout exported routing but replay is off (no worker flag).
    forward = k.run(eng, _engine_batch(ENGINE_LENGTHS, rows, replay_flag=None))
    k.model.zero_grad()
    update = k.run(eng, _engine_batch(ENGINE_LENGTHS, rows, replay_flag=None), False, k.sum_logp)
    result = {
        "verl_file": verl.__file__,
        "mode": FSDPEngineConfig().router_replay.mode,
        "forward_keys": sorted(forward.keys()),
        "forward_log_probs": digest(forward["log_probs"].values()),
        "update_log_probs": digest(update["log_probs"].values()),
        "grads": {name: digest(grad) for name, grad in sorted(k.grads().items())},
    }
    k.dist.destroy_process_group()
    return result


def check_engine(root: str) -> dict:
    """verl's patched FSDPEngineWithLMHead: real __init__ / initialize / forward_backward_batch, no FSDP wrap."""
    import torch

    rr_mod = _import_patched(root)
    from verl.utils import tensordict_utils as tu

    from verl_stable.routing import RoutingTrace, capture, replay

    k = _engine_kit()
    model, engine, run, sum_logp, grads, transformer_impl = k.model, k.engine, k.run, k.sum_logp, k.grads, k.module

    def moe_trace(rows):  # the library's trace of packed rows: MoE layers only, zero rows = no data (-1)
        ids = rows[:, [0, 2]].to(torch.long)
        return RoutingTrace.from_tensor(ids.masked_fill((ids == 0).all(-1, keepdim=True), -1), num_experts=8)

    lengths, total = ENGINE_LENGTHS, sum(ENGINE_LENGTHS)
    r = {"root": root, "engine_module": transformer_impl.__file__}
    base = engine("disabled")
    natural = run(base, _engine_batch(lengths))["log_probs"].values()

    # R2 compute_log_prob (RECORD) vs verl-stable's capture around the plain engine.
    r2 = engine("R2")
    recorded = run(r2, _engine_batch(lengths))
    routed = recorded["routed_experts"]
    with torch.no_grad(), capture(model, use_attention_mask=False) as rec:
        run(base, _engine_batch(lengths))
    r["r2_record_logp_equal"] = torch.equal(recorded["log_probs"].values(), natural)
    r["r2_routed_dtype"] = str(routed.dtype)
    r["r2_routed_offsets_equal"] = torch.equal(routed.offsets(), _engine_batch(lengths)["input_ids"].offsets())
    r["r2_routed_shape"] = list(routed.values().shape)
    r["r2_record_matches_verl_stable_capture"] = torch.equal(
        routed.values()[:, [0, 2]].long(), rec.trace.to_tensor().long()
    )
    r["r2_dense_layer_zero"] = not bool(routed.values()[:, 1].any())

    # R2 update replaying pi_old's routing on the same weights: same log-probs and gradients as no replay.
    model.zero_grad()
    plain_update = run(base, _engine_batch(lengths), False, sum_logp)["log_probs"].values()
    plain_grads = grads()
    model.zero_grad()
    replayed = run(r2, _engine_batch(lengths, routed.values()), False, sum_logp)["log_probs"].values()
    replay_grads = grads()
    r["r2_update_logp_equal"] = torch.equal(replayed, plain_update)
    r["r2_update_grads_equal"] = replay_grads.keys() == plain_grads.keys() and all(
        torch.equal(replay_grads[n], plain_grads[n]) for n in plain_grads
    )
    r["r2_router_grad_norm"] = float(replay_grads["model.layers.0.mlp.gate.weight"].norm())
    model.zero_grad()

    # R3 with a different routing, in the packed, padded and pad_to_length layouts.
    rows = _random_routing(total, 3, (0, 2), 8, 2, seed=1).to(torch.int16)
    r3 = engine("R3")
    out = run(r3, _engine_batch(lengths, rows, micro=4))["log_probs"].values()
    with torch.no_grad(), replay(model, moe_trace(rows)):
        packed_ref = run(base, _engine_batch(lengths, micro=4))["log_probs"].values()
    r["r3_packed_equal"] = torch.equal(out, packed_ref)
    r["r3_changes_logp"] = not torch.allclose(out, run(base, _engine_batch(lengths, micro=4))["log_probs"].values())
    out = run(r3, _engine_batch(lengths, rows, micro=4, remove_padding=False))["log_probs"].values()
    with torch.no_grad(), replay(model, moe_trace(rows)):
        ref = run(base, _engine_batch(lengths, micro=4, remove_padding=False))["log_probs"].values()
    r["r3_padded_equal"] = torch.equal(out, ref)
    out = run(engine("R3", pad_to_length=True), _engine_batch(lengths, rows, micro=4))["log_probs"].values()
    r["r3_pad_to_length_close"] = torch.allclose(out, packed_ref, atol=1e-6)
    missing = rows.clone()
    missing[torch.tensor(lengths).cumsum(0) - 1] = 0  # the rollout has no row for each sample's last token
    out = run(r3, _engine_batch(lengths, missing, micro=4))["log_probs"].values()
    with torch.no_grad(), replay(model, moe_trace(missing)):
        ref = run(base, _engine_batch(lengths, micro=4))["log_probs"].values()
    r["r3_missing_rows_equal"] = torch.equal(out, ref)

    # The worker's veto (reference pass) and the reference (forward-only) engine never replay.
    vetoed = _engine_batch(lengths, rows, micro=4)
    tu.assign_non_tensor(vetoed, enable_routing_replay=False)
    natural4 = run(base, _engine_batch(lengths, micro=4))["log_probs"].values()
    r["vetoed_is_natural"] = torch.equal(run(r3, vetoed)["log_probs"].values(), natural4)
    unflagged = _engine_batch(lengths, rows, micro=4, replay_flag=None)  # the worker did not turn replay on
    r["unflagged_is_natural"] = torch.equal(run(r3, unflagged)["log_probs"].values(), natural4)
    reference_engine = engine("R3", forward_only=True)
    r["forward_only_engine_mode"] = reference_engine._fsdp_router_replay_mode
    r["forward_only_engine_has_no_controller"] = reference_engine._fsdp_router_replay is None
    # A LoRA actor computing the reference policy (adapter off) does not replay; with the adapter on it does.
    from peft import LoraConfig, get_peft_model

    lora = engine("R3", module=get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])))  # B = 0
    with lora.disable_adapter():
        reference = run(lora, _engine_batch(lengths, rows, micro=4))["log_probs"].values()
    r["lora_reference_is_natural"] = torch.equal(reference, natural4)
    r["lora_adapter_pass_replays"] = torch.equal(
        run(lora, _engine_batch(lengths, rows, micro=4))["log_probs"].values(), packed_ref
    )

    def message(fn):
        try:
            fn()
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "no error"

    r["r3_without_routing"] = message(lambda: run(r3, _engine_batch(lengths)))
    shifted = _engine_batch(lengths, rows)
    shifted["routed_experts"] = torch.nested.nested_tensor_from_jagged(rows, torch.tensor([0, 6, 12, 15, 21]))
    r["misaligned"] = message(lambda: run(r3, shifted))
    r["disarmed_after_error"] = r3._fsdp_router_replay.action is rr_mod.RouterReplayAction.DISABLED
    r["verl_stable_engine_not_loaded"] = not any(m.startswith("verl_stable.integration") for m in sys.modules)
    k.dist.destroy_process_group()
    return r


def _ulysses_rank(rank: int, root: str, tmp: str, queue) -> None:
    """One of two Ulysses ranks (sp=2, dp=1): R2 record and R3 replay on this rank's slice of the packed rows."""
    import torch
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager

    from verl_stable.cpu.platform import platform_class

    platform_manager._current_platform = platform_class()()
    _import_patched(root)
    from verl.trainer.config import CheckpointConfig
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group
    from verl.workers.config import EngineRouterReplayConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from verl_stable.routing import capture

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2)
    model = _testkit().tiny_model("qwen3_moe", attn_implementation="sdpa")
    model.save_pretrained(f"{tmp}/model{rank}")
    model_config = HFModelConfig(path=f"{tmp}/model{rank}", load_tokenizer=False, use_remove_padding=True)
    lengths = ENGINE_LENGTHS
    rows = _random_routing(sum(lengths), 3, (0, 2), 8, 2, seed=1).to(torch.int16)
    out = {"rank": rank}
    for mode in ("R2", "R3"):
        config = FSDPEngineConfig(
            router_replay=EngineRouterReplayConfig(mode=mode), ulysses_sequence_parallel_size=2, use_torch_compile=False
        )
        engine = FSDPEngineWithLMHead(model_config, config, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
        engine._build_model_optimizer = lambda e=engine: setattr(e, "module", model) or setattr(e, "optimizer", None)
        engine.lr_scheduler = None
        engine._autocast_dtype = torch.float32
        engine.initialize()
        set_ulysses_sequence_parallel_group(engine.ulysses_parallel_group)
        with torch.no_grad(), capture(model, use_attention_mask=False) as used:  # hooks after the replay's: used ids
            result = engine.forward_backward_batch(
                _engine_batch(lengths, rows if mode == "R3" else None, micro=4), loss_function=None, forward_only=True
            )
        out[f"{mode}_used"] = used.trace.to_tensor().tolist()  # this rank's rows (its slice, pad included)
        if mode == "R2":
            out["R2_recorded"] = result["model_output"]["routed_experts"].values().tolist()
        engine._fsdp_router_replay.remove()
    out["routing"] = rows[:, [0, 2]].tolist()
    queue.put(out)
    dist.destroy_process_group()


def check_ulysses(root: str) -> dict:
    """Two gloo ranks with Ulysses sp=2: the replayed / recorded rows line up with verl's pad-and-slice of input_ids.

    The routers of each rank see its slice of the packed sequence (11 of 21 + 1 pad rows). Without verl's Ulysses
    attention patch the ranks attend locally, which changes the hidden states but not which row is which token.
    """
    import tempfile

    import torch
    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ulysses_rank, args=(rank, root, tmp, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    outs = sorted((queue.get(timeout=300) for _ in procs), key=lambda o: o["rank"])
    for proc in procs:
        proc.join(timeout=60)
    total = sum(ENGINE_LENGTHS)
    used = {mode: torch.tensor(outs[0][f"{mode}_used"] + outs[1][f"{mode}_used"]) for mode in ("R2", "R3")}
    return {
        "rows_per_rank": [len(o["R3_used"]) for o in outs],
        "r3_gathered_equals_routing": torch.equal(used["R3"][:total], torch.tensor(outs[0]["routing"])),
        "r2_recorded_equals_gathered_natural": all(
            torch.equal(torch.tensor(o["R2_recorded"])[:, [0, 2]], used["R2"][:total]) for o in outs
        ),
        "exit_codes": [proc.exitcode for proc in procs],
    }


if __name__ == "__main__":
    CHECKS = {
        "controller": check_controller,
        "config": check_config,
        "engine": check_engine,
        "plain": check_plain,
        "ulysses": check_ulysses,
    }
    # "plain" runs on its own (also on the unpatched verl), in a fresh process each time
    names = [name for name in CHECKS if name != "plain"] if sys.argv[1] == "all" else [sys.argv[1]]
    _emit({name: CHECKS[name](sys.argv[2]) for name in names})
