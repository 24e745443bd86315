"""megatron-core's CUDA device assumptions, answered on the host: fixes 3, 4 and 6 of the Megatron CPU probe.

megatron-core 0.16.1 names its device in two ways, and a CPU build of torch refuses both:

* ``torch.cuda.current_device()`` (some 175 call sites: RoPE ``inv_freq``, router weights, grad buffers, all-to-all
  outputs) and the stream API (the alltoall dispatcher's device-to-host stream, DDP's communication stream, their
  events and ``synchronize``). :data:`CUDA_STUBS` replaces these attributes of ``torch.cuda`` while the runtime is
  installed: the current device is ``"cpu"`` and streams / events are no-ops, which is exact on a device where every
  operation is synchronous.
* About 70 literals: ``device="cuda"``, ``.cuda()`` (the schedules' ``total_num_tokens``, the optimizers'
  ``_dummy_overflow_buf`` / ``found_inf``, clip-grads buffers, the grad scaler, the MoE aux-loss tracker, the causal
  mask of the local attention, the grad-buffer warm-up), and the optimizers' dispatch on
  ``param.type() == "torch.cuda.FloatTensor"``. Patching each site would mean ~70 copies of megatron code, so
  :class:`CudaToCpuMode`, a ``TorchFunctionMode``, rewrites them as torch sees them: a CUDA (or bare integer) device
  becomes ``"cpu"``, ``.cuda()`` and ``.pin_memory()`` return the tensor itself, and ``.type()`` called *from
  megatron code* names the ``torch.cuda`` type of a host tensor.

  Backward passes run without the mode: torch suspends a mode while its handler runs, and ``Tensor.backward`` is
  such a call. megatron runs forward code inside the backward only to recompute activations, through
  ``CheckpointFunction.backward`` and ``CheckpointWithoutOutput._recompute`` (``megatron.core.tensor_parallel.
  random``): :func:`apply_recompute_fix` wraps both to run under the mode (the local attention's causal mask is
  built there again, for one). Every other backward of a megatron autograd function names its device only through
  the stubs (contract ``megatron_backward_device_literals``).

The mode lives on torch's per-thread mode stack: :func:`device_mode` covers the calling thread only (see
:func:`verl_stable.cpu.megatron.runtime.install`). A mode left on another thread's stack after the runtime is
uninstalled is inert (:attr:`CudaToCpuMode.enabled`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from verl_stable.compat.contracts import Contract, ContractError
from verl_stable.cpu.megatron.patching import AttributePatcher

HOST = "cpu"
RECOMPUTE_MODULE = "megatron.core.tensor_parallel.random"
# Only megatron's own code is told that a host tensor is a CUDA tensor (its optimizers dispatch on the type name);
# torch and every other caller keep the truth.
_TYPE_REPORTED_TO = ("megatron.",)


class NullStream:
    """A CUDA stream stand-in: on the host every operation has completed when it returns, so waits are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device(HOST)
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> NullEvent:
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class NullEvent:
    """A CUDA event stand-in: always complete."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


_STREAM = NullStream()


def _current_device() -> str:
    return HOST


def _current_stream(device: Any = None) -> NullStream:
    return _STREAM


def _stream(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _synchronize(device: Any = None) -> None:
    return None


CUDA_STUBS: dict[str, Any] = {
    "current_device": _current_device,
    "Stream": NullStream,
    "Event": NullEvent,
    "current_stream": _current_stream,
    "default_stream": _current_stream,
    "stream": _stream,
    "synchronize": _synchronize,
}
"""``torch.cuda`` attribute -> its host answer while the runtime is installed."""


def apply_cuda_stubs(patcher: AttributePatcher) -> None:
    """Replace the :data:`CUDA_STUBS` attributes of ``torch.cuda`` (restored by ``patcher``)."""
    for name, stub in CUDA_STUBS.items():
        # patch: torch_cuda_device_stubs (verl_stable.compat.catalogue)
        patcher.set(torch.cuda, name, stub)


# ---------------------------------------------------------------------------------------------------------- the mode
def _is_accelerator(device: Any) -> bool:
    """Whether a ``device`` argument names CUDA: ``"cuda"``, ``"cuda:N"``, a cuda ``torch.device`` or a bare index."""
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _host_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "device" in kwargs and _is_accelerator(kwargs["device"]):
        kwargs = {**kwargs, "device": HOST}
    if kwargs.get("pin_memory"):
        # pinning page-locks host memory for copies to an accelerator; without one torch refuses it
        kwargs = {**kwargs, "pin_memory": False}
    return kwargs


def _self(mode: CudaToCpuMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    return args[0]


def _to(mode: CudaToCpuMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    if len(args) > 1 and _is_accelerator(args[1]):
        args = (args[0], HOST, *args[2:])
    return func(*args, **_host_kwargs(kwargs))


def _type(mode: CudaToCpuMode, func: Callable, args: tuple, kwargs: dict) -> Any:
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    if isinstance(target, str) and target.startswith("torch.cuda."):
        return func(args[0], "torch." + target[len("torch.cuda.") :], *args[2:], **kwargs)
    result = func(*args, **kwargs)
    if target is None and isinstance(result, str) and args[0].device.type == HOST and _caller_is_megatron():
        return result.replace("torch.", "torch.cuda.", 1)
    return result


def _caller_is_megatron() -> bool:
    # frame 0: this function, 1: _type, 2: __torch_function__, 3: the code that called tensor.type()
    caller = sys._getframe(3).f_globals.get("__name__", "")
    return caller.startswith(_TYPE_REPORTED_TO)


_SPECIAL: dict[Callable, Callable[[CudaToCpuMode, Callable, tuple, dict], Any]] = {
    torch.Tensor.cuda: _self,
    torch.Tensor.pin_memory: _self,
    torch.Tensor.to: _to,
    torch.Tensor.type: _type,
}


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites megatron-core's CUDA device literals to the host (see the module docstring).

    Attributes:
        enabled: while False every call passes through untouched (a mode left on another thread's stack after
            the runtime was uninstalled).
    """

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.enabled:
            return func(*args, **kwargs)
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, func, args, kwargs)
        return func(*args, **_host_kwargs(kwargs))


