#!/usr/bin/env bash
# The default demo: train the embedded tiny Llama on 4 CPU ranks, first with 1F1B, then
# with V-Half, and print both side by side (loss, step time, simulated bubble, measured
# peak activation memory per rank). About 2 minutes on 2 idle CPU cores (mostly start-up
# of 4 processes per run); training itself is ~35 s per schedule.
#
#   bash recipes/run_default.sh            # from the repository root
#
# Knobs (environment): PYTHON (default .venv/bin/python), NPROC (4), STEPS (60),
# SCHEDULES ("1f1b v-half"), OUT (runs/default). Full logs land in $OUT/<schedule>.log.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The project venv when there is one (make venv), else whatever python3 is on PATH.
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
NPROC=${NPROC:-4}
STEPS=${STEPS:-60}
SCHEDULES=${SCHEDULES:-"1f1b v-half"}
OUT=${OUT:-runs/default}
# CPU unless the caller chose an accelerator; one thread per rank, since the ranks
# already outnumber the cores and oversubscribed threads only slow each other down.
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Shown while a run goes: the first step, every 10th, and the end-of-run summary.
SHOWN='^(step +(1|[0-9]*0) \||=====|schedule |model |loss |median |held-out |simulated |measured |wall )'

train() {
    local schedule=$1 log="$OUT/$1.log"
    echo "== $schedule: $NPROC ranks, $STEPS steps (full log: $log)"
    local status=0
    # deepspeed's own launcher (python -m deepspeed.launcher.runner is the `deepspeed` command).
    # With pipefail the pipeline's status is the launcher's: tee and the filter always succeed.
    "$PYTHON" -m deepspeed.launcher.runner --num_gpus "$NPROC" --master_port "$(free_port)" \
        recipes/train_hf.py --deepspeed_config "ds_configs/$schedule.json" --steps "$STEPS" \
        --metrics-out "$OUT/$schedule.jsonl" 2>&1 | tee "$log" | { grep -E "$SHOWN" || true; } || status=$?
    if [[ $status -ne 0 ]]; then
        tail -n 40 "$log" >&2
        echo "run_default.sh: the $schedule run failed (exit $status); full log: $log" >&2
        exit "$status"
    fi
}

start=$SECONDS
metrics=()
for schedule in $SCHEDULES; do
    train "$schedule"
    metrics+=("$OUT/$schedule.jsonl")
done
echo
"$PYTHON" recipes/compare_runs.py "${metrics[@]}"
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo "$NPROC")  # nproc would honour OMP_NUM_THREADS=1
if [[ $DS_ACCELERATOR == cpu && $NPROC -gt $cores ]]; then
    # Oversubscribed ranks take turns on the cores, so a rank's idle (bubble) time is
    # spent by another rank: the wall clock cannot show a schedule's bubble here.
    echo "note: $NPROC ranks share $cores CPU cores, so step times hide pipeline bubbles; compare the simulated bubble."
fi
echo "total time: $((SECONDS - start)) s"
