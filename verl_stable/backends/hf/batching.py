"""Cross-request batching for an async server: requests that arrive together run as one batch call.

verl's agent loop sends every sample of a step to the rollout server as its own ``generate`` request, concurrently.
Sampling them one at a time costs one prefill and one decode forward per token per request; :class:`RequestBatcher`
collects the requests that are waiting, groups those that can share a forward (same key: the ``hf`` server uses the
prompt length, so no padding is needed), and runs each group with one blocking call in a worker thread. Requests that
arrive while a batch runs wait for the next one, so batches grow with the load and a lone request is not delayed by
more than ``window_s``. Which requests share a batch depends on timing; a request with a sampling seed samples the
same tokens in any batch (:class:`verl_stable.backends.hf.generation.SamplingSpec`), so timing does not change what is sampled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class BatchingStats:
    """Counts since start: ``requests`` served, ``batches`` run, ``largest`` batch size."""

    requests: int = 0
    batches: int = 0
    largest: int = 0

    def record(self, size: int) -> None:
        self.requests += size
        self.batches += 1
        self.largest = max(self.largest, size)


class RequestBatcher:
    """Collects concurrent requests and runs them in batches of equal key.

    Args:
        run_batch: blocking ``items -> results`` (one result per item, same order); runs in a worker thread. An
            exception fails every request of that batch with it.
        key: groups items that may share a batch.
        max_batch_size: largest batch (1 serves requests one at a time, in arrival order).
        window_s: how long the first waiting request waits for company before its batch starts.
    """

    def __init__(
        self,
        run_batch: Callable[[Sequence[Any]], Sequence[Any]],
        key: Callable[[Any], Hashable],
        max_batch_size: int = 64,
        window_s: float = 0.005,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.run_batch, self.key = run_batch, key
        self.max_batch_size, self.window_s = int(max_batch_size), float(window_s)
        self.stats = BatchingStats()
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def submit(self, item: Any) -> Any:
        """Queue ``item`` and return its result once its batch has run."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await future

    def _take_batch(self) -> list[tuple[Any, asyncio.Future]]:
        """The oldest request and up to ``max_batch_size - 1`` later ones of the same key (arrival order kept)."""
        first_key = self.key(self._pending[0][0])
        batch, rest = [], []
        for entry in self._pending:
            if len(batch) < self.max_batch_size and self.key(entry[0]) == first_key:
                batch.append(entry)
            else:
                rest.append(entry)
        self._pending = rest
        return batch

    async def _drain(self) -> None:
        while self._pending:
            if self.window_s:
                await asyncio.sleep(self.window_s)
            batch = self._take_batch()
            items = [item for item, _ in batch]
            try:
                results = await asyncio.to_thread(self.run_batch, items)
                if len(results) != len(items):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(items)} requests")
            except Exception as exc:  # noqa: BLE001 - delivered to every request of the batch
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.stats.record(len(items))
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
