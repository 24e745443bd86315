#!/usr/bin/env bash
# Create .venv at the repository root with the CPU stack (never a CUDA torch) and install verl-stable editable.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first: the pinned CPU build. Anything that later asks for "torch" is then already satisfied.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
# Refuse to continue if something replaced the CPU torch with a CUDA build.
.venv/bin/python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
assert torch.version.cuda is None, f"a CUDA torch was installed ({torch.version.cuda}); expected the CPU build"
print(f"verl-stable CPU environment ready: torch {torch.__version__} in .venv")
PY
