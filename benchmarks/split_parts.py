"""Where split backward's host time goes on one stage (issue 28): each part measured by taking it out.

    OMP_NUM_THREADS=1 python benchmarks/split_parts.py [--seq-len 16 --micro-batch 1]

The stage of ``host_stage.py`` (tiny Llama blocks, one thread: wall time is host time). Each
variant runs in a process of its own with the plain stage beside it, taking turns micro-batch by
micro-batch (which side goes first alternates), and is reported against it:

* ``control``: a plain copy of the stage in the split's place, its forward against the plain
  stage's: what the harness itself tells apart (a figure within its distance of 1 is nothing);
* ``F``: the forward routed for split backward, against a plain forward;
* ``F, no capture``: the same without the hook each linear layer puts on its GEMM's output (what
  registering it costs; the weight gradients are then lost: timing only);
* ``F, no hooks``: without the decoder blocks' entry to the routing (``module_hooks``: forward hooks
  before, a ``RoutedStage`` class now);
* ``F, GEMM only``: without both: what is left is each linear layer's plan and its GEMM on the
  detached weight;
* ``B``: B against a backward whose linear weights are frozen (the same GEMMs: input gradients only);
* ``B, empty capture``: B with each capture hook returning at once (the hook's call, not its work).

The figures are medians over ``--reps`` micro-batches, printed as a markdown table
(``benchmarks/results/split_parts.md`` is one run's output, redirected there).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # host time on a CPU thread; and no accelerator notice in the table

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_model  # noqa: E402
from benchmarks.host_stage import Stage, build, run_stage, stage_parser  # noqa: E402
from ds_vshape.runtime.split import graph_linear, module_hooks  # noqa: E402

__all__ = ["VARIANTS", "main"]

VARIANTS = ("control", "F", "F, no capture", "F, no hooks", "F, GEMM only", "B", "B, empty capture")


def _take_out(variant: str, modules: list[torch.nn.Module]) -> None:
    """Remove the variant's part from the split stage (timing only: gradients may be wrong after)."""
    if variant in ("F, no capture", "F, GEMM only"):
        routed = graph_linear.SplitLinear.forward

        def forward(self: graph_linear.SplitLinear, input: torch.Tensor) -> torch.Tensor:
            plan = self._ds_vshape_bound.store.linear_plan(input, self.weight, self.bias)
            return F.linear(input, self.weight.detach(), self.bias) if plan == graph_linear.GRAPH else routed(self, input)

        graph_linear.SplitLinear.forward = forward  # type: ignore[method-assign]
    if variant in ("F, no hooks", "F, GEMM only"):
        for m in modules:  # the blocks' entry to the routing: hooks, or their class made a RoutedStage
            m._forward_pre_hooks.clear()
            m._forward_hooks.clear()
            m._forward_hooks_always_called.clear()
            if isinstance(m, module_hooks.RoutedStage):
                m.__class__ = type(m).__mro__[2]  # (the RoutedStage subclass, RoutedStage, the block's class)
    elif variant == "B, empty capture":
        graph_linear.GemmCapture.__call__ = lambda self, grad: None  # type: ignore[method-assign]


def _one(variant: str, args: argparse.Namespace) -> tuple[float, float]:
    """(median seconds of the variant's pass, of the plain stage's same pass)."""
    stage = build(blocks=args.blocks, seq_len=args.seq_len, micro_batch=args.micro_batch)
    # The control times a plain copy of the stage in the split's place: what the harness itself tells apart.
    plain = stage.modules["fused"]
    split = copy.deepcopy(plain) if variant == "control" else stage.modules["ds_vshape"]
    _take_out(variant, split)
    if variant.startswith("B"):  # the plain stage's backward: the same GEMMs, input gradients only
        for mod in plain:
            for sub in mod.modules():
                if isinstance(sub, torch.nn.Linear):
                    sub.weight.requires_grad_(False)
    timed = 0 if variant.startswith("F") or variant == "control" else 1
    mine, base = [], []
    gc.disable()  # the unit test runs this in its own process: never leave the collector off
    try:
        for rep in range(args.warmup + args.reps):
            # Which side runs first alternates: a pass right after the other side's W or backward finds
            # the caches in another state than one after its own stage's zero_grad.
            if rep % 2:
                theirs, ours = _plain_passes(stage, plain), _split_passes(stage, split)
            else:
                ours, theirs = _split_passes(stage, split), _plain_passes(stage, plain)
            for mod in (*split, *plain):
                mod.zero_grad(set_to_none=True)
            if rep >= args.warmup:
                mine.append(ours[timed])
                base.append(theirs[timed])
            if rep % 50 == 0:
                gc.collect()
    finally:
        gc.enable()
    return statistics.median(mine), statistics.median(base)


def _split_passes(stage: Stage, split: list[torch.nn.Module]) -> tuple[float, float]:
    """(F, B) seconds of one split micro-batch; its W runs after, untimed."""
    stage.key += 1
    x = stage.inputs()
    start = time.perf_counter()
    with stage.store.forward_of(stage.key, scope="stage"):
        out = run_stage(split, x)
    f = time.perf_counter() - start
    start = time.perf_counter()
    with stage.store.deferring(stage.key):
        torch.autograd.backward(out, stage.grad)
    b = time.perf_counter() - start
    stage.store.run(stage.key)
    return f, b


def _plain_passes(stage: Stage, plain: list[torch.nn.Module]) -> tuple[float, float]:
    """(F, B) seconds of one plain micro-batch."""
    x = stage.inputs()
    start = time.perf_counter()
    out = run_stage(plain, x)
    f = time.perf_counter() - start
    start = time.perf_counter()
    torch.autograd.backward(out, stage.grad)
    return f, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser(__doc__.split("\n\n")[0], reps=300)
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant here (the parent runs each in a process)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), metavar="VARIANT",
                    help="the rows to measure, each in a process of its own (default: every variant)")
    args = ap.parse_args(argv)
    if args.variant is not None:
        mine, base = _one(args.variant, args)
        print(f"{mine!r} {base!r}")
        return 0
    given = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"# Split backward's parts (issue 28)\n\nCommand: `OMP_NUM_THREADS=1 python benchmarks/split_parts.py {given}`."
          f"\n{args.blocks} tiny Llama blocks, micro-batch {args.micro_batch}x{args.seq_len} tokens, torch {torch.__version__},"
          f" 1 thread, CPU {cpu_model() or 'unknown'}; each row a process of its own, median of {args.reps} against the plain stage"
          " in the same process (its column).\n")
    print("| variant | ms | plain's ms | x plain |\n|---|--:|--:|--:|")
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--variant", variant, *(argv if argv is not None else sys.argv[1:])]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
        mine, base = float(out[-2]), float(out[-1])
        print(f"| {variant} | {mine * 1e3:.3f} | {base * 1e3:.3f} | {mine / base:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
