"""Every public metric function on malformed input: a typed error naming what was expected and what was received."""

import math

import numpy as np
import pytest
import torch

from verl_stable.monitor import metrics as M

X = torch.zeros(2, 3)
ONES = torch.ones(2, 3)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: M.masked_mean([1.0, 2.0], torch.ones(2)), r"values must be a torch.Tensor, got list"),
        (lambda: M.masked_mean(X, [[1, 1, 1]]), r"mask must be a torch.Tensor, got list"),
        (lambda: M.train_inference_metrics(X.numpy(), X, ONES), r"logp_mu must be a torch.Tensor, got ndarray"),
        (lambda: M.train_inference_metrics(X, X.long(), ONES), r"logp_old must be a floating point.*torch.int64"),
        (lambda: M.train_inference_metrics(X, X, ONES, taus=2.0), r"taus must be a sequence of numbers, got float"),
        (lambda: M.train_inference_metrics(X, X, ONES, taus=("3",)), r"tau must be a real number, got str"),
        (lambda: M.correction_metrics(X, X, ONES, token_level="yes"), r"token_level must be a bool.*got str 'yes'"),
        (lambda: M.correction_metrics(X, X, ONES, is_weights=X.long()), r"is_weights must be a floating point"),
        (lambda: M.effective_sample_size(X.bool(), ONES), r"weights must be a floating point.*torch.bool"),
        (lambda: M.staleness_statistics(None, X, ONES), r"logp_theta must be a torch.Tensor, got NoneType"),
        (lambda: M.staleness_statistics(X, X, ONES, eps_low="0.2"), r"eps_low must be a real number, got str"),
        (lambda: M.staleness_metrics(X, X, ONES, eps_high=None), r"eps_high must be a real number, got NoneType"),
        (lambda: M.entropy_metrics(X.to(torch.complex64), ONES), r"entropy must be a floating point.*complex64"),
        (lambda: M.window_slope(0.5), r"values must be a sequence of numbers, got float"),
        (lambda: M.window_slope([1.0, "2"]), r"values\[1\] must be a real number or None, got str"),
        (lambda: M.routing_disagreement_metrics([0.1], "x"), r"disagreement must be a mapping.*got list"),
        (lambda: M.routing_disagreement_metrics({"a": 1.0}, 3), r"name must be a str, got int"),
        (lambda: M.routing_disagreement_metrics({"a": [[0.1]]}, "x"), r"'a'\[0\] must be a real number, got list"),
        (lambda: M.routing_disagreement_metrics({"a": "0.1"}, "x"), r"'a' is neither a number nor a sequence"),
        (lambda: M.expert_load_balance(torch.zeros(2, 1, 1, dtype=torch.long), 2.5), r"num_experts must be an int"),
        (lambda: M.expert_load_balance(torch.zeros(2, 1, 1, dtype=torch.long), True), r"num_experts must be an int"),
        (lambda: M.expert_load_balance(torch.zeros(2, 1, 1, dtype=torch.long), 2, [1, 0]), r"row_mask must be a torch"),
        (lambda: M.expert_load_balance([[[0]]]), r"ids must be a torch.Tensor, got list"),
        (lambda: M.expert_load_balance(torch.zeros(1, 1, 1, dtype=torch.long), 2, None, "no"), r"skip_all_zero_layers"),
    ],
)
def test_wrong_types_raise_type_error(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: M.masked_mean(X, ONES[:, :2]), r"mask has shape \(2, 2\) but values has shape \(2, 3\)"),
        (lambda: M.train_inference_metrics(X, X[:1], ONES), r"logp_old has shape \(1, 3\) but logp_mu has shape"),
        (lambda: M.train_inference_metrics(X, X, ONES * 2), r"mask must hold only 0 and 1 .*got 2"),
        (lambda: M.train_inference_metrics(X, X, ONES * math.nan), r"mask must hold only 0 and 1 .*got nan"),
        (lambda: M.train_inference_metrics(X, X, ONES.to("meta")), r"mask is on meta but logp_mu is on cpu"),
        (lambda: M.train_inference_metrics(X, X, ONES, taus=(2.0, 2.0000001)), r"taus 2 and 2.0000001 share"),
        (lambda: M.train_inference_metrics(X, X, ONES, taus=(math.inf,)), r"tau must be a finite number > 1, got inf"),
        (lambda: M.correction_metrics(X, X, ONES, rtol=1.5), r"rtol must be a finite number in \[0, 1\), got 1.5"),
        (lambda: M.correction_metrics(X, X, ONES, is_weights=-ONES), r"is_weights must be non-negative, got -1"),
        (lambda: M.correction_metrics(X, X, ONES, kept_mask=ONES[:1]), r"kept_mask has shape \(1, 3\)"),
        (lambda: M.staleness_statistics(X, X, ONES, eps_high=math.nan), r"eps_high >= 0.*eps_high=nan"),
        (lambda: M.routing_disagreement_metrics({"a": torch.zeros(2, 2)}, "x"), r"'a' has 2 dimensions.*0 or 1"),
        (lambda: M.window_slope([1.0, 2.0], steps=[0]), r"steps has 1 entries but values has 2"),
        (lambda: M.window_slope([1.0, 2.0], steps=[0, math.nan]), r"steps must be finite numbers, got \[0, nan\]"),
        (lambda: M.routing_disagreement_metrics({"": 1.0}, "x"), r"keys must be non-empty str"),
        (lambda: M.expert_load_balance(torch.zeros(2, 1, 1, dtype=torch.long), 2, torch.tensor([2, 0])), r"0 and 1"),
        (lambda: M.expert_load_balance(torch.zeros(2, 1, 1, dtype=torch.long), 0), r"num_experts must be >= 1, got 0"),
    ],
)
def test_wrong_values_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_numpy_scalars_and_integer_masks_are_accepted():
    out = M.train_inference_metrics(X, X, torch.ones(2, 3, dtype=torch.uint8), taus=(np.float32(2.0), 3))
    assert out["stable/train_inf/extreme_frac_tau2"] == 0.0 and "stable/train_inf/extreme_frac_tau3" in out
    assert M.routing_disagreement_metrics({"overall": np.float32(0.5), "n": np.int64(3)}, "x") == {
        "stable/routing/x/overall": 0.5,
        "stable/routing/x/n": 3.0,
    }
    assert M.expert_load_balance(torch.tensor([[[1]], [[0]]]), np.int64(2))["stable/routing/load/max_over_mean"] == 1.0


def test_expert_load_balance_with_no_layer_or_no_slot_is_empty_not_an_error():
    assert M.expert_load_balance(torch.zeros(4, 0, 2, dtype=torch.long), 4) == {}
    assert M.expert_load_balance(torch.zeros(4, 2, 0, dtype=torch.long), 4) == {}


def test_window_slope_over_explicit_steps():
    # 0.2 at step 1 and 0.1 at step 11: a decline of 0.01 per step, not 0.1
    assert M.window_slope([0.2, 0.1], steps=[1, 11]) == pytest.approx(-0.01)
    assert M.window_slope([0.2, 0.1], steps=[3, 3]) is None  # one distinct step: no slope
