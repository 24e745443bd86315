#!/usr/bin/env bash
# The whole test suite, with the repository's .venv (create it with scripts/install_cpu.sh).
# Test files run on VERL_STABLE_TEST_WORKERS pytest-xdist workers (default: 2 on a host with >= 2 cores, else 1);
# `--dist loadfile` keeps a file on one worker, so a module's shared verl run starts once. Most of the suite's time is
# the end-to-end runs of verl (and of vLLM's CPU build), which are CPU-bound: on a 2-core host two workers gain little
# (1540 tests: 50m45s with two on a 2-core host while other verl runs loaded it, session 16 -- three two-node tests
# failed to start Ray's head node under that load and passed alone in 1m53s; CI: 43m25s with install, session 15;
# 1516: 41m20s with two on a 2-core host, lightly loaded, session 14, with the Megatron R2 run added; 1509:
# 37m01s after five verl starts were merged away and non-Megatron runs stopped importing megatron-core; 1456: 56m17s
# at load 12-16 from other jobs, session 13;
# 1348: 39m31s, partly loaded, session 12; 1324: 35m07s, session 11; 1175: 22m20s), on more cores they overlap.
# Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
cores=$(nproc 2>/dev/null || echo 1)
workers=${VERL_STABLE_TEST_WORKERS:-$(( cores >= 2 ? 2 : 1 ))}
exec .venv/bin/python -m pytest tests -n "${workers}" --dist loadfile --durations=25 "$@"
