"""Regenerate an upstreamable diff from a patched copy of the ``verl`` package.

Usage (from the repository root)::

    python patches/tools/make_diff.py --patched /tmp/tree --out patches/verl-0.9.1-fsdp-router-replay.diff \\
        --regenerate-trainer-yaml verl/workers/engine/fsdp/transformer_impl.py verl/utils/fsdp_router_replay.py ...

``--patched`` is the directory holding the patched ``verl/`` package; the pristine side is the installed verl (the
parent of ``verl.__file__``). Each listed path (relative to those roots, starting with ``verl/``) becomes one section
with ``a/verl/...`` / ``b/verl/...`` headers, applicable with ``git apply -p1`` from site-packages. With
``--regenerate-trainer-yaml`` the patched ``_generated_ppo_trainer.yaml`` is first rewritten from a hydra compose of
the patched ``ppo_trainer`` config (what verl's ``scripts/generate_trainer_config.sh`` produces).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GENERATED = "verl/trainer/config/_generated_ppo_trainer.yaml"

_COMPOSE = """
import os, sys
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
import verl
assert verl.__file__.startswith(sys.argv[1]), verl.__file__
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"), version_base=None):
    cfg = compose(config_name="ppo_trainer")
with open_dict(cfg):
    cfg.pop("model_engine", None)  # the generator drops the engine selector (as in verl's checked-in files)
sys.stdout.write(OmegaConf.to_yaml(cfg))
"""


def regenerate_trainer_yaml(patched: Path) -> None:
    """Rewrite ``_generated_ppo_trainer.yaml`` of the patched tree from its composed ``ppo_trainer`` config."""
    env = dict(os.environ, PYTHONPATH=str(patched), VERL_USE_EXTERNAL_PLUGINS="none")
    body = subprocess.run(
        [sys.executable, "-c", _COMPOSE, str(patched)], env=env, capture_output=True, text=True, check=True
    ).stdout
    target = patched / GENERATED
    header = [line for line in target.read_text().splitlines(keepends=True) if line.startswith("#")]
    target.write_text("".join(header) + "\n" + body)


def file_diff(pristine_root: Path, patched_root: Path, rel: str) -> str:
    """One ``git diff`` section for ``rel`` with a/ and b/ prefixes (new files diff against /dev/null)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(pristine_root, Path(tmp) / "a")
        os.symlink(patched_root, Path(tmp) / "b")
        old = f"a/{rel}" if (pristine_root / rel).exists() else "/dev/null"
        proc = subprocess.run(
            ["git", "diff", "--no-index", "--no-color", "--no-prefix", old, f"b/{rel}"],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
    if proc.returncode not in (0, 1):
        raise RuntimeError(proc.stderr)
    return proc.stdout.replace(f"diff --git b/{rel} b/{rel}", f"diff --git a/{rel} b/{rel}")


def main() -> None:
    import verl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patched", type=Path, required=True, help="directory holding the patched verl/ package")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--header", type=Path, help="text placed before the first diff section")
    parser.add_argument("--regenerate-trainer-yaml", action="store_true")
    parser.add_argument("files", nargs="+", help="paths relative to the roots, e.g. verl/utils/x.py")
    args = parser.parse_args()
    pristine = Path(verl.__file__).resolve().parents[1]
    if args.regenerate_trainer_yaml:
        regenerate_trainer_yaml(args.patched.resolve())
    sections = [file_diff(pristine, args.patched.resolve(), rel) for rel in args.files]
    header = args.header.read_text() if args.header else ""
    args.out.write_text(header + "".join(sections))
    print(f"wrote {args.out}: {sum(s.count(chr(10)) for s in sections)} diff lines, {len(args.files)} files")


if __name__ == "__main__":
    main()
