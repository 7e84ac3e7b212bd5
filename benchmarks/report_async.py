"""Tables for the asynchronous emulated device (``run.sh`` with ``ASYNC=1``).

    python benchmarks/report_async.py      # reads benchmarks/results/raw/async_p*.jsonl

Writes ``benchmarks/results/emulated_async.json`` and ``emulated_async.md`` and prints the
table. Rows are built exactly as for the sync device (``report.build_rows``: best round,
ideal = m x (T_F + T_B + T_W), speed-up vs DeepSpeed 1F1B); the simulator's hop cost is
the modelled transfer time of one activation instead of the measured gloo latency, since
that is what the async device charges. The sync step time of the same case, from the
committed ``emulated.json``, is shown next to it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import cell, machine_info  # noqa: E402
from benchmarks.report_rows import RAW, RESULTS, build_rows, read_jsonl  # noqa: E402

__all__ = ["async_markdown", "main", "sync_step_times"]


def sync_step_times(path: Path) -> dict[tuple[str, str, int, int, float], float]:
    """(system, schedule, p, m, T) -> step time of the committed sync run, where it has the case."""
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())
    return {(r["system"], r["schedule"], r["p"], r["m"], r["t_pass_s"]): r["step_time_s"] for r in rows if "step_time_s" in r}


def async_markdown(rows: list[dict[str, Any]], device: dict[str, Any], sync: dict[tuple[str, str, int, int, float], float],
                   machine: dict[str, Any]) -> str:
    out = [
        "# Emulated-device benchmark: asynchronous device", "",
        "Each rank's passes run on a device stream (a worker thread, `benchmarks/async_device.py`); the host enqueues "
        "them and runs ahead. It waits only at the optimizer step (a stream synchronize); a send's data is ready "
        "when the producing stream reaches it, and a receiving stream waits for ready + "
        f"{device['latency_s'] * 1e6:g} us + bytes / {device['bandwidth_bps'] / 1e9:g} GB/s "
        f"({device['hop_s'] * 1e6:.2f} us for one {16 * 64 * 4}-byte activation here). "
        "`sim` is ds_vshape's simulator with that hop cost, on the order each system runs (ds_vshape: after lowering). "
        "`sync step` is the same case on the sync device, from the committed `emulated.json` (another run, another time).", "",
        f"Machine: {machine['cpu']} ({machine['cores']} cores); commit {machine['commit']}; "
        f"load average before/after: {machine.get('load', {}).get('async_p4', '?')}.", "",
    ]
    for (p, m) in sorted({(r["p"], r["m"]) for r in rows}, key=lambda k: (k[0], -k[1])):
        out += [f"## p = {p}, m = {m}", "",
                "| system | schedule | step (s) | ideal (s) | eff. | sim (s) | gap to sim | vs DS 1F1B | sync step (s) |",
                "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
        for r in (r for r in rows if r["p"] == p and r["m"] == m):
            name = r["schedule"] if r["system"] != "torch" else f"{r['schedule']} ({r['torch_class']})"
            if "error" in r:
                out.append(f"| {r['system']} | {name} | error: {r['error'][:120]} |" + " |" * 6)
                continue
            sim = r.get("sim_lowered_s", r.get("sim_s"))
            gap = r["step_time_s"] / sim - 1 if sim else None
            base = sync.get((r["system"], r["schedule"], r["p"], r["m"], r["t_pass_s"]))
            out.append(f"| {r['system']} | {name} | {r['step_time_s']:.3f} | {r['ideal_s']:.3f} | {r['efficiency']:.3f} "
                       f"| {cell(sim, '.3f', '')} | {cell(gap, '+.1%', '')} | {cell(r.get('speedup_vs_deepspeed_1f1b'), '.3f', '')} | {cell(base, '.3f', '')} |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    lines = [x for f in sorted(RAW.glob("async_p*.jsonl")) for x in read_jsonl(f)]
    devices = [x for x in lines if x["kind"] == "device"]
    if not devices:
        print(f"report_async: no async run in {RAW} (run: ASYNC=1 bash benchmarks/run.sh)", file=sys.stderr)
        return 1
    device = devices[0]
    # The simulator charges one hop what the async device charges a transfer.
    latency = {d["p"]: {"gloo_send_recv_s": d["hop_s"], "barrier_s": 0.0} for d in devices}
    rows = build_rows([x for x in lines if x["kind"] == "case"], latency)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "emulated_async.json").write_text(json.dumps(rows, indent=1) + "\n")
    machine = machine_info(RAW)
    recorded = (RAW / "async_commit.txt").read_text().split() if (RAW / "async_commit.txt").exists() else []
    if recorded:  # run.sh's record for this phase, not a sync run's from another time
        machine["commit"] = recorded[0] + (" (ds_vshape/ had uncommitted changes)" if "dirty" in recorded[1:] else "")
    text = async_markdown(rows, device, sync_step_times(RESULTS / "emulated.json"), machine)
    (RESULTS / "emulated_async.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
