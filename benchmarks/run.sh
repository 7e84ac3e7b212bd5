#!/usr/bin/env bash
# Regenerate every benchmark result (issue 5) in benchmarks/results/: about 11 minutes (668 s at d55e6c9) on
# 2 idle CPU cores.  `make bench` runs this with .venv/bin first on PATH.
#
#   bash benchmarks/run.sh
#
# Phases: emulated device at p=4 (DeepSpeed, ds_vshape, torch.distributed.pipelining; m=16
# and m=8, two rounds), a sensitivity subset, a p=8 subset, real compute at p=2, then
# benchmarks/report.py (tables, plot, targets).
# Knobs (environment): PYTHON, T_PASS (0.02 s per pass of a 1/p slice), WARMUP (1),
# STEPS (3 timed steps per round), ROUNDS (2), SENS (1: a p=4, m=8 subset again with
# T_PASS_LONG=0.06 s passes and with zero-time passes), P8 (1: run the p=8 subset), REAL (1:
# run real compute), PHASE_TIMEOUT (900 s, per phase: a hang guard). Worker logs: benchmarks/results/raw/*.log.
# ASYNC (0; 1: also run the p=4 subset on the asynchronous emulated device and write
# results/emulated_async.{md,json}; ASYNC_LATENCY_US=10 and ASYNC_BANDWIDTH_GBS=25 set its transfers),
# SYNC (1; 0: skip every sync phase and report.py, so the committed sync results stay as they are).
# SEQ (1: Seq1F1B k=2,4 against 1F1B at p=2 and p=4 on SEQ_LEN (1024) tokens, real compute, into
# results/seq1f1b.md; alone, about 4 minutes: SYNC=0 SEQ=1 bash benchmarks/run.sh, or make bench-seq).
# The async phase alone (about 4 minutes):  SYNC=0 ASYNC=1 bash benchmarks/run.sh
# The machine should be otherwise idle: other load shows up as step time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
source benchmarks/python.sh
T_PASS=${T_PASS:-0.02}
WARMUP=${WARMUP:-1}
STEPS=${STEPS:-3}
ROUNDS=${ROUNDS:-2}
P8=${P8:-1}
SENS=${SENS:-1}
T_PASS_LONG=${T_PASS_LONG:-0.06}
REAL=${REAL:-1}
PHASE_TIMEOUT=${PHASE_TIMEOUT:-900}
SYNC=${SYNC:-1}
ASYNC=${ASYNC:-0}
ASYNC_LATENCY_US=${ASYNC_LATENCY_US:-10}
ASYNC_BANDWIDTH_GBS=${ASYNC_BANDWIDTH_GBS:-25}
SEQ=${SEQ:-1}
SEQ_LEN=${SEQ_LEN:-1024}
RAW=benchmarks/results/raw

export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# One thread per rank: the emulated ranks sleep, and real compute runs one rank per core.
export OMP_NUM_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ $SYNC == 1 ]]; then
    rm -rf "$RAW"
else  # keep the sync run's raw lines (and its commit.txt) for report.py
    rm -f "$RAW"/async_p*.jsonl "$RAW"/async_p*.log "$RAW"/seq_p*.jsonl "$RAW"/seq_p*.log
fi
mkdir -p "$RAW"
record_commit() {  # the code measured: commit, and whether the runtime had uncommitted changes
    { git rev-parse --short HEAD 2>/dev/null || echo unknown
      git status --porcelain -- ds_vshape 2>/dev/null | grep -q . && echo "dirty" || true; } >"$1"
}
if [[ $SYNC == 1 ]]; then record_commit "$RAW/commit.txt"; fi
if [[ $ASYNC == 1 ]]; then record_commit "$RAW/async_commit.txt"; fi
if [[ $SEQ == 1 ]]; then record_commit "$RAW/seq_commit.txt"; fi

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# phase NAME NPROC SCRIPT ARGS...: one torchrun launch; progress lines on screen, the rest in the log.
phase() {
    local name=$1 nproc=$2 script=$3
    shift 3
    local log="$RAW/$name.log" t0=$SECONDS status=0
    echo "== $name: $nproc ranks (log: $log)"
    local before
    before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
    timeout "$PHASE_TIMEOUT" "$PYTHON" -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$(free_port)" \
        "$script" "$@" >"$log" 2>&1 || status=$?
    grep -E '^\[(bench|real|seq) ' "$log" || true
    echo "$before -> $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")" >"$RAW/load_$name.txt"
    if [[ $status -ne 0 ]]; then
        tail -n 30 "$log" >&2
        echo "run.sh: phase $name failed (exit $status); continuing with what it recorded" >&2
    fi
    echo "   ($((SECONDS - t0)) s)"
}

