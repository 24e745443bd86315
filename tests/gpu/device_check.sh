#!/usr/bin/env bash
# One entry point for the device checks (tests/gpu/device_checks.py) on a machine without network access.
#
#   bash tests/gpu/device_check.sh [--device cuda|cpu] [--quick] [--threads N]
#
# 1. Installs, offline, the wheels carried in .device_wheels/ (filled by tests/gpu/prepare_device_wheels.sh) whose
#    distributions the Python here lacks -- tensordict and pyvers on the lent H100; nothing in CI, whose environment
#    has them -- into a folder under $TMPDIR that goes first on PYTHONPATH (the interpreter's site-packages is left
#    alone). verl is not among them: `import verl` imports Ray, whose wheel alone is larger than a call may carry.
# 2. Puts this checkout on PYTHONPATH unless `import verl_stable` already finds this checkout (an editable install).
# 3. Runs the checks: one line per check, exit code 0 iff none failed.
#
# Environment: PYTHON (interpreter, default python3), DEVICE_WHEELS (wheel folder, default <repo>/.device_wheels),
# DEVICE_SITE (install folder, default $TMPDIR/verl_stable_device_site).
set -euo pipefail

usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${DEVICE_WHEELS:-$REPO/.device_wheels}
SITE=${DEVICE_SITE:-${TMPDIR:-/tmp}/verl_stable_device_site}
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) ARGS+=(--device "${2:?--device needs cuda or cpu}"); shift 2 ;;
    --device=*) ARGS+=(--device "${1#--device=}"); shift ;;
    --quick) ARGS+=(--quick); shift ;;
    --threads) ARGS+=(--threads "${2:?--threads needs a number}"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "device_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

# An earlier run on the same machine may have installed the wheels already.
if [ -d "$SITE" ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi

missing=()
shopt -s nullglob
for whl in "$WHEELS"/*.whl; do
  dist=$(basename "$whl" | cut -d- -f1)
  if ! "$PY" -c 'import importlib.metadata as m, sys; m.distribution(sys.argv[1])' "$dist" 2>/dev/null; then
    missing+=("$whl")
  fi
done
shopt -u nullglob
if [ ${#missing[@]} -gt 0 ]; then
  echo "device_check: installing ${#missing[@]} carried wheel(s) into $SITE: $(for w in "${missing[@]}"; do basename "$w"; done | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --upgrade \
    --target "$SITE" "${missing[@]}"
  case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
else
  echo "device_check: no wheel to install (every carried distribution is importable, or none is carried)"
fi

# The checks must run this checkout's code, whatever else is installed.
found=$("$PY" -c 'import os, verl_stable; print(os.path.dirname(os.path.dirname(os.path.realpath(verl_stable.__file__))))' \
  2>/dev/null || true)
if [ "$found" != "$(realpath "$REPO")" ]; then
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  echo "device_check: verl_stable from $REPO (PYTHONPATH)"
fi

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" "$REPO/tests/gpu/device_checks.py" "${ARGS[@]}"
