#!/usr/bin/env bash
# `"schedule": "auto"` against the fixed schedules on measured costs, and V-Half/V-Min memory with
# partition_method profile (issue 13, item 5). `make bench-auto` runs this with .venv/bin first on PATH.
#
#   bash benchmarks/run_auto.sh
#
# Phases (4 ranks each, gloo, CPU):
#   auto    benchmarks/bench_auto.py: emulated device (sleeping layers), cost profiles a (T_W = T_B/2),
#           b (one rank 2x slow), c (memory limit p/2 M_B); auto and every fixed schedule of the linear
#           and V placements; m=8 (2 rounds) and m=16 (2 rounds).
#   memory  benchmarks/bench_profile_memory.py: the recipe's tiny Llama, 1f1b / v-half / v-min with
#           partition_method profile (and profile_time_slack 0.1, and the recipe's parameters cut).
# then benchmarks/report_auto.py writes benchmarks/results/auto.{md,json}, auto_*.png and profile_memory.md.
# About 9-10 minutes on 2 idle cores. Knobs (environment): PYTHON, AUTO (1), MEMORY (1), M ("8 16"),
# ROUNDS ("2 2": rounds per m), STEPS (3 timed steps per round, after 1 warm-up), MEMORY_ROUNDS (2), PHASE_TIMEOUT (1200 s).
# Worker logs and JSON lines: benchmarks/results/raw/auto_p4.* and profile_memory_p4.*.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source benchmarks/python.sh
AUTO=${AUTO:-1}
MEMORY=${MEMORY:-1}
M=${M:-"8 16"}
ROUNDS=${ROUNDS:-"2 2"}
STEPS=${STEPS:-3}
MEMORY_ROUNDS=${MEMORY_ROUNDS:-2}
PHASE_TIMEOUT=${PHASE_TIMEOUT:-1200}
RAW=benchmarks/results/raw

export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RAW"

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
load() { cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?"; }

LOADS=()
# phase NAME SCRIPT ARGS...: one torchrun launch with 4 ranks; progress lines on screen, the rest in the log.
phase() {
    local name=$1 script=$2
    shift 2
    local log="$RAW/$name.log" t0=$SECONDS status=0 before
    echo "== $name (log: $log)"
    before=$(load)
    timeout "$PHASE_TIMEOUT" "$PYTHON" -m torch.distributed.run --nproc_per_node 4 --master_port "$(free_port)" \
        "$script" "$@" >"$log" 2>&1 || status=$?
    grep -E '^\[(auto|memory)' "$log" || true
    LOADS+=("$name $before -> $(load)")
    echo "== $name: $((SECONDS - t0)) s, exit $status"
    if [[ $status != 0 ]]; then
        echo "phase $name failed (exit $status); the end of $log:" >&2
        tail -n 30 "$log" >&2
        return "$status"
    fi
}

load_now=$(load)
if awk -v l="${load_now%% *}" 'BEGIN { exit !(l > 2) }' 2>/dev/null; then
    echo "warning: load average $load_now: other work on this machine shows up as step time" >&2
fi
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if git status --porcelain -- ds_vshape 2>/dev/null | grep -q .; then COMMIT="$COMMIT (ds_vshape/ had uncommitted changes)"; fi
start=$SECONDS
report_args=()
if [[ $AUTO == 1 ]]; then
    rm -f "$RAW/auto_p4.jsonl"
    # shellcheck disable=SC2086  # M and ROUNDS are lists
    phase auto_p4 benchmarks/bench_auto.py --out "$RAW/auto_p4.jsonl" --micro-batches $M --rounds $ROUNDS --steps "$STEPS"
fi
if [[ $MEMORY == 1 ]]; then
    rm -f "$RAW/profile_memory_p4.jsonl"
    # w_memory 0.5, as the committed results/profile_memory.md (report_memory.py states each case's own value).
    phase profile_memory_p4 benchmarks/bench_profile_memory.py --out "$RAW/profile_memory_p4.jsonl" --rounds "$MEMORY_ROUNDS" --w-memory 0.5
fi
[[ -f $RAW/auto_p4.jsonl ]] && report_args+=(--auto "$RAW/auto_p4.jsonl")
[[ -f $RAW/profile_memory_p4.jsonl ]] && report_args+=(--memory "$RAW/profile_memory_p4.jsonl")
loads=$(IFS=';'; echo "${LOADS[*]:-}")
"$PYTHON" benchmarks/report_auto.py "${report_args[@]}" --commit "$COMMIT" --load "${loads//;/; }" \
    --wall "$((SECONDS - start)) s" >/dev/null
echo "== wrote benchmarks/results/auto.md, auto.json, auto_*.png, profile_memory.md ($((SECONDS - start)) s)"
sed -n '/^### Summary/,/^auto.s choice: one per round/p' benchmarks/results/auto.md