start=$SECONDS
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
if awk "BEGIN{exit !($load > 2.0)}"; then
    echo "run.sh: warning: load average $load before the run; other work on the machine inflates step times" >&2
fi
if [[ $SYNC == 1 ]]; then
phase emulated_p4 4 benchmarks/bench_emulated.py --systems deepspeed ds_vshape torch \
    --t-pass "$T_PASS" --warmup "$WARMUP" --steps "$STEPS" --rounds "$ROUNDS" --micro-batches 16 8 --out "$RAW/emulated_p4.jsonl"
fi
if [[ $SYNC == 1 && $SENS == 1 ]]; then
    # The same work with 3x longer passes, and on a zero-time device (pure host cost per step).
    phase emulated_p4_sensitivity 4 benchmarks/bench_emulated.py --systems deepspeed ds_vshape torch \
        --schedules 1f1b zb-h2 v-zb v-half v-min zbvzerobubble \
        --t-pass "$T_PASS_LONG" 0 --warmup 1 --steps 3 --rounds 1 --micro-batches 8 --out "$RAW/emulated_p4_sensitivity.jsonl"
fi
if [[ $SYNC == 1 && $P8 == 1 ]]; then
    phase emulated_p8 8 benchmarks/bench_emulated.py --systems deepspeed ds_vshape torch \
        --schedules 1f1b zb-h2 v-zb v-half v-min zbvzerobubble \
        --t-pass "$T_PASS" --warmup 1 --steps 3 --rounds 1 --micro-batches 16 --out "$RAW/emulated_p8.jsonl"
fi
if [[ $SYNC == 1 && $REAL == 1 ]]; then
    rm -f "$RAW/real_p2.jsonl"
    phase real 2 benchmarks/bench_real.py --warmup 1 --steps 5 --rounds 1 --out "$RAW/real_p2.jsonl"
fi
if [[ $ASYNC == 1 ]]; then
    # The host enqueues passes on a device stream and runs ahead (benchmarks/async_device.py).
    phase async_p4 4 benchmarks/bench_emulated.py --device async --latency-us "$ASYNC_LATENCY_US" \
        --bandwidth-gbs "$ASYNC_BANDWIDTH_GBS" --systems deepspeed ds_vshape torch \
        --schedules 1f1b zb-h2 v-zb v-half zbvzerobubble \
        --t-pass "$T_PASS" --warmup "$WARMUP" --steps "$STEPS" --rounds "$ROUNDS" --micro-batches 16 8 --out "$RAW/async_p4.jsonl"
fi
if [[ $SEQ == 1 ]]; then
    # Long sequences in real compute: memory per rank and step time (benchmarks/bench_seq.py).
    phase seq_p2 2 benchmarks/bench_seq.py run --seq-len "$SEQ_LEN" --out "$RAW/seq_p2.jsonl"
    phase seq_p4 4 benchmarks/bench_seq.py run --seq-len "$SEQ_LEN" --out "$RAW/seq_p4.jsonl"
    "$PYTHON" benchmarks/bench_seq.py report "$RAW/seq_p2.jsonl" "$RAW/seq_p4.jsonl" --md benchmarks/results/seq1f1b.md \
        --commit "$(tr '\n' ' ' <"$RAW/seq_commit.txt" | sed 's/ $//')"
fi
if [[ $SYNC == 1 ]]; then
    echo
    "$PYTHON" benchmarks/report.py
    if [[ $REAL == 1 ]]; then "$PYTHON" benchmarks/report_real.py >/dev/null; fi
    echo
    echo "results: benchmarks/results/{emulated.json,emulated.md,emulated.png,real.json,real.md,machine.json}"
fi
if [[ $ASYNC == 1 ]]; then
    echo
    "$PYTHON" benchmarks/report_async.py
    echo "results: benchmarks/results/{emulated_async.json,emulated_async.md}"
fi
echo "wall time: $((SECONDS - start)) s"
