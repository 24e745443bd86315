"""One TransferQueue read per step for verl's metrics and the monitor's: the monitor's fields ride on verl's read.

verl's V1 ``PPOTrainer._compute_metrics`` reads the step's metric fields (``prompts``, ``responses``,
``response_mask``, ``advantages``, ...) from TransferQueue with one ``kv_batch_get``, through
``verl.trainer.ppo.metric_utils.get_metric_data_with_optional_routed_experts``. The monitor needs other fields of
the same samples (``old_log_probs``, ``rollout_log_probs``, ``entropy``, the transport counters, ...) at the same
point; reading them separately costs a second round trip to the storage every step (~7 ms on the 2-core CPU host
of ``docs/explanation/benchmarks.md``, on the step's critical path).

:func:`joint_metrics_read` lets verl's read carry them: for the span of verl's ``_compute_metrics`` the function
above, as ``verl.trainer.ppo.v1.trainer_base`` sees it, hands verl a ``kv_batch_get`` that asks for verl's fields
plus the monitor's (:class:`MonitorRead`) in one request, keeps the monitor's part and returns verl exactly the
fields it asked for. If that combined read fails (a field of the monitor's that no sample has), verl's own read is
made as verl made it and the monitor is left to read alone afterwards; if verl did not read through that function
(another verl version), nothing was taken either: :attr:`MonitorRead.data` stays ``None`` and the caller reads as
before. Either way verl sees the same data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MonitorRead", "joint_metrics_read"]

_READER = "get_metric_data_with_optional_routed_experts"


@dataclass
class MonitorRead:
    """The monitor's fields of one step's samples, to be read along with verl's metric fields.

    Attributes:
        keys: the step's sample keys (verl's ``KVBatchMeta.keys``).
        partition_id: their TransferQueue partition.
        fields: the monitor's fields.
        data: after verl's read, a TensorDict of exactly ``fields``; ``None`` if they were not read with it.
    """

    keys: Sequence[str]
    partition_id: str
    fields: Sequence[str]
    data: Any = field(default=None)

    def wraps(self, kv_batch_get: Callable[..., Any]) -> Callable[..., Any]:
        """``kv_batch_get`` as verl's metrics read calls it, taking the monitor's fields along on this batch's read."""

        def read(keys: Any, partition_id: str, select_fields: Any = None) -> Any:
            if self.data is not None or list(keys) != list(self.keys) or partition_id != self.partition_id:
                return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select_fields)
            asked = [select_fields] if isinstance(select_fields, str) else list(select_fields or ())
            if not asked:  # verl asked for every field: nothing to add, and nothing to strip
                return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select_fields)
            extra = [name for name in self.fields if name not in asked]
            try:
                data = kv_batch_get(keys=keys, partition_id=partition_id, select_fields=asked + extra)
            except ValueError:
                # TransferQueue refuses a field no sample has: verl's read as verl made it (its own errors then come
                # from there); the monitor reads alone afterwards
                return kv_batch_get(keys=keys, partition_id=partition_id, select_fields=select_fields)
            try:
                self.data = data.select(*self.fields)
            except KeyError:  # a field came back for no sample: the monitor reads alone and reports it
                self.data = None
            return data.exclude(*extra) if extra else data

        return read


@contextmanager
def joint_metrics_read(read: MonitorRead | None) -> Iterator[MonitorRead | None]:
    """Within the block, verl's metrics read of ``read.keys`` also brings ``read.fields`` into ``read.data``.

    ``None`` (the monitor reads nothing this step) changes nothing. The function is replaced in
    ``verl.trainer.ppo.v1.trainer_base`` only, where ``_compute_metrics`` looks it up, and restored on exit.
    """
    if read is None:
        yield read
        return
    from verl.trainer.ppo.v1 import trainer_base

    original = getattr(trainer_base, _READER, None)
    if original is None:  # verl reads its metric fields another way: the monitor reads alone
        yield read
        return

    def reader(*args: Any, **kwargs: Any) -> Any:
        if "kv_batch_get" in kwargs and not args:
            kwargs["kv_batch_get"] = read.wraps(kwargs["kv_batch_get"])
        return original(*args, **kwargs)

    # patch: metrics_joint_read (verl_stable.compat.catalogue)
    setattr(trainer_base, _READER, reader)
    try:
        yield read
    finally:
        setattr(trainer_base, _READER, original)
