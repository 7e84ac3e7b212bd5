"""What split backward costs on real compute: one pipeline stage, plain F+B against split F+B+W.

``make bench-split`` (with ``kept_share.py``); alone::

    OMP_NUM_THREADS=1 python benchmarks/split_cost.py                  # bench-real's last rank at p=2
    OMP_NUM_THREADS=1 python benchmarks/split_cost.py --stage middle --hidden 512 --ffn 1408

Single process, one thread. The compute-size Llama of ``make bench-real`` (hidden 384, FFN 1056,
6 heads, 8 blocks, byte vocabulary, micro-batches of 4 sequences of 128); ``--stage last`` is
what its second rank runs at p=2 (blocks 4..7, final norm, head and loss), ``--stage middle``
four decoder blocks alone. Three copies of the stage, the same weights:

* ``plain``: the forward and a fused backward, as DeepSpeed's 1F1B runs them;
* ``routed``: the split routing on, backward not deferred (the routing's own cost);
* ``split``: B defers the weight gradients, W (``WeightGradStore.run``) computes them.

1. Timing: the modes take turns rep by rep (the order rotating), median per pass; minor page
   faults per pass (``getrusage``).
2. Profile: ``torch.profiler`` over a few reps, each operator's self time put in the pass whose
   window it starts in, by category (GEMM, attention, elementwise, accumulate ``add_``, and
   the rest: Python, autograd and dispatch), with calls per pass to show the same kernels ran.
3. GEMM control: the block's weight-gradient GEMMs alone, on operands just used (hot) and on
   operands pushed out of the cache by writing a large buffer first (cold).

Writes ``benchmarks/results/split_cost.md`` and ``split_cost.json``; the prose quotes this run's figures.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import AbstractContextManager, contextmanager, nullcontext  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.split_cost_report import load_average, render  # noqa: E402
from ds_vshape.hf import pipeline_layers  # noqa: E402
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward  # noqa: E402
from recipes.train_hf import seed_layer  # noqa: E402

__all__ = ["MODES", "PASSES", "Bench", "build", "category", "gemm_control", "main", "profile_passes", "timed_passes"]

MODES = ("plain", "routed", "split")
PASSES = ("F", "B", "W")
SEED, MICRO_BATCH, VOCAB, BLOCKS = 1234, 4, 256, 8
STAGES = {"last": (5, 10), "middle": (3, 7)}  # pipeline_layers indices: 0 embedding, 1..8 blocks, 9 head
GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}
# Operators that move no data (views, wrappers that dispatch to a kernel counted on its own).
DISPATCH = {"aten::" + n for n in ("view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "as_strided",
                                   "detach", "alias", "unsqueeze", "squeeze", "slice", "select", "linear", "matmul", "empty",
                                   "empty_like", "empty_strided", "_unsafe_view", "resize_", "lift_fresh", "contiguous", "to",
                                   "split", "chunk", "narrow", "unbind", "view_as", "expand_as", "result_type", "numpy_T",
                                   "scaled_dot_product_attention", "resolve_conj", "resolve_neg", "zeros", "ones_like", "zeros_like", "full_like")}
CATEGORIES = ("GEMM", "attention", "elementwise", "accumulate", "other")


@dataclass
class Bench:
    """The stage in its three modes (modules and store), its input and the output's gradient."""

    modes: dict[str, tuple[list[nn.Module], WeightGradStore | None]]
    inputs: Callable[[], Any]
    loss: Callable[[torch.Tensor], torch.Tensor] | None
    grad: torch.Tensor | None
    gemm_shapes: list[tuple[str, int, int, int]]  # (name, tokens, in_features, out_features)
    key: int = 0
    describe: str = ""


