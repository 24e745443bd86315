"""Every ``VERL_STABLE_*`` environment variable verl-stable reads: one typed reader per variable, and :func:`check_all`.

A variable is read deep inside a run (verl's plugin in every process, the CPU runtime in a Ray worker, the launcher
after it moved the earlier run's files aside), where a bad value is found late or -- worse -- taken for something
else. So each variable has one reader here (:class:`EnvVar`: its name, the values it accepts, the parse function,
the value when unset), used both where the variable takes effect and by the commands' preflight
(:func:`check_all`, called by ``verl-stable run``, ``recipe run-cpu``, ``lab`` and
:func:`verl_stable.toy.trainer_process.run_main_ppo` before they build, move or start anything). A refusal names the
variable, the value and the accepted values. A ``VERL_STABLE_`` name that none of them reads (a misspelt one) is
refused too, naming the closest known name: it would otherwise take no effect in silence.

This module imports nothing from the project at import time: verl's plugin imports it in every process verl starts.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")

PREFIX = "VERL_STABLE_"


class EnvVarError(ValueError):
    """A ``VERL_STABLE_*`` variable holds a value its reader refuses; the message names it and the accepted values."""


def _shown(raw: str) -> str:
    # bare when it reads unambiguously (a path, a list), quoted when blanks or control characters would hide in it
    return raw if raw and raw.strip() == raw and raw.isprintable() else repr(raw)


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: its name, the values it accepts (in words), how it is parsed, its value when unset.

    Attributes:
        name: the variable, ``VERL_STABLE_...``.
        accepted: the accepted values in words; every refusal ends with it, and the docs table shows it.
        parse: the raw string (set, possibly empty) -> the value; raises ``ValueError`` with a reason phrased as a
            predicate of the value (``"is not a number"``).
        unset: the value when the variable is not set at all.
        doc: what the variable does and who reads it.
    """

    name: str
    accepted: str
    parse: Callable[[str], T]
    unset: T
    doc: str

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The variable's value in ``environ`` (default ``os.environ``).

        Raises:
            EnvVarError: a value :attr:`parse` refuses, naming the variable, the value and :attr:`accepted`.
        """
        environ = os.environ if environ is None else environ
        raw = environ.get(self.name)
        if raw is None:
            return self.unset
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise EnvVarError(f"{self.name}={_shown(raw)} {exc}; expected {self.accepted}") from None

    def problem(self, environ: Mapping[str, str] | None = None) -> str | None:
        """:meth:`read`'s refusal as a line; None when the value is accepted (or unset)."""
        try:
            self.read(environ)
        except EnvVarError as exc:
            return str(exc)
        return None


# ------------------------------------------------------------------------------------------------ parse functions
def names(raw: str) -> tuple[str, ...]:
    """A comma-separated list: the names, stripped, in order, without repeats or empty entries."""
    return tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))


def _known(chosen: tuple[str, ...], known: tuple[str, ...], what: str, known_label: str) -> None:
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"names unknown {what} {unknown}; {known_label}: {', '.join(known)}")


def registration_steps() -> tuple[str, ...]:
    """The names of the plugin's registration steps (:data:`verl_stable.integration.plugin.REGISTRATION_STEPS`)."""
    # imported only when the variable is set: the plugin imports verl (it is verl's plugin)
    from verl_stable.integration.plugin import REGISTRATION_STEPS

    return tuple(name for name, _ in REGISTRATION_STEPS)


def parse_skip_steps(raw: str) -> frozenset[str]:
    """``name[,name...]`` of registration steps -> the set; an unknown name raises (a typo must not pass)."""
    chosen = names(raw)
    if chosen:
        _known(chosen, registration_steps(), "steps", "known steps")
    return frozenset(chosen)


def skip_groups() -> tuple[str, ...]:
    """The skip groups :mod:`verl_stable.compat.skip_imports` knows."""
    from verl_stable.compat.skip_imports import GROUPS

    return tuple(GROUPS)


