"""Cross-request batching: concurrent requests share batch calls by key, results go back to their own request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from verl_stable.backends.hf.batching import RequestBatcher


def _recording_batcher(**kwargs):
    calls: list[list] = []

    def run_batch(items):
        assert threading.current_thread() is not threading.main_thread()  # blocking work stays off the event loop
        calls.append(list(items))
        return [f"{item}!" for item in items]

    return RequestBatcher(run_batch, key=len, **kwargs), calls


def test_concurrent_requests_are_grouped_by_key_and_answered_in_order():
    batcher, calls = _recording_batcher(max_batch_size=3)
    items = ["ab", "cd", "xyz", "ef", "gh", "ij", "uvw"]

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in items))

    assert asyncio.run(main()) == [f"{i}!" for i in items]
    # oldest first; a batch holds one key and at most 3 items, arrival order within a batch
    assert calls == [["ab", "cd", "ef"], ["xyz", "uvw"], ["gh", "ij"]]
    assert (batcher.stats.requests, batcher.stats.batches, batcher.stats.largest) == (7, 3, 3)


def test_max_batch_size_one_serves_one_request_per_call():
    batcher, calls = _recording_batcher(max_batch_size=1, window_s=0.0)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in ["a", "b", "c"]))

    assert asyncio.run(main()) == ["a!", "b!", "c!"]
    assert calls == [["a"], ["b"], ["c"]]


def test_requests_arriving_during_a_batch_form_the_next_one():
    batcher, calls = _recording_batcher(window_s=0.001)

    async def main():
        first = asyncio.gather(*(batcher.submit(i) for i in ["a", "b"]))
        await asyncio.sleep(0.05)
        second = asyncio.gather(*(batcher.submit(i) for i in ["c", "d", "e"]))
        return await first, await second

    assert asyncio.run(main()) == (["a!", "b!"], ["c!", "d!", "e!"])
    assert calls == [["a", "b"], ["c", "d", "e"]]


def test_a_failing_batch_fails_its_requests_only():
    def run_batch(items):
        if "bad" in items:
            raise ValueError("engine failed")
        return [i.upper() for i in items]

    batcher = RequestBatcher(run_batch, key=len)

    async def main():
        return await asyncio.gather(*(batcher.submit(i) for i in ["bad", "ok", "fine", "abc"]), return_exceptions=True)

    got = asyncio.run(main())
    assert isinstance(got[0], ValueError) and isinstance(got[3], ValueError)  # "bad" and "abc" share length 3
    assert got[1:3] == ["OK", "FINE"]


def test_wrong_result_count_and_bad_settings_are_errors():
    batcher = RequestBatcher(lambda items: items[:-1], key=len)
    with pytest.raises(RuntimeError, match="returned 0 results for 1 requests"):
        asyncio.run(batcher.submit("a"))
    with pytest.raises(ValueError, match="max_batch_size"):
        RequestBatcher(lambda items: items, key=len, max_batch_size=0)
    with pytest.raises(ValueError, match="window_s"):
        RequestBatcher(lambda items: items, key=len, window_s=-1)
