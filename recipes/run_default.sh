#!/usr/bin/env bash
# The default demo: train a Llama-style model pipeline-parallel on 2 CPU ranks, one core each,
# with 1F1B, ZB-H1 and ZB-H2, and print them side by side (loss, step time, simulated bubble,
# measured peak activation memory per rank). The model is the recipe's "compute" size (hidden
# 384, 8 blocks, sequences of 128): big enough that each rank's time goes to its passes, so
# with one core per rank the step time shows each schedule's idle time (its bubble). About 5
# minutes on 2 idle cores.
#
#   bash recipes/run_default.sh            # from the repository root
#
# Knobs (environment): PYTHON (default .venv/bin/python), NPROC (2), STEPS (20), SIZE (compute;
# tiny is the hidden-64 model), SEQ_LEN (128), SCHEDULES ("1f1b zb-h1 zb-h2"), OUT (runs/default).
# More ranks than cores (NPROC=4 on this machine) share cores: the table then says so, and
# only the simulated bubble shows the schedules' difference in time. Full logs: $OUT/<schedule>.log.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The project venv when there is one (make venv), else whatever python3 is on PATH.
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
NPROC=${NPROC:-2}
STEPS=${STEPS:-20}
SIZE=${SIZE:-compute}
SEQ_LEN=${SEQ_LEN:-128}
SCHEDULES=${SCHEDULES:-"1f1b zb-h1 zb-h2"}
OUT=${OUT:-runs/default}
# CPU unless the caller chose an accelerator; one thread per rank, so that a rank is one core.
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
        recipes/train_hf.py --deepspeed_config "ds_configs/$schedule.json" --steps "$STEPS" --size "$SIZE" --seq-len "$SEQ_LEN" \
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
echo "total time: $((SECONDS - start)) s"