def parse_skip_imports(raw: str) -> tuple[str, ...]:
    """``group[,group...]`` -> the groups in order without repeats; an unknown group raises."""
    chosen = names(raw)
    _known(chosen, skip_groups(), "groups", "known")
    return chosen


def parse_lr_spike(raw: str) -> tuple[int, float] | None:
    """``"<k>:<factor>"`` -> ``(k, factor)``; empty -> None (no fault).

    Raises:
        ValueError: not two fields, ``k`` not an integer >= 1, or ``factor`` not a finite number > 0.
    """
    if not raw:
        return None
    parts = raw.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        step, factor = int(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError("is not '<optimizer step>:<factor>'") from None
    if step < 1 or not (math.isfinite(factor) and factor > 0):
        raise ValueError("is out of range: the step must be >= 1 and the factor a finite number > 0")
    return step, factor


def parse_seconds(raw: str) -> float | None:
    """A finite number of seconds > 0; empty (or blank) -> None."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(value):
        raise ValueError("is not finite")
    if value <= 0:
        raise ValueError("is not > 0")
    return value


def parse_switch(raw: str) -> bool:
    """``"1"`` -> True, ``"0"`` -> False; nothing else (``off``, ``false``, `` 0``: a guess would be silent)."""
    if raw not in ("0", "1"):
        raise ValueError("is neither 0 nor 1")
    return raw == "1"


def parse_socket(raw: str) -> Path | None:
    """The path of an existing unix socket; empty -> None."""
    if not raw:
        return None
    path = Path(raw)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise ValueError(f"cannot be reached ({exc.strerror or exc})") from None
    if not stat.S_ISSOCK(mode):
        raise ValueError("is not a unix socket")
    return path


def parse_recipes_dir(raw: str) -> Path | None:
    """A verl-stable recipes directory (one with ``fsdp/`` in it); empty -> None (the default location)."""
    if not raw:
        return None
    if not (Path(raw) / "fsdp").is_dir():
        raise ValueError("is not a verl-stable recipes directory (no fsdp/ in it)")
    return Path(raw)


def parse_prefixes(raw: str) -> tuple[str, ...]:
    """Comma-separated run-name prefixes (empty entries dropped)."""
    return names(raw)


# ------------------------------------------------------------------------------------------------ the variables
SKIP_STEPS: EnvVar[frozenset[str]] = EnvVar(
    "VERL_STABLE_SKIP_STEPS",
    "a comma-separated list of the plugin's registration steps (`verl-stable doctor` lists them); unset or empty: "
    "none skipped",
    parse_skip_steps,
    frozenset(),
    "Leaves registration steps of verl's plugin out in every process verl starts (e.g. fsdp_router_replay, to "
    "compare with an upstream verl that ships the feature). Read by verl_stable.integration.plugin.",
)
SKIP_IMPORTS: EnvVar[tuple[str, ...]] = EnvVar(
    "VERL_STABLE_SKIP_IMPORTS",
    "a comma-separated list of the skip groups megatron, vllm; empty: none (unset: the CPU launcher chooses)",
    parse_skip_imports,
    (),
    "Keeps packages a run does not use from being imported in every verl process (megatron-core, vLLM). The CPU "
    "launcher sets it for the groups a run does not need unless it is set. Read by verl_stable.compat.skip_imports.",
)
FAULT_LR_SPIKE: EnvVar[tuple[int, float] | None] = EnvVar(
    "VERL_STABLE_FAULT_LR_SPIKE",
    "'<k>:<factor>', an optimizer step k >= 1 and a finite factor > 0 (e.g. 3:1000); unset or empty: no fault",
    parse_lr_spike,
    None,
    "TEST-ONLY: the k-th optimizer step of every FSDP training engine of a CPU run runs at factor times its learning "
    "rate. Read by verl_stable.cpu.faults (processes that selected the CPU platform).",
)
POLL_INTERVAL_S: EnvVar[float | None] = EnvVar(
    "VERL_STABLE_POLL_INTERVAL_S",
    "a finite number of seconds > 0 (e.g. 0.1); unset or empty: verl's 2 s",
    parse_seconds,
    None,
    "verl's replay buffer polls TransferQueue on this interval. The CPU launcher sets it for its runs: "
    "`verl-stable run --poll-interval` when given, else this variable when set, else 0.1. Read by "
    "verl_stable.cpu.polling.",
)
PREFORK: EnvVar[bool] = EnvVar(
    "VERL_STABLE_PREFORK",
    "0 (off) or 1 (on); unset: on (Linux only)",
    parse_switch,
    True,
    "Whether a CPU run starts its processes through the prefork server (verl_stable.cpu.prefork). Read by the CPU "
    "launcher (verl_stable.toy.trainer_process).",
)
PREFORK_SOCKET: EnvVar[Path | None] = EnvVar(
    "VERL_STABLE_PREFORK_SOCKET",
    "the path of a running prefork server's unix socket; unset or empty: the launcher starts a server per run",
    parse_socket,
    None,
    "Set by the CPU launcher for the processes of a run: the prefork server they start through. A launcher that "
    "finds it set uses that server. Read by verl_stable.toy.trainer_process and verl_stable.cpu.prefork_client.",
)
RECIPES: EnvVar[Path | None] = EnvVar(
    "VERL_STABLE_RECIPES",
    "a verl-stable recipes directory (one with fsdp/ in it); unset or empty: the checkout's recipes/, else "
    "<prefix>/share/verl-stable/recipes",
    parse_recipes_dir,
    None,
    "Where the recipes are. Read by verl_stable.recipes.compose.",
)
LAB_FORCE_START_FAILURE: EnvVar[tuple[str, ...]] = EnvVar(
    "VERL_STABLE_LAB_FORCE_START_FAILURE",
    "comma-separated prefixes of the sweep's run names (<variant>__N<n>__s<seed>); unset or empty: none",
    parse_prefixes,
    (),
    "TEST-ONLY: the first attempt of the lab's runs with these name prefixes fails while Ray starts, to exercise "
    "the retry. Read by verl_stable.lab.attempts.",
)

READERS: tuple[EnvVar, ...] = (
    SKIP_STEPS,
    SKIP_IMPORTS,
    FAULT_LR_SPIKE,
    POLL_INTERVAL_S,
    PREFORK,
    PREFORK_SOCKET,
    RECIPES,
    LAB_FORCE_START_FAILURE,
)
"""Every variable the package reads, in the order of the docs table."""

SCRIPT_VARIABLES: dict[str, str] = {
    "VERL_STABLE_NO_VLLM": "scripts/install_cpu.sh: 1 leaves vLLM's CPU build out",
    "VERL_STABLE_NO_MEGATRON": "scripts/install_cpu.sh: 1 leaves megatron-core and mbridge out",
    "VERL_STABLE_TEST_WORKERS": "scripts/test.sh: pytest-xdist workers",
}
"""Variables the shell scripts read (not the package): known names, their values are the scripts' business."""


def known_names() -> tuple[str, ...]:
    """Every ``VERL_STABLE_*`` name verl-stable (package or scripts) reads."""
    return (*(v.name for v in READERS), *SCRIPT_VARIABLES)


def check_all(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every problem of the ``VERL_STABLE_*`` variables in ``environ`` (default ``os.environ``), one line each.

    A value a reader refuses, and a ``VERL_STABLE_`` name that nothing reads (with the closest known name). Empty when
    all is well; never raises.
    """
    environ = os.environ if environ is None else environ
    problems = [p for p in (v.problem(environ) for v in READERS) if p is not None]
    known = known_names()
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"{name} is not a variable verl-stable reads{hint}; known: {', '.join(known)}")
    return problems


def check(environ: Mapping[str, str] | None = None) -> None:
    """:func:`check_all` as one refusal.

    Raises:
        EnvVarError: the problems :func:`check_all` finds, joined by ``"; "``.
    """
    problems = check_all(environ)
    if problems:
        raise EnvVarError("; ".join(problems))
