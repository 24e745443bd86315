"""TransferQueue's KV interface in memory, for tests of code that reads and writes verl's V1 batches.

The behaviour is the real package's: a missing key raises ``ValueError("keys or partition were not found!")``
(checked against it), a selected field that a sample lacks raises ``ValueError`` too (``kv_batch_get``'s documented
refusal of "empty fields"), tags merge on put, ``kv_list(partition)`` answers ``{partition: {key: tag}}``, and per-sample tensors come back jagged.
A real TransferQueue needs a Ray cluster with three CPUs for its controller and storage units; the e2e runs exercise it.
``gets`` records the ``select_fields`` of every ``kv_batch_get``.
"""

from __future__ import annotations

import asyncio

import torch
from verl.utils.tensordict_utils import list_of_dict_to_tensordict


class KVStore:
    """TransferQueue's KV interface in memory: ``{partition: {key: (fields, tag)}}``."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, tuple[dict, dict]]] = {}
        self.gets: list[list[str] | None] = []

    def kv_put(self, key, partition_id, fields=None, tag=None):
        self.kv_batch_put([key], partition_id, fields, [tag] if tag is not None else None)

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        part = self.data.setdefault(partition_id, {})
        for i, key in enumerate(keys):
            old_fields, old_tag = part.get(key, ({}, {}))
            if fields is not None:
                sample = fields[i]
                old_fields = {**old_fields, **{k: sample[k] for k in sample.keys()}}
            part[key] = (old_fields, {**old_tag, **(tags[i] if tags else {})})

    async def async_kv_put(self, key, partition_id, fields=None, tag=None):
        await asyncio.sleep(0)  # a real put yields to the event loop
        self.kv_put(key, partition_id, fields, tag)

    async def async_kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        await asyncio.sleep(0)
        self.kv_batch_put(keys, partition_id, fields, tags)

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        part = self.data.get(partition_id, {})
        if any(k not in part for k in keys):
            raise ValueError("keys or partition were not found!")
        self.gets.append(None if select_fields is None else list(select_fields))
        rows = []
        for key in keys:
            fields = part[key][0]
            missing = [f for f in (select_fields or ()) if f not in fields]
            if missing:
                raise ValueError(f"empty fields {missing} in sample {key}")
            rows.append({f: fields[f] for f in (select_fields or fields)})
        # TransferQueue hands per-sample tensors back jagged, even equal-sized ones and a batch of one
        ragged = [f for f, v in rows[0].items() if isinstance(v, torch.Tensor) and v.dim() >= 1]
        out = list_of_dict_to_tensordict([{f: v for f, v in r.items() if f not in ragged} for r in rows])
        for f in ragged:
            out[f] = torch.nested.as_nested_tensor([r[f] for r in rows], layout=torch.jagged)
        return out

    def kv_list(self, partition_id=None):
        parts = self.data if partition_id is None else {partition_id: self.data.get(partition_id, {})}
        return {p: {k: tag for k, (_, tag) in items.items()} for p, items in parts.items() if p in self.data}

    def kv_clear(self, keys, partition_id):
        for key in [keys] if isinstance(keys, str) else keys:
            self.data.get(partition_id, {}).pop(key, None)

    async def async_kv_list(self, partition_id=None):
        await asyncio.sleep(0)
        return self.kv_list(partition_id)

    async def async_kv_clear(self, keys, partition_id):
        await asyncio.sleep(0)
        self.kv_clear(keys, partition_id)
