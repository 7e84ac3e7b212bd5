"""Would split backward's B cost less on the host with no Python per GEMM? A measured prototype (issue 28).

    OMP_NUM_THREADS=1 python benchmarks/split_capture_edges.py --out /tmp/edges.md
    python benchmarks/split_capture_edges.py --device cuda --dtype bf16 --shape 4096 14336 32 8 --blocks 2 \\
        --micro-batch 1 --seq-len 1024 --reps 10 --warmup 3 --out /tmp/edges.md

Not part of the plugin. ds_vshape's B hands each linear layer's output gradient over through a
Python tensor hook, called from inside autograd's engine once per GEMM (``graph_linear.GemmCapture``).
Here B asks autograd for those gradients instead: F records each GEMM's output as a
``GradientEdge`` (``torch.autograd.graph.get_gradient_edge``: the node, not the tensor, so the
output's memory is not held) with its input, and B is one ``torch.autograd.grad`` call whose
inputs are the stage's input, the parameters B computes (the norms') and every recorded edge: the
engine returns each GEMM's output gradient without calling Python. W multiplies them as
ds_vshape's W does. What this leaves out of the plugin's guarantees (saved-tensor hooks,
checkpoints that recompute inside B, custom Functions, in-place checks) is not modelled.

``host_stage.py``'s stage; the gradients are checked against a fused backward first; then fused
F+B, ds_vshape's F+B+W and this way take turns, a fresh random order each rep, medians per pass.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import copy  # noqa: E402
import gc  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd.graph import get_gradient_edge  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import host_stage  # noqa: E402

__all__ = ["EdgeLinear", "main"]

WAYS = ("fused", "ds_vshape", "edges")
Record = list[tuple[nn.Linear, torch.Tensor, Any]]
_RECORD: Record = []  # the running F's GEMMs: (layer, input, output edge)


class EdgeLinear(nn.Linear):
    """F: the GEMM on the detached weight (autograd computes no weight gradient), its output's edge recorded."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = F.linear(input, self.weight.detach(), self.bias)
        _RECORD.append((self, input, get_gradient_edge(out)))
        return out


def _edge_modules(stage: host_stage.Stage) -> tuple[list[nn.Module], list[torch.Tensor]]:
    """A copy of the fused modules with every ``nn.Linear`` an ``EdgeLinear``; the parameters B computes."""
    modules = [copy.deepcopy(m) for m in stage.modules["fused"]]
    for m in modules:
        for sub in m.modules():
            if type(sub) is nn.Linear:
                sub.__class__ = EdgeLinear
    linear = {id(s.weight) for m in modules for s in m.modules() if isinstance(s, EdgeLinear)}
    return modules, [p for m in modules for p in m.parameters() if id(p) not in linear]


def _edges_passes(stage: host_stage.Stage, modules: list[nn.Module], in_b: list[torch.Tensor],
                  clock: host_stage._Clock) -> torch.Tensor:
    """One micro-batch's F, B and W this way; the stage's input (its gradient set by B)."""
    x = stage.inputs()
    _RECORD.clear()
    out = clock("F", lambda: host_stage.run_stage(modules, x))
    record = list(_RECORD)
    _RECORD.clear()

    def backward() -> list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]:
        inputs = [x[0], *in_b, *(edge for _, _, edge in record)]
        grads = torch.autograd.grad([out], inputs, grad_outputs=[stage.grad], allow_unused=True)
        x[0].grad = grads[0]
        for p, g in zip(in_b, grads[1:1 + len(in_b)]):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        return [(layer, inp.detach(), g) for (layer, inp, _), g in zip(record, grads[1 + len(in_b):])]

    parked = clock("B", backward)
    del out, record

    def weights() -> None:
        for layer, inp, g in parked:
            gw = g.reshape(-1, g.shape[-1]).t() @ inp.reshape(-1, inp.shape[-1])
            layer.weight.grad = gw if layer.weight.grad is None else layer.weight.grad + gw

    before = clock.allocated()
    clock("W", weights)
    clock.kept = before - clock.allocated()
    parked.clear()
    return x[0]