def active_mode() -> CudaToCpuMode | None:
    """The enabled :class:`CudaToCpuMode` on this thread's mode stack, if any."""
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, CudaToCpuMode) and mode.enabled:
            return mode
    return None


@contextlib.contextmanager
def device_mode() -> Iterator[CudaToCpuMode]:
    """Within the block (this thread), megatron's CUDA literals run on the host; an enclosing mode is reused."""
    mode = active_mode()
    if mode is not None:
        yield mode
        return
    mode = CudaToCpuMode()
    with mode:
        yield mode


# ------------------------------------------------------------------------------------------------- recomputation
def under_device_mode(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` run under :func:`device_mode` (for megatron code the backward pass runs)."""

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        with device_mode():
            return original(*args, **kwargs)

    run.__verl_stable_wrapped__ = original  # type: ignore[attr-defined]
    return run


def _unwrapped(function: Any) -> Any:
    function = function.__func__ if isinstance(function, staticmethod) else function
    return getattr(function, "__verl_stable_wrapped__", function)


def apply_recompute_fix(patcher: AttributePatcher) -> None:
    """Run megatron's activation recomputation under the device mode (needs ``RECOMPUTE_MODULE`` imported)."""
    import megatron.core.tensor_parallel.random as random

    backward = _unwrapped(vars(random.CheckpointFunction)["backward"])
    # patch: megatron_recompute_backward (verl_stable.compat.catalogue)
    patcher.set(random.CheckpointFunction, "backward", staticmethod(under_device_mode(backward)))
    recompute = _unwrapped(vars(random.CheckpointWithoutOutput)["_recompute"])
    # patch: megatron_recompute_without_output (verl_stable.compat.catalogue)
    patcher.set(random.CheckpointWithoutOutput, "_recompute", under_device_mode(recompute))


# ----------------------------------------------------------------------------------------------------- contracts
def _cuda_stub_names() -> str:
    missing = [name for name in CUDA_STUBS if not hasattr(torch.cuda, name)]
    if missing:
        raise ContractError(f"torch.cuda no longer has {missing}")
    return f"torch.cuda.{{{', '.join(CUDA_STUBS)}}} exist"


def _optimizer_type_dispatch() -> str:
    from megatron.core.optimizer import distrib_optimizer, optimizer

    for owner, method in (
        (distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups"),
        (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
    ):
        if "torch.cuda.FloatTensor" not in inspect.getsource(getattr(owner, method)):
            raise ContractError(f"{owner.__name__}.{method} no longer dispatches on param.type() names")
    return "the optimizers dispatch on param.type() == 'torch.cuda.*Tensor' (reported for host tensors)"


# Only used with moe_permute_fusion / Triton kernels, which the CPU runtime never enables.
_FUSED_BACKWARDS = ("megatron/core/fusions/fused_indices_converter.py",)
_CUDA_LITERAL = re.compile(r"""device=['"]cuda|\.cuda\(|['"]cuda['"]""")


def _backward_device_literals() -> str:
    import megatron.core

    root = Path(megatron.core.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="ignore")
        if "def backward" not in text or not _CUDA_LITERAL.search(text):
            continue
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name == "backward":
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                where = path.relative_to(root.parent.parent).as_posix()
                if _CUDA_LITERAL.search(body) and where not in _FUSED_BACKWARDS:
                    found.append(f"{where}:{node.lineno}")
    if found:
        raise ContractError(f"backward code names CUDA where the device mode is suspended: {found}")
    return "no autograd backward of megatron-core names CUDA except through torch.cuda.current_device()"


def _recompute_entry_points() -> str:
    import megatron.core.tensor_parallel.random as random

    for owner, name, call in (
        (random.CheckpointFunction, "backward", "ctx.run_function("),
        (random.CheckpointWithoutOutput, "_recompute", "run_function("),
    ):
        if name not in vars(owner):
            raise ContractError(f"{owner.__name__}.{name} missing")
        if call not in inspect.getsource(_unwrapped(vars(owner)[name])):
            raise ContractError(f"{owner.__name__}.{name} no longer recomputes through {call}...)")
    return "activation recomputation runs through CheckpointFunction.backward / CheckpointWithoutOutput._recompute"


CONTRACTS: tuple[Contract, ...] = (
    Contract("megatron_cuda_stub_names", "torch.cuda has the stream / device API the runtime stubs", _cuda_stub_names),
    Contract(
        "megatron_optimizer_type_dispatch",
        "megatron optimizers dispatch on 'torch.cuda.*Tensor' type names",
        _optimizer_type_dispatch,
    ),
    Contract(
        "megatron_recompute_entry_points",
        "megatron recomputes activations in the backward through two functions",
        _recompute_entry_points,
    ),
    Contract(
        "megatron_backward_device_literals",
        "megatron backward code needs no device mode (torch suspends it there)",
        _backward_device_literals,
    ),
)
