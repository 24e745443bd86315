"""What the prefork server imports, what those imports read of the environment, and which children it may fork.

A forked child inherits the preloaded modules (:data:`PRELOAD`), and their state is what those imports made of the
*server's* environment and working directory. :func:`preload` imports them while recording every variable they read
from Python (:class:`EnvReads`); :func:`import_time_differences` compares those, and every variable native code reads
at load or first use (:data:`NATIVE_PREFIXES`), between the server's environment and a child's. A difference means
the child would not be the process it replaces: the server (:mod:`verl_stable.cpu.prefork_server`) refuses it, except
for the thread count (:data:`THREAD_VARIABLES`), which the child fixes with ``torch.set_num_threads``. Ray is never
preloaded (:data:`NEVER_PRELOADED`): ``import ray`` fixes Ray's C++ configuration from the environment of the
importing process, and a worker's job id (``RAY_JOB_ID``) is in it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

# What a verl process imports that does not import Ray, heaviest first in practice (``python -X importtime`` of the
# modules a CPU run's actors live in: torch with torch._dynamo ~2.2 s, transformers with modeling_utils and
# processing_utils ~1.3 s, datasets with pyarrow ~0.5 s, peft ~1 s, pandas, scipy.optimize, hydra). Everything a
# verl process imports besides these -- verl, Ray, TransferQueue, tensordict, verl-stable -- is ~1.2 s.
PRELOAD: tuple[str, ...] = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "numpy",
    "pandas",
    "pyarrow",
    "datasets",
    "omegaconf",
    "hydra",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",
    "peft",
    "scipy.optimize",
)
# never preloaded: importing Ray reads Ray's C++ configuration from the environment once (a worker's RAY_JOB_ID among
# it); verl and TransferQueue import Ray
NEVER_PRELOADED: tuple[str, ...] = ("ray", "verl", "transfer_queue", "vllm", "megatron")

# Read by native code when a library loads or on first use, so the preload's Python-level record cannot see them:
# OpenMP and MKL thread pools, the allocator, the dynamic loader, the interpreter's own start-up, ATen's CPU dispatch
# and oneDNN, torch's C++ flags.
NATIVE_PREFIXES: tuple[str, ...] = (
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "LD_",
    "PYTHON",
    "ATEN_",
    "DNNL_",
    "ONEDNN_",
    "TORCH_",
    "PYTORCH_",
)
# variables under those prefixes that no native code reads when a library loads; each with the reason
NATIVE_EXEMPT: dict[str, str] = {
    # verl's Megatron engine package sets it in the driver (CPU hosts); only torch.utils.cpp_extension reads it, from
    # Python, when it builds a CUDA extension -- which the record of the preload's reads would show
    "TORCH_CUDA_ARCH_LIST": "read only when building CUDA extensions",
}
# OpenMP reads them when torch loads; a child whose environment has another value gets it from torch.set_num_threads
THREAD_VARIABLES: tuple[str, ...] = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Ray sets OMP_NUM_THREADS in a worker's os.environ when it starts an actor's creation task without one set
# (ray._private.utils.set_omp_num_threads_if_unset: the actor's CPUs, 1 for an actor without num_cpus), before the
# actor's module -- and torch with it -- is imported: in a plain worker OpenMP reads that value
RAY_THREAD_SETTER = "ray._private.utils"
# modules whose import walks the whole environment for a prefix of their own (tqdm's envwrap, fsspec's config)
KNOWN_SCANS: dict[str, str] = {"tqdm.utils": "TQDM_", "fsspec.config": "FSSPEC_"}
# frames skipped when naming the module that reads os.environ: the mapping's own code, and the prefork server's
# modules (all one module before the split, whose name was the one entry here)
_PLUMBING = (
    "os",
    "_collections_abc",
    "collections.abc",
    "typing",
    "verl_stable.cpu.prefork",
    "verl_stable.cpu.prefork_preload",
    "verl_stable.cpu.prefork_protocol",
    "verl_stable.cpu.prefork_server",
)


@dataclass
class EnvReads:
    """What the imports inside :meth:`recording` read of ``os.environ``.

    Attributes:
        values: name -> the value it had when first read (``None``: unset), for reads from Python code.
        scans: module -> the prefix it scanned the environment for (``None``: a module not in :data:`KNOWN_SCANS`,
            so the prefix is unknown).
        cwd: the working directory during the imports (torch._dynamo and torch._inductor derive their debug and
            cache directories from it when they load); ``None``: not recorded.
    """

    values: dict[str, str | None] = field(default_factory=dict)
    scans: dict[str, str | None] = field(default_factory=dict)
    cwd: str | None = None

    @staticmethod
    def _reader() -> str:
        """The module of the nearest frame outside ``os``, ``collections.abc`` and this module."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "") in _PLUMBING:
            frame = frame.f_back
        return "" if frame is None else frame.f_globals.get("__name__", "")

    @contextmanager
    def recording(self) -> Iterator[EnvReads]:
        """Record every read of ``os.environ`` (``[]``, ``get``, ``in``, ``os.getenv``, iteration) in the block.

        ``os._Environ``'s ``__getitem__`` and ``__iter__`` are wrapped for the span of the block and restored after.
        A read made by a scanning module (iteration) counts as part of its scan, not as a read of each name.
        """
        environ_cls = type(os.environ)
        getitem, iterate = environ_cls.__getitem__, environ_cls.__iter__
        record = self

        def recorded_getitem(environ: os._Environ, key: str) -> str:
            reader = EnvReads._reader()
            try:
                value = getitem(environ, key)
            except KeyError:
                if reader not in record.scans:
                    record.values.setdefault(key, None)
                raise
            if reader not in record.scans:
                record.values.setdefault(key, value)
            return value

        def recorded_iter(environ: os._Environ) -> Iterator[str]:
            reader = EnvReads._reader()
            record.scans.setdefault(reader, KNOWN_SCANS.get(reader))
            return iterate(environ)

        self.cwd = os.getcwd()
        # patch: prefork_env_reads (verl_stable.compat.catalogue)
        environ_cls.__getitem__, environ_cls.__iter__ = recorded_getitem, recorded_iter
        try:
            yield self
        finally:
            environ_cls.__getitem__, environ_cls.__iter__ = getitem, iterate

    def unknown_scans(self) -> list[str]:
        """Modules that walked the whole environment for a prefix this module does not know."""
        return sorted(m for m, prefix in self.scans.items() if prefix is None)


