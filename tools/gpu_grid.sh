#!/usr/bin/env bash
# The part of the paper's grid a 2-core CPU cannot do, on one GPU within a time budget (default 14 min),
# most useful first; records in glue-bench's format (copy `records/`, `config.json`, `data/` of the
# results folder into the repository's results/ to publish them).
#
#   tools/gpu_grid.sh RESULTS_FOLDER [SECONDS]
#
# 1. MRPC split 0: fine-tune on the GPU, then MAP, temperature and SWAG's rows of Table 2 (full, then the
#    module strategies); the one SWAG cell a CPU core needs 1 h 45 min for. Use a results folder of its own
#    (not the CPU's results/glue): the GPU's fine-tune is another MAP than the CPU's for the same unit;
# 2. SST-2 in full (all ~67,000 training sentences), split 0, the Laplace rows;
# 3. RTE splits 1-4, the Laplace rows (split 0 ran on 2026-11-28: the packaged MiniLM does not learn RTE,
#    every row's NLL is within 0.001 of ln 2, so these come last).
# Each stage gets what is left of the budget; an interrupted stage keeps every finished cell (and a
# fine-tune resumes after its last epoch when the same command is rerun on the same machine).
# GLUE_BENCH names the command (default `uv run --frozen glue-bench`; on a machine without uv, the
# installed `glue-bench`), DEVICE the torch device (cuda).
set -euo pipefail
results=${1:?usage: tools/gpu_grid.sh RESULTS_FOLDER [SECONDS]}
budget=${2:-840}
end=$(($(date +%s) + budget))
export HF_HUB_OFFLINE=1
read -r -a glue_bench <<<"${GLUE_BENCH:-uv run --frozen glue-bench}"
LAPLACE=map,temperature,last-layer,skfac,kfac-full,kfac-max-mlp,kfac-min-mlp,kfac-max-attn,kfac-min-attn,kfac-random
SWAG=swag-full,swag-max-mlp,swag-min-mlp,swag-max-attn,swag-min-attn,swag-random

stage() {
  local left=$((end - $(date +%s)))
  if [ "$left" -lt 60 ]; then
    echo "gpu_grid: no time left for: $*" >&2
    return 0
  fi
  echo "gpu_grid: ${left} s left, running: $*" >&2
  timeout --signal=INT "$left" "${glue_bench[@]}" run --device "${DEVICE:-cuda}" \
    --length-buckets 8 --results "$results" --no-progress "$@" || echo "gpu_grid: stage ended early ($?)" >&2
}

stage --tasks mrpc --splits 0 --methods "map,temperature,$SWAG"
stage --tasks sst2 --splits 0 --methods "$LAPLACE"
stage --tasks rte --splits 1-4 --methods "$LAPLACE"
"${glue_bench[@]}" report "$results" >/dev/null && echo "gpu_grid: report in $results/report" >&2