@dataclass
class PassRecord:
    """One micro-batch's passes: wall seconds, process CPU seconds and minor page faults, per pass."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)  # not inflated while another process has the core
    faults: dict[str, int] = field(default_factory=dict)
    parked: int = 0  # bytes split backward kept for W at the end of B


# ---- the stage --------------------------------------------------------------------------------
def build(args: argparse.Namespace) -> Bench:
    """The compute-size Llama's stage ``args.stage``, plain, routed and split (deep copies, same weights)."""
    from benchmarks.bench_real import model_config  # the very model make bench-real trains

    args.blocks = BLOCKS
    specs, loss_fn = pipeline_layers(model_config(args, vocab_size=VOCAB), attn_implementation="sdpa")
    layers = []
    for index, spec in enumerate(specs):
        seed_layer(SEED + index)
        layers.append(spec.build())
    a, b = STAGES[args.stage]
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, args.seq_len), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        x0: Any = ids
        for layer in layers[:a]:
            x0 = layer(x0)
    stage = layers[a:b]
    modes: dict[str, tuple[list[nn.Module], WeightGradStore | None]] = {"plain": (stage, None)}
    for mode in MODES[1:]:
        copies = [copy.deepcopy(m) for m in stage]
        store = WeightGradStore()
        enable_split_backward(copies, store)
        modes[mode] = (copies, store)
    last = b == len(layers)
    out = _forward(stage, (x0[0].detach(), *x0[1:]), None)
    grad = None if last else torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED + 1))
    return Bench(modes, lambda: (x0[0].detach().requires_grad_(), *x0[1:]),
                 (lambda logits: loss_fn(logits, ids)) if last else None, grad, _gemm_shapes(args, last=last),
                 describe=f"layers {a}..{b - 1} of pipeline_layers ({b - a - int(last)} decoder blocks"
                          f"{', final norm, head and loss' if last else ''})")


def _gemm_shapes(args: argparse.Namespace, *, last: bool) -> list[tuple[str, int, int, int]]:
    tokens, h, f = MICRO_BATCH * args.seq_len, args.hidden, args.ffn
    shapes = [("q/k/v/o", tokens, h, h), ("gate/up", tokens, h, f), ("down", tokens, f, h)]
    return shapes + ([("head", tokens, h, VOCAB)] if last else [])