def import_time_differences(
    reads: EnvReads, server_env: Mapping[str, str], child_env: Mapping[str, str]
) -> tuple[list[str], list[str]]:
    """Which variables a child would see differently from what the preload saw, and which of them can be fixed.

    Compared: every variable the preload read (:attr:`EnvReads.values`, against the value it read), every variable
    under a scanned prefix and under :data:`NATIVE_PREFIXES` (against the server's environment, where either side
    sets it), :data:`NATIVE_EXEMPT` left out.

    Returns:
        ``(refused, fixed)``: names whose difference rules the fork out, and names among
        :data:`THREAD_VARIABLES` whose difference the child fixes (a positive integer in the child's environment).
    """
    seen: dict[str, str | None] = dict(reads.values)
    prefixes = (*NATIVE_PREFIXES, *(p for p in reads.scans.values() if p))
    for name in set(server_env) | set(child_env):
        if name.startswith(prefixes) and name not in NATIVE_EXEMPT:
            seen.setdefault(name, server_env.get(name))
    refused, fixed = [], []
    for name, value in sorted(seen.items()):
        if child_env.get(name) == value:
            continue
        if name in THREAD_VARIABLES and child_env.get(name, "").isdigit() and int(child_env[name]) > 0:
            fixed.append(name)
        else:
            refused.append(name)
    return refused, fixed


def preload(modules: Sequence[str] = PRELOAD) -> EnvReads:
    """Import ``modules`` while recording their reads of the environment.

    The skip groups the environment names (:mod:`verl_stable.compat.skip_imports`) are installed first, as the
    plugin installs them in every verl process, so that a preloaded package never imports one.

    Raises:
        RuntimeError: a module of :data:`NEVER_PRELOADED` was imported, or an import walked the environment for a
            prefix not in :data:`KNOWN_SCANS` (no fork could be checked then).
    """
    from verl_stable.compat import skip_imports

    reads = EnvReads()
    with reads.recording():
        skip_imports.install(skip_imports.requested())
        for name in modules:
            importlib.import_module(name)
    loaded = sorted(m for m in NEVER_PRELOADED if m in sys.modules)
    if loaded:
        raise RuntimeError(f"the preload imported {loaded}; those must be imported by each process itself")
    if reads.unknown_scans():
        raise RuntimeError(f"imports walked the whole environment: {reads.unknown_scans()}; cannot check forks")
    return reads
