#!/usr/bin/env bash
# A/B of the emulated benchmark between a base commit and the working tree (p=4, 20 ms
# passes, DeepSpeed 1F1B as the control in both runs, best of ROUNDS rounds per case).
#
#   bash benchmarks/ab.sh BASE_REV        # e.g. bash benchmarks/ab.sh e4fdb62
#
# The base is checked out into a temporary git worktree and run with this tree's .venv.
# Prints one row per (system, schedule, m): base step, this tree's step, and their ratio.
# The machine should be otherwise idle: other load shows up as step time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
base=${1:?usage: bash benchmarks/ab.sh BASE_REV}
PYTHON=${PYTHON:-$PWD/.venv/bin/python}
ROUNDS=${ROUNDS:-2}
out=$(mktemp -d)
git worktree add -q --detach "$out/base" "$base"
trap 'git worktree remove --force "$out/base"' EXIT
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=1
for side in base head; do
    tree=$PWD; [[ $side == base ]] && tree=$out/base
    port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    (cd "$tree" && PYTHONPATH="$tree" "$PYTHON" -m torch.distributed.run --nproc_per_node 4 --master_port "$port" \
        benchmarks/bench_emulated.py --systems deepspeed ds_vshape --schedules 1f1b zb-h2 v-zb v-half v-min \
        --t-pass 0.02 --warmup 1 --steps 3 --rounds "$ROUNDS" --micro-batches 8 16 --out "$out/$side.jsonl" >"$out/$side.log" 2>&1)
done
"$PYTHON" - "$out/base.log" "$out/head.log" "$base" <<'PY'
import re, sys
best = {}
for side, path in (("base", sys.argv[1]), ("head", sys.argv[2])):
    for m in re.finditer(r"\[bench p=4 m=(\d+) T=20ms round \d\] (\w+)\s+(\S+)\s+step ([\d.]+) s", open(path).read()):
        key = (m.group(2), m.group(3), int(m.group(1)))
        best.setdefault(key, {})[side] = min(best.get(key, {}).get(side, 1e9), float(m.group(4)))
print(f"| system | schedule | m | {sys.argv[3]} (s) | this tree (s) | ratio |\n|---|---|--:|--:|--:|--:|")
for (system, schedule, m), v in sorted(best.items()):
    print(f"| {system} | {schedule} | {m} | {v.get('base', float('nan')):.3f} | {v.get('head', float('nan')):.3f} | "
          f"{v.get('head', float('nan')) / v.get('base', float('nan')):.3f} |")
PY