def check(stage: host_stage.Stage, modules: list[nn.Module], in_b: list[torch.Tensor]) -> float:
    """The largest difference between this way's gradients (parameters, stage input) and a fused backward's."""
    fused = stage.modules["fused"]
    x = stage.inputs()
    torch.autograd.backward(host_stage.run_stage(fused, x), stage.grad)
    want = [p.grad.clone() for m in fused for p in m.parameters()] + [x[0].grad.clone()]
    x_in = _edges_passes(stage, modules, in_b, host_stage._Clock(stage.device))
    got = [p.grad for m in modules for p in m.parameters()] + [x_in.grad]
    for m in (*fused, *modules):
        m.zero_grad(set_to_none=True)
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want, strict=True))


def measure(stage: host_stage.Stage, modules: list[nn.Module], in_b: list[torch.Tensor], *, reps: int,
            warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds per pass and way (``wall``: the micro-batch, device included), the collector off while timed."""
    samples: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    order = random.Random(host_stage.SEED)
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + reps):
            for way in order.sample(WAYS, len(WAYS)):
                times = _one(stage, way, modules, in_b)
                if rep >= warmup:
                    samples[way].append(times)
            gc.collect()
    finally:
        gc.enable()
    return {way: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for way, runs in samples.items()}


def _one(stage: host_stage.Stage, way: str, modules: list[nn.Module], in_b: list[torch.Tensor]) -> dict[str, float]:
    if way != "edges":
        out = host_stage.run_way(stage, way)
        for m in stage.modules[way]:
            m.zero_grad(set_to_none=True)
        return out
    clock = host_stage._Clock(stage.device)
    start = host_stage.time.perf_counter()
    _edges_passes(stage, modules, in_b, clock)
    out = clock.finish()
    out["wall"] = host_stage.time.perf_counter() - start
    for m in modules:
        m.zero_grad(set_to_none=True)
    return out


def render(medians: dict[str, dict[str, float]], *, setting: str, command: str, diff: float) -> str:
    fused = medians["fused"]["wall"]
    lines = ["# B without Python per GEMM: gradient edges (a prototype, not the plugin)", "",
             f"Measured on: {setting}.", f"Command: `{command}`", "",
             f"The edges way's gradients against a fused backward's: largest difference {diff:.3g}.", "",
             "Median ms per pass of the host's time; `micro-batch` its whole time, device included; `x fused` that "
             "against the fused F+B's." + (" `dev` the device's span per pass." if "dev:F" in medians["fused"] else ""),
             "", "| way | F | B | W | micro-batch | x fused |" + (" dev F | dev B | dev W |" if "dev:F" in medians["fused"] else ""),
             "|---|--:|--:|--:|--:|--:|" + ("--:|--:|--:|" if "dev:F" in medians["fused"] else "")]
    for way, m in medians.items():
        cells = [f"{m[p] * 1e3:.3f}" if p in m else "-" for p in host_stage.PASSES]
        row = f"| {way} | {' | '.join(cells)} | {m['wall'] * 1e3:.3f} | {m['wall'] / fused:.2f}x |"
        if "dev:F" in medians["fused"]:
            row += " " + " | ".join(f"{m[f'dev:{p}'] * 1e3:.3f}" if f"dev:{p}" in m else "-" for p in host_stage.PASSES) + " |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = host_stage.shape_options(host_stage.stage_parser(__doc__.split("\n\n")[0], reps=200))
    parser.add_argument("--out", type=Path, required=True, help="report path")
    args = parser.parse_args(argv)
    stage = host_stage.build_from(args)
    modules, in_b = _edge_modules(stage)
    diff = check(stage, modules, in_b)
    medians = measure(stage, modules, in_b, reps=args.reps, warmup=args.warmup)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, 1 thread"
    setting = (f"{where}, torch {torch.__version__}, {args.dtype}; {args.blocks} blocks, micro-batch "
               f"{args.micro_batch}x{args.seq_len}, median of {args.reps} reps")
    command = "python benchmarks/split_capture_edges.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return host_stage.write_report(render(medians, setting=setting, command=command.strip(), diff=diff), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
