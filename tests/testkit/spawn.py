"""Run N spawned processes (e.g. gloo ranks) that each report once through a queue; their tensors go through files."""

from __future__ import annotations

import queue as queue_lib
import traceback
from collections.abc import Callable, Sequence

import pytest
import torch


def report(results, ident: dict, body: Callable[[], dict], path: str) -> None:
    """Process side: ``torch.save(body(), path)``, then put ``ident`` on ``results`` (with ``"error"``: the traceback,
    when ``body`` raised, which is raised again). Tensors go through the file: a queue would pass shared-memory handles
    that die with the process."""
    try:
        torch.save(body(), path)
        results.put(ident)
    except BaseException:
        results.put({**ident, "error": traceback.format_exc()})
        raise


def spawn_and_collect(target: Callable, args: Sequence[tuple], *, timeout: int, what: str) -> list[dict]:
    """Test side: one spawned ``target(*a, results)`` per ``a`` in ``args``; waits up to ``timeout`` s for each
    report (fails the test naming ``what`` when one does not come), joins or kills the processes, fails on any report
    with an ``"error"``. Returns the reports in arrival order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, results)) for a in args]
    for proc in procs:
        proc.start()
    outs = []
    try:
        for _ in procs:
            outs.append(results.get(timeout=timeout))
    except queue_lib.Empty:
        pytest.fail(f"a {what} did not report within {timeout} s; exit codes {[p.exitcode for p in procs]}")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [o["error"] for o in outs if "error" in o]
    assert not errors, "\n".join(errors)
    return outs
