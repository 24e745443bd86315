#!/usr/bin/env bash
# Fill .device_wheels/ (git-ignored) with the wheels tests/gpu/device_check.sh installs on the lent GPU machine, where
# nothing can be downloaded: PyTorch, transformers, numpy, packaging and cloudpickle are there, the checks' other
# imports are not.
#
#   bash tests/gpu/prepare_device_wheels.sh [DEST]      # default DEST: <repo>/.device_wheels
#
# What is fetched (`pip download --no-deps`, binary wheels for CPython 3.12 on x86-64 Linux, the machine's Python):
#   tensordict 0.10.0  imported by verl_stable.routing.replay_pass (the FSDP engine's replay pass); the version verl
#                      0.9.1 allows at most and the one CI runs. Its extension module does not link libtorch.
#   pyvers 0.1.0       imported by tensordict (which requires pyvers < 0.2).
#   cloudpickle 3.1.3  imported by tensordict; the machine's image has it (then device_check.sh skips the wheel), a
#                      leaner one may not.
# Not fetched: verl 0.9.1 (1.7 MB) -- `import verl` imports verl.protocol, which imports Ray, whose cp312 wheel alone
# is 75.6 MiB (ray 2.60.0), over the 64 MiB a call may carry; verl 0.9.1 also pins transformers < 5.11 and the machine
# has 5.17. The checks therefore drive the verl-free half of the engine's replay (see device_checks.py).
#
# Prints the wheels' total size and what would travel with a device call (this checkout's tracked and untracked,
# not-ignored files plus the wheels), which must stay under 64 MiB.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=${1:-$REPO/.device_wheels}
PY=${PYTHON:-python3}
PYVER=${DEVICE_PYTHON_VERSION:-3.12}
PACKAGES=(tensordict==0.10.0 pyvers==0.1.0 cloudpickle==3.1.3)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${PACKAGES[@]}"

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
# files git lists that are deleted in the work tree travel as nothing
tree=$(cd "$REPO" && git ls-files -z -co --exclude-standard | "$PY" -c '
import os, sys
names = sys.stdin.buffer.read().split(b"\0")
print(sum(os.lstat(n).st_size for n in names if n and os.path.lexists(n)))')
ls -l "$DEST"
awk -v w="$wheels" -v t="$tree" 'BEGIN {
  printf "wheels: %.2f MiB; working tree that travels: %.2f MiB; together: %.2f MiB of 64 MiB\n",
    w / 1048576, t / 1048576, (w + t) / 1048576 }'
