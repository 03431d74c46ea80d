#!/usr/bin/env bash
# The part of the paper's grid a 2-core CPU cannot do, on one GPU within a time budget (default 14 min),
# most useful first; records in glue-bench's format (copy `records/`, `config.json`, `data/` of the
# results folder into the repository's results/ to publish them).
#
#   tools/gpu_grid.sh RESULTS_FOLDER [SECONDS]
#
# 1. RTE, splits 0-4: fine-tune the packaged MiniLM (up to 10 epochs, early stopping) and every Laplace
#    and temperature row of Table 2 (no CPU run of RTE exists);
# 2. SWAG's rows of Table 2 on RTE split 0 (full, and the module strategies);
# 3. SST-2 in full (all ~60,000 training sentences), split 0, the Laplace rows.
# Each stage gets what is left of the budget; an interrupted stage keeps every finished cell (and a
# fine-tune resumes after its last epoch when the same command is rerun on the same machine).
set -euo pipefail
results=${1:?usage: tools/gpu_grid.sh RESULTS_FOLDER [SECONDS]}
budget=${2:-840}
end=$(($(date +%s) + budget))
export HF_HUB_OFFLINE=1
LAPLACE=map,temperature,last-layer,skfac,kfac-full,kfac-max-mlp,kfac-min-mlp,kfac-max-attn,kfac-min-attn,kfac-random
SWAG=swag-full,swag-max-mlp,swag-min-mlp,swag-max-attn,swag-min-attn,swag-random

stage() {
  local left=$((end - $(date +%s)))
  if [ "$left" -lt 60 ]; then
    echo "gpu_grid: no time left for: $*" >&2
    return 0
  fi
  echo "gpu_grid: ${left} s left, running: $*" >&2
  timeout --signal=INT "$left" uv run --frozen glue-bench run --device "${DEVICE:-cuda}" \
    --length-buckets 8 --results "$results" --no-progress "$@" || echo "gpu_grid: stage ended early ($?)" >&2
}

stage --tasks rte --splits 0-4 --methods "$LAPLACE"
stage --tasks rte --splits 0 --methods "$SWAG"
stage --tasks sst2 --splits 0 --methods "$LAPLACE"
uv run --frozen glue-bench report --results "$results" >/dev/null && echo "gpu_grid: report in $results/report" >&2