def _forward(modules: list[nn.Module], x: Any, loss: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    for m in modules:
        x = m(x)
    out = x[0] if isinstance(x, tuple) else x
    return loss(out) if loss is not None else out


# ---- one pass of each kind --------------------------------------------------------------------
def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextmanager
def _pass(record: PassRecord, name: str, label: str | None) -> Iterator[None]:
    with record_function(label) if label else nullcontext():
        faults, cpu, start = _faults(), time.process_time(), time.perf_counter()
        yield
        record.seconds[name] = time.perf_counter() - start
        record.cpu[name] = time.process_time() - cpu
        record.faults[name] = _faults() - faults


def run_once(bench: Bench, mode: str, *, labelled: bool = False) -> PassRecord:
    """F, B and (split) W of one micro-batch in ``mode``; ``labelled``: profiler ranges "mode|pass"."""
    modules, store = bench.modes[mode]
    bench.key += 1
    key, record = bench.key, PassRecord()
    x = bench.inputs()
    forward: AbstractContextManager[None] = store.forward_of(key, scope="stage") if store else nullcontext()
    backward: AbstractContextManager[None] = nullcontext() if store is None else store.backward_of(key, defer=mode == "split")
    with _pass(record, "F", f"{mode}|F" if labelled else None), forward:
        out = _forward(modules, x, bench.loss)
    with _pass(record, "B", f"{mode}|B" if labelled else None), backward:
        torch.autograd.backward(out, bench.grad)
    with _pass(record, "W", f"{mode}|W" if labelled else None):
        if mode == "split":
            assert store is not None
            record.parked = store.parked_bytes
            store.run(key)
    return record


def timed_passes(bench: Bench, *, reps: int, warmup: int) -> dict[str, list[PassRecord]]:
    """Each mode once per rep, the order rotating rep by rep so no mode always runs first."""
    out: dict[str, list[PassRecord]] = {m: [] for m in MODES}
    gc.collect()
    gc.disable()  # a collection inside one timed pass would land on whichever mode ran then
    try:
        for rep in range(warmup + reps):
            for i in range(len(MODES)):
                mode = MODES[(rep + i) % len(MODES)]
                record = run_once(bench, mode)
                if rep >= warmup:
                    out[mode].append(record)
            gc.collect()
    finally:
        gc.enable()
    return out


# ---- profile ------------------------------------------------------------------------------------
def category(name: str) -> str:
    """The breakdown category of one profiled operator."""
    if name in GEMM:
        return "GEMM"
    if name in DISPATCH:
        return "other"
    if "scaled_dot_product" in name or "flash_attention" in name or name in ("aten::_softmax", "aten::_softmax_backward_data"):
        return "attention"
    if name == "aten::add_":
        return "accumulate"
    if name.startswith("aten::"):
        return "elementwise"
    return "other"


def profile_passes(bench: Bench, *, reps: int) -> dict[str, Any]:
    """Per "mode|pass" label: wall ms, and self ms and calls per operator and per category; medians over reps.

    Operators are put in the labelled window they start in (backward operators run under the
    autograd engine, not nested under the label). "other" is the window's wall time minus the
    categorised operators' self time: Python, autograd's engine and dispatch. Medians, not means:
    on a shared machine one preempted rep would otherwise move every figure.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            for mode in MODES:
                run_once(bench, mode, labelled=True)
    events = list(prof.events())
    windows = _windows(events)
    per_rep: dict[str, list[dict[str, list[float]]]] = defaultdict(lambda: [defaultdict(lambda: [0.0, 0.0]) for _ in range(reps)])
    for e in events:
        if "|" in e.name or not e.name.startswith("aten::"):
            continue
        found = _window(windows, e.time_range.start)
        if found is not None:
            label, rep = found
            cell = per_rep[label][rep][e.name]
            cell[0] += e.self_cpu_time_total / 1e3
            cell[1] += 1
    wall = {label: [0.0] * reps for label in {w[2] for w in windows}}
    for start, end, label, rep in windows:
        wall[label][rep] = (end - start) / 1e3
    cats = {label: [_categorised(wall[label][r], per_rep[label][r]) for r in range(reps)] for label in wall}
    names = {label: {n for r in per_rep[label] for n in r} for label in wall}
    return {"wall_ms": {label: statistics.median(v) for label, v in wall.items()},
            "ops": {label: {n: _median_cell([r.get(n, [0.0, 0.0]) for r in per_rep[label]]) for n in names[label]} for label in wall},
            "categories": {label: {c: _median_cell([r[c] for r in cats[label]]) for c in CATEGORIES} for label in wall}}


def _windows(events: list[Any]) -> list[tuple[float, float, str, int]]:
    """The labelled ranges in time order, each with its rep (the how-manieth range of its label)."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for start, end, label in sorted((e.time_range.start, e.time_range.end, e.name) for e in events if "|" in e.name):
        out.append((start, end, label, seen[label]))
        seen[label] += 1
    return out


def _window(windows: list[tuple[float, float, str, int]], t: float) -> tuple[str, int] | None:
    for start, end, label, rep in windows:
        if start <= t <= end:
            return label, rep
    return None


def _categorised(wall: float, ops: dict[str, list[float]]) -> dict[str, list[float]]:
    cats = {c: [0.0, 0.0] for c in CATEGORIES}
    for name, (ms, calls) in ops.items():
        cell = cats[category(name)]
        cell[0] += ms
        cell[1] += calls
    cats["other"][0] = wall - sum(cats[c][0] for c in CATEGORIES if c != "other")
    return cats


def _median_cell(cells: list[list[float]]) -> list[float]:
    return [statistics.median(c[0] for c in cells), statistics.median(c[1] for c in cells)]


# ---- GEMM control -------------------------------------------------------------------------------
def gemm_control(shapes: list[tuple[str, int, int, int]], *, reps: int, evict_mib: int) -> list[dict[str, Any]]:
    """Median CPU ms of each weight-gradient GEMM (g^T x, as W computes it) on hot and on cold operands."""
    buffer = torch.empty(evict_mib * 2**20 // 4)
    rows = []
    for name, tokens, fan_in, fan_out in shapes:
        xs = [torch.randn(tokens, fan_in) for _ in range(4)]
        gs = [torch.randn(tokens, fan_out) for _ in range(4)]
        gs[0].t().mm(xs[0])  # first call's one-off costs out of both series
        cold, hot = [], []
        for i in range(reps):
            x, g = xs[i % 4], gs[i % 4]
            buffer.add_(1.0)  # writes more than the L1/L2 caches hold: the operands are no longer there
            cold.append(_cpu_ms(g.t().mm, x))
            hot.append(_cpu_ms(g.t().mm, x))  # the same operands, just read
        rows.append({"gemm": name, "shape": f"[{fan_out}x{tokens}] @ [{tokens}x{fan_in}]",
                     "hot_ms": statistics.median(hot), "cold_ms": statistics.median(cold)})
    return rows


def _cpu_ms(fn: Callable[[torch.Tensor], Any], arg: torch.Tensor) -> float:
    # Process CPU time: cache misses stall the core and count; time the core spent on another process does not.
    start = time.process_time()
    fn(arg)
    return (time.process_time() - start) * 1e3


# ---- main ---------------------------------------------------------------------------------------
def summarize(timed: dict[str, list[PassRecord]]) -> dict[str, dict[str, float]]:
    """Per mode: median wall ms per pass and of the rep's total, the total's minimum and median CPU ms, median faults per pass."""
    out: dict[str, dict[str, float]] = {}
    for mode, records in timed.items():
        row = {p: statistics.median(r.seconds[p] for r in records) * 1e3 for p in PASSES}
        row["total"] = statistics.median(sum(r.seconds.values()) for r in records) * 1e3
        row["total_min"] = min(sum(r.seconds.values()) for r in records) * 1e3
        row["total_cpu"] = statistics.median(sum(r.cpu.values()) for r in records) * 1e3
        row.update({f"faults_{p}": statistics.median(r.faults[p] for r in records) for p in PASSES})
        row["parked_mib"] = statistics.median(r.parked for r in records) / 2**20
        out[mode] = row
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=sorted(STAGES), default="last", help="last: bench-real's rank 1 at p=2; middle: 4 blocks")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--ffn", type=int, default=1056)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=40, help="timed reps (each runs every mode once)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-reps", type=int, default=5)
    ap.add_argument("--gemm-reps", type=int, default=25)
    ap.add_argument("--evict-mib", type=int, default=64, help="buffer written before each cold GEMM")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--name", default="split_cost", help="output file stem")
    ap.add_argument("--render", type=Path, metavar="JSON", help="only rewrite the markdown from this run's JSON (no measuring)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        result = json.loads(args.render.read_text())
        (args.render.with_suffix(".md")).write_text(render(result) + "\n")
        return 0
    measured_at = git_commit()  # the commit measured, recorded before measuring
    torch.set_num_threads(1)
    started, load_start = time.perf_counter(), load_average()
    bench = build(args)
    timed = timed_passes(bench, reps=args.reps, warmup=args.warmup)
    prof = profile_passes(bench, reps=args.profile_reps)
    gemms = gemm_control(bench.gemm_shapes, reps=args.gemm_reps, evict_mib=args.evict_mib)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "stage": bench.describe,
              "summary": summarize(timed), "profile": prof, "gemm_control": gemms,
              "command": "python benchmarks/split_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "load_start": load_start, "wall_s": time.perf_counter() - started, "commit": measured_at, "torch": torch.__version__}
    md = render(result)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
