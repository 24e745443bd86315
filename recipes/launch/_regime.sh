# Sourced by the launch scripts: validates REGIME and sets N (staleness) and TRAIN_BATCH_SIZE.
# The geometry is the paper's (arXiv 2512.01374): a mini-batch is 64 prompts x 16 samples =
# 1024 responses, and a rollout batch holds N mini-batches (N policy updates per rollout).

MINI_BATCH_PROMPTS=64
GROUP_SIZE=16

case "${REGIME}" in
  minirl_onpolicy) DEFAULT_N=1 ;;
  minirl_n2_r2)    DEFAULT_N=2 ;;
  minirl_n4_r3)    DEFAULT_N=4 ;;
  vespo)           DEFAULT_N=8 ;;
  *)
    echo "unknown regime '${REGIME}'; one of: minirl_onpolicy minirl_n2_r2 minirl_n4_r3 vespo" >&2
    exit 2
    ;;
esac
N=${N:-${DEFAULT_N}}

# the regimes are defined for these N (verl-stable recipe check enforces the same ranges)
case "${REGIME}" in
  minirl_onpolicy) [ "${N}" -eq 1 ] || { echo "minirl_onpolicy is N = 1 (got N=${N})" >&2; exit 2; } ;;
  minirl_n2_r2)    [ "${N}" -ge 2 ] && [ "${N}" -le 3 ] || { echo "minirl_n2_r2 is N = 2..3 (got N=${N})" >&2; exit 2; } ;;
  minirl_n4_r3)    [ "${N}" -ge 4 ] || { echo "minirl_n4_r3 is N >= 4 (got N=${N})" >&2; exit 2; } ;;
  vespo)           [ "${N}" -ge 1 ] || { echo "vespo needs N >= 1 (got N=${N})" >&2; exit 2; } ;;
esac
TRAIN_BATCH_SIZE=$((MINI_BATCH_PROMPTS * N))
