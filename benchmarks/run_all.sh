#!/usr/bin/env bash
# Every benchmark docs/benchmarks.md lists, one after the other, each with the arguments its table
# was made with; one log per script in OUT (default: a new folder under /tmp). Nothing else should
# run on the machine meanwhile: the tables compare figures measured in the same run.
#   usage: benchmarks/run_all.sh [OUT] [script ...]      (about two hours on 2 cores)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d /tmp/magnitude-benchmarks-XXXX)}
shift || true
mkdir -p "$OUT"
MODEL=$(python -c "from magnitude_jupyter.models.registry import bundled_model_path as p; print(p())")

declare -A ARGS=(
    [server_throughput]="--repeats 3"
    [conversations]="--repeats 2"
    [conversations_chat]="--sessions 1 --rounds 10 --max-tokens 128 --repeats 2"
    [agents]="--repeats 2"
    [capacity]="--repeats 3"
    [protocols]="--repeats 3"
    [spill]="--levels 4,16 --pairs 3"
    [idle_cells]=""
    [ram_tier]=""
    [cache_isolation]=""
    [cache_spread]=""
    [engine_throughput]=""
    [batch_throughput]=""
    [drafts]=""
    [models]=""
    [kv_cache_types]=""
    [contention]=""
    [dask_scale]=""
    [calibration_check]=""
    [soak]=""
    [server_memory]=""
    [model_matrix]=""
    [cells_scanned]=""
    [ubatch_costs]="--parallel 4 --repeats 1"
    [paired]="--repeats 4"
    [overload]=""
)
ORDER=(raw_ceiling server_throughput conversations conversations_chat agents capacity protocols spill idle_cells
    ram_tier cache_isolation cache_spread engine_throughput batch_throughput drafts models kv_cache_types
    contention dask_scale calibration_check server_memory model_matrix cells_scanned ubatch_costs paired overload soak)
[ $# -gt 0 ] && ORDER=("$@")

for name in "${ORDER[@]}"; do
    echo "$(date +%T) $name" >&2
    if [ "$name" = raw_ceiling ]; then
        PEER=$(../shared/tools/build-llama-server.sh 2>/dev/null || true)
        BIN=$(dirname "${PEER:-/nonexistent/x}")
        if [ -x "$BIN/llama-batched-bench" ]; then
            for fa in on off; do
                echo "flash attention $fa"
                "$BIN/llama-batched-bench" -m "$MODEL" -npp 64 -ntg 64 -npl 1,4,16 -t 2 -c 8192 -b 2048 -ub 512 \
                    -kvu -nr -fa "$fa" 2>/dev/null
            done > "$OUT/raw_ceiling.log"
        fi
        continue
    fi
    script=${name%_chat}
    # shellcheck disable=SC2086  # the arguments are words
    python "benchmarks/$script.py" ${ARGS[$name]} > "$OUT/$name.log" 2>&1 || echo "  $name failed: see $OUT/$name.log" >&2
done
echo "$OUT"
