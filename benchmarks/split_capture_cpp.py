"""Would a C++ capture make split backward cheaper on the host? A measured prototype (issue 28).

    OMP_NUM_THREADS=1 python benchmarks/split_capture_cpp.py [--seq-len 16 --micro-batch 1] [--way cpp|python]

Not part of the plugin. ``graph_linear`` then put a Python pre-hook on each linear layer's GEMM node
(``Node.register_prehook``: a ``RemovableHandle`` and a Python call per GEMM in B; since 794cbc6 a
tensor-hook dict on the GEMM's output, without the handle, parked when B ends). Here a small
C++ extension, built with ``torch.utils.cpp_extension.load_inline`` (a compiler and ninja are
needed; about 20 s the first time, cached after), registers a C++ ``FunctionPreHook`` instead that
appends (what W needs, the output gradient) to a list; at the end of B the list is parked as the
same ``MatmulWork`` the Python hook parks. Only calls without saved-tensor hooks take it (a
checkpoint's unpack must run inside B). The weight and input gradients are checked equal to a
fused backward's first, then ``host_stage.py``'s stage is timed (F, B with the parking, W) against
its fused F+B in the same process. Each way runs in a process of its own (``--way``); without
it, both run in turn and a table is printed.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_model  # noqa: E402
from benchmarks.host_stage import Stage, build, run_stage, stage_parser  # noqa: E402
from ds_vshape.runtime.split import graph_linear  # noqa: E402
from ds_vshape.runtime.split.split_ops import MatmulWork  # noqa: E402

__all__ = ["main"]

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
namespace {
struct Capture : torch::autograd::FunctionPreHook {
  PyObject* sink;
  PyObject* payload;
  Capture(PyObject* s, PyObject* p) : sink(s), payload(p) { Py_INCREF(s); Py_INCREF(p); }
  ~Capture() override {
    if (Py_IsInitialized()) { pybind11::gil_scoped_acquire gil; Py_DECREF(sink); Py_DECREF(payload); }
  }
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (!grads.empty() && grads[0].defined()) {
      pybind11::gil_scoped_acquire gil;
      PyObject* grad = THPVariable_Wrap(grads[0]);
      PyObject* item = PyTuple_Pack(2, payload, grad);
      PyList_Append(sink, item);
      Py_DECREF(item);
      Py_DECREF(grad);
    }
    return grads;
  }
};
}  // namespace
void capture(const at::Tensor& out, py::object sink, py::object payload) {
  auto node = out.grad_fn();
  TORCH_CHECK(node, "capture: the tensor has no grad_fn");
  node->add_pre_hook(std::make_unique<Capture>(sink.ptr(), payload.ptr()));
}
"""


def _install_cpp(sink: list[Any]) -> None:
    """SplitLinear's graph path through the C++ capture (timing and this check only)."""
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("ds_vshape_capture_prototype", cpp_sources=_SOURCE, functions=["capture"])
    routed = graph_linear.SplitLinear.forward

    def forward(self: graph_linear.SplitLinear, input: torch.Tensor) -> torch.Tensor:
        store = self._ds_vshape_bound.store
        weight, bias = self.weight, self.bias
        plan = store.linear_plan(input, weight, bias)
        if plan != graph_linear.GRAPH or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return routed(self, input)
        out = F.linear(input, weight.detach(), bias)
        ext.capture(out if out._base is None else out._base, sink, (store.current, input, input._version, weight))
        return out

    graph_linear.SplitLinear.forward = forward  # type: ignore[method-assign]


def _park(stage: Stage, sink: list[Any]) -> None:
    for (key, x, version, weight), grad in sink:
        if x._version != version:
            raise RuntimeError("a linear layer's input was modified in place after its forward")
        stage.store.park(key, MatmulWork("linear", x, grad, weight, None))
    sink.clear()


def _micro_batch(stage: Stage, sink: list[Any]) -> tuple[float, float, float, torch.Tensor]:
    stage.key += 1
    x = stage.inputs()
    start = time.perf_counter()
    with stage.store.forward_of(stage.key, scope="stage"):
        out = run_stage(stage.modules["ds_vshape"], x)
    f = time.perf_counter() - start
    start = time.perf_counter()
    with stage.store.deferring(stage.key):
        torch.autograd.backward(out, stage.grad)
        _park(stage, sink)
    b = time.perf_counter() - start
    start = time.perf_counter()
    stage.store.run(stage.key)
    return f, b, time.perf_counter() - start, x[0].grad


def _fused(stage: Stage) -> tuple[float, float, torch.Tensor]:
    x = stage.inputs()
    start = time.perf_counter()
    out = run_stage(stage.modules["fused"], x)
    f = time.perf_counter() - start
    start = time.perf_counter()
    torch.autograd.backward(out, stage.grad)
    return f, time.perf_counter() - start, x[0].grad


def _way(args: argparse.Namespace) -> str:
    stage = build(blocks=args.blocks, seq_len=args.seq_len, micro_batch=args.micro_batch)
    sink: list[Any] = []
    if args.way == "cpp":
        _install_cpp(sink)
    split, fused = stage.modules["ds_vshape"], stage.modules["fused"]
    mine, base = [], []
    gc.disable()
    for rep in range(args.warmup + args.reps):
        for mod in (*split, *fused):
            mod.zero_grad(set_to_none=True)
        *passes, grad = _micro_batch(stage, sink)
        *plain, plain_grad = _fused(stage)
        if rep == args.warmup - 1:  # the split exact against the fused backward before anything is timed
            pairs = zip((p for m in split for p in m.parameters()), (p for m in fused for p in m.parameters()))
            close = lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)  # noqa: E731 - fp32, the project's bar
            assert close(grad, plain_grad) and all(close(a.grad, b.grad) for a, b in pairs), "split != fused"
        if rep >= args.warmup:
            mine.append(passes)
            base.append(plain)
        if rep % 50 == 0:
            gc.collect()
    gc.enable()
    f, b, w = (statistics.median(r[i] for r in mine) * 1e3 for i in range(3))
    pf, pb = (statistics.median(r[i] for r in base) * 1e3 for i in range(2))
    return f"| {args.way} | {f:.3f} | {b:.3f} | {w:.3f} | {pf + pb:.3f} | {(f + b + w) / (pf + pb):.3f}x | {f / pf:.3f}x |"


def main(argv: list[str] | None = None) -> int:
    ap = stage_parser(__doc__.split("\n\n")[0], reps=300)
    ap.add_argument("--way", choices=("cpp", "python"), help="run one way here (without: each in a process, a table)")
    args = ap.parse_args(argv)
    if args.way is not None:
        print(_way(args))
        return 0
    given = argv if argv is not None else sys.argv[1:]
    print(f"Command: `OMP_NUM_THREADS=1 python benchmarks/split_capture_cpp.py {' '.join(given)}`. {args.blocks} tiny Llama "
          f"blocks, micro-batch {args.micro_batch}x{args.seq_len} tokens, torch {torch.__version__}, 1 thread, CPU "
          f"{cpu_model() or 'unknown'}; medians of {args.reps} micro-batches, ms.\n")
    print("| capture | F | B (parking included) | W | fused F+B | x fused | F x plain |\n|---|--:|--:|--:|--:|--:|--:|")
    for way in ("python", "cpp", "python", "cpp"):
        run = subprocess.run([sys.executable, __file__, "--way", way, *given], check=True, capture_output=True, text=True)
        print(run.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
