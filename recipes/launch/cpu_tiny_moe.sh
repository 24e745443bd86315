#!/usr/bin/env bash
# The same regimes on the CPU runtime: recipes/fsdp/REGIME.yaml through verl's own main_ppo with a
# tiny local Qwen3-MoE and a toy verifiable task (built on first use, no download), keeping the
# regime's N, loss and routing replay with the geometry scaled down to 2 prompts x 4 samples per
# mini-batch. Minutes on a laptop; no GPU.
#
#   bash recipes/launch/cpu_tiny_moe.sh REGIME [hydra overrides ...]
#   WORKDIR=/tmp/r2 STEPS=5 bash recipes/launch/cpu_tiny_moe.sh minirl_n2_r2
set -euo pipefail

REGIME=${1:?usage: $0 REGIME [hydra overrides ...]}
shift
PYTHON=${PYTHON:-python3}
exec "${PYTHON}" -m verl_stable.recipes run-cpu \
    --workdir "${WORKDIR:-./verl_stable_cpu_${REGIME}}" --steps "${STEPS:-3}" "${REGIME}" "$@"
