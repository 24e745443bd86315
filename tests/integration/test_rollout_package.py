"""The ``integration/rollout/`` package: its names, its light import, and two holes closed (issue #14).

* shared prompt rows that come back from the side partition in a wider dtype than the sample's are checked before
  they are narrowed (a wrapped id must never turn into a plausible expert);
* ``verl_stable.routing`` refuses keys it does not know instead of dropping them.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from verl_stable.integration import rollout
from verl_stable.routing.codecs import ExpertIdRangeError, RoutedRows, RoutingFormatError
from verl_stable.routing.trace import RoutingLayout
from verl_stable.transport.expansion import expand_compact_routing, routing_trace_from_batch
from verl_stable.transport.fields import IDS_FIELD
from verl_stable.transport.options import MANAGER_FQN, RolloutRoutingOptions
from verl_stable.transport.sharing import PROMPT_PARTITION, PromptRowSharing, shared_sample_fields
from verl_stable.transport.side_rows import attach_shared_prompt_rows

LAYOUT = RoutingLayout("qwen3_moe", "qwen3_moe", 5, (1, 2, 4), 2, 8)  # decoder layers 0 and 3 dense


def _moe_rows(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Valid ``[rows, num_moe_layers, top_k]`` uint8 ids: distinct top-k of the model's experts."""
    scores = rng.random((rows, LAYOUT.num_moe_layers, LAYOUT.num_experts))
    return np.argsort(scores, axis=-1)[..., : LAYOUT.top_k].astype(np.uint8)


def _group(prompt_len: int = 5, responses: tuple[int, ...] = (3, 4)):
    """One group sharing its prompt rows: the batch as the actor reads it, the side entry, the reference routing."""
    rng = np.random.default_rng(0)
    prompt = _moe_rows(rng, prompt_len)
    sharing = PromptRowSharing()
    samples, side, reference = [], None, []
    for r in responses:
        ids = np.concatenate([prompt, _moe_rows(rng, r - 1)])
        fields, share = shared_sample_fields(RoutedRows(0, ids), LAYOUT, sharing, prompt_len=prompt_len, uid="u0")
        side = share.side or side
        fields["input_ids"] = torch.arange(prompt_len + r)
        samples.append(fields)
        reference.append(torch.from_numpy(ids))
    return list_of_dict_to_tensordict(samples), side, reference


def _reader(ids: torch.Tensor):
    """TransferQueue's read of one side entry holding ``ids`` (jagged, as TransferQueue hands it back)."""

    def kv_batch_get(keys, partition_id, select_fields):
        assert partition_id == PROMPT_PARTITION and select_fields == [IDS_FIELD]
        out = TensorDict({}, batch_size=[len(keys)])
        out[IDS_FIELD] = torch.nested.as_nested_tensor([ids] * len(keys), layout=torch.jagged)
        return out

    return kv_batch_get


def _wrapping_copy(ids: torch.Tensor) -> torch.Tensor:
    """int64 copy of ``ids`` with one id 256 above an expert that row lacks: uint8 would wrap it to that expert."""
    wide = ids.to(torch.int64).clone()
    row = wide[0, 0].tolist()
    free = next(e for e in range(LAYOUT.num_experts) if e not in row)
    wide[0, 0, 0] = 256 + free
    return wide


def test_wider_side_entry_with_valid_ids_reattaches_as_before():
    batch, side, reference = _group()
    assert batch[IDS_FIELD].dtype == torch.uint8 and side.ids.dtype == torch.uint8
    trace = routing_trace_from_batch(batch.clone(), LAYOUT, kv_batch_get=_reader(side.ids.to(torch.int64)))
    for seq, ids in zip(trace.split(), reference, strict=True):
        assert torch.equal(seq.to_tensor()[: ids.shape[0]], ids.long())
    widened = batch.clone()
    assert attach_shared_prompt_rows(widened, _reader(side.ids.to(torch.int32)), LAYOUT) == 2
    assert widened[IDS_FIELD].dtype == torch.uint8  # the sample's own dtype, as before


def test_wider_side_entry_is_validated_before_it_is_narrowed():
    batch, side, _ = _group()
    wrapped = _reader(_wrapping_copy(side.ids))
    with pytest.raises(ExpertIdRangeError, match=r"sample 0: shared entry .*expert ids outside \[0, 8\)"):
        expand_compact_routing(batch.clone(), LAYOUT, kv_batch_get=wrapped)
    with pytest.raises(ExpertIdRangeError, match="token position 0, MoE layer 0"):
        routing_trace_from_batch(batch.clone(), LAYOUT, kv_batch_get=wrapped)
    # without a layout the ids must still fit the sample's dtype
    with pytest.raises(ExpertIdRangeError, match=r"expert id 2\d\d does not fit the sample's dtype torch.uint8"):
        attach_shared_prompt_rows(batch.clone(), wrapped)
    with pytest.raises(RoutingFormatError, match="must be integers"):
        attach_shared_prompt_rows(batch.clone(), _reader(side.ids.to(torch.float32)), LAYOUT)


def test_unknown_routing_options_are_refused_by_name():
    cfg = OmegaConf.create({"verl_stable": {"routing": {"share_prompt_row": False, "on_invalid": "raise"}}})
    with pytest.raises(
        ValueError,
        match=r"verl_stable\.routing\.share_prompt_row: unknown key \(known: on_invalid, share_prompt_rows, share_prompt_rows_min_bytes\)$",
    ):
        RolloutRoutingOptions.from_config(cfg)
    with pytest.raises(ValueError, match="verl_stable.routing must be a mapping"):
        RolloutRoutingOptions.from_config({"verl_stable": {"routing": "skip_sample"}})
    known = {
        "verl_stable": {
            "routing": {"on_invalid": "skip_sample", "share_prompt_rows": False, "share_prompt_rows_min_bytes": 4096}
        }
    }
    assert RolloutRoutingOptions.from_config(OmegaConf.create(known)) == RolloutRoutingOptions(
        on_invalid="skip_sample", share_prompt_rows=False, share_prompt_rows_min_bytes=4096
    )


def test_every_name_resolves_and_the_package_import_stays_light():
    for name in rollout.__all__:
        assert getattr(rollout, name) is not None, name
    assert rollout.CompactRoutingAgentLoopManagerTQ.__name__ == MANAGER_FQN.rsplit(".", 1)[1]
    # what the plugin does in every verl process (verl itself brings Ray): verl's agent loop stays unimported
    code = (
        "import sys, verl_stable.integration.rollout as r; r.register(); "
        "heavy = [m for m in ('verl_stable.integration.rollout.agent_loop', 'verl.trainer.ppo.v1.agent_loop_tq') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
