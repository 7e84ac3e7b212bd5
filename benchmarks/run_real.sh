#!/usr/bin/env bash
# make bench-real: real compute at p=2 (one rank per CPU core), every schedule and DeepSpeed 1F1B,
# measured against the simulator with where each rank's time went (benchmarks/bench_real.py,
# benchmarks/report_real.py -> benchmarks/results/real.{md,json}). About 6 minutes on 2 idle cores.
#
# Knobs (environment): ROUNDS (1), WARMUP (1), STEPS (5), SCHEDULES (default: all), EXTRA (more
# bench_real.py options, e.g. "--hidden 512 --ffn 1408"), VARIANT (NAME=JSON: pipeline keys for the
# schedules named SCHEDULE+NAME) and RESULT (results/RESULT.md, default real). The machine should be otherwise idle:
# other load shows up as step time, and one rank per core is what makes a bubble idle time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source benchmarks/python.sh
RAW=benchmarks/results/raw
mkdir -p "$RAW"
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULT=${RESULT:-real}
rm -f "$RAW/${RESULT}_p2.jsonl"
{ git rev-parse --short HEAD 2>/dev/null || echo unknown
  git status --porcelain -- ds_vshape 2>/dev/null | grep -q . && echo "dirty" || true; } >"$RAW/commit.txt"
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
# shellcheck disable=SC2086
"$PYTHON" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" benchmarks/bench_real.py \
    --rounds "${ROUNDS:-1}" --warmup "${WARMUP:-1}" --steps "${STEPS:-5}" --out "$RAW/${RESULT}_p2.jsonl" ${VARIANT:+--variant "$VARIANT"} \
    ${SCHEDULES:+--schedules $SCHEDULES} ${EXTRA:-} 2>&1 | tee "$RAW/${RESULT}.log" | grep -E '^\[real ' || true
echo "$before -> $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")" >"$RAW/load_real.txt"
"$PYTHON" benchmarks/report_real.py --raw "$RAW/${RESULT}_p2.jsonl" --name "$RESULT"
