#!/usr/bin/env bash
# The whole test suite, with the repository's .venv (create it with scripts/install_cpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest tests "$@"
