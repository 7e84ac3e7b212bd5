"""Host cost of one pipeline stage's passes where the host is the bottleneck (issue 28, part a).

``make bench-host`` (with ``host_engine.py``); alone::

    OMP_NUM_THREADS=1 python benchmarks/host_stage.py            # writes benchmarks/results/host_stage.md

Tiny shapes on one thread: every kernel takes microseconds, so a pass's wall time is what the
host spends on it (Python, the dispatcher, autograd nodes), the regime of eager Hugging Face
blocks at about 1k tokens per micro-batch on an H100. The stage is a middle one of the recipe's
tiny Llama (hidden 64, FFN 176, 4 heads), ``--blocks`` decoder blocks, micro-batches of 4
sequences. Four ways of running one micro-batch, the same weights:

* ``forward``: the forward alone, with autograd recording (what a plain forward costs);
* ``fused``: the forward and a fused backward, as DeepSpeed's 1F1B runs them;
* ``torch split``: torch's own split (``torch.distributed.pipelining._backward``): B is
  ``stage_backward_input``, W ``stage_backward_weight``;
* ``ds_vshape``: the forward routed for split backward, B deferring, W ``WeightGradStore.run``.

The ways take turns rep by rep (the order rotating) with the garbage collector off; each pass's
median over the reps. Ratios are against ``fused`` F+B (whole micro-batch) and ``forward`` (F).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_vshape.hf import pipeline_layers  # noqa: E402
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward  # noqa: E402
from recipes.train_hf import SIZES, seed_layer  # noqa: E402

__all__ = ["WAYS", "Stage", "build", "main", "measure", "render"]

WAYS = ("forward", "fused", "torch split", "ds_vshape")
SEED, VOCAB = 1234, 256
Passes = dict[str, float]


@dataclass
class Stage:
    """The stage's copies per way (ds_vshape's with its store), its input and the output gradient."""

    modules: dict[str, list[nn.Module]]
    store: WeightGradStore
    x0: tuple[Any, ...]
    grad: torch.Tensor
    key: int = 0

    def inputs(self) -> tuple[Any, ...]:
        return (self.x0[0].detach().requires_grad_(), *self.x0[1:])


def build(*, blocks: int, seq_len: int, micro_batch: int, size: str = "tiny") -> Stage:
    """``blocks`` decoder blocks after the embedding of the recipe's Llama at ``size``."""
    from transformers import LlamaConfig

    hidden, _, heads, ffn = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=blocks, num_attention_heads=heads,
                         num_key_value_heads=heads, vocab_size=VOCAB, max_position_embeddings=max(seq_len, 128),
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    specs, _ = pipeline_layers(config, attn_implementation="sdpa")
    layers = []
    for index, spec in enumerate(specs[:blocks + 1]):
        seed_layer(SEED + index)
        layers.append(spec.build())
    ids = torch.randint(0, VOCAB, (micro_batch, seq_len), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        x0 = layers[0](ids)
    stage = layers[1:]
    store = WeightGradStore()
    split = [copy.deepcopy(m) for m in stage]
    enable_split_backward(split, store)
    modules = {"forward": stage, "fused": stage, "torch split": [copy.deepcopy(m) for m in stage], "ds_vshape": split}
    grad = torch.randn(_run(stage, x0).shape, generator=torch.Generator().manual_seed(SEED + 1))
    return Stage(modules, store, x0, grad)


def _run(modules: list[nn.Module], x: Any) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x[0] if isinstance(x, tuple) else x


def _timed(out: Passes, name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    out[name] = time.perf_counter() - start
    return result


def run_way(stage: Stage, way: str) -> Passes:
    """One micro-batch's passes in ``way``: seconds per pass."""
    modules, times = stage.modules[way], {}
    x = stage.inputs()
    if way == "ds_vshape":
        stage.key += 1
        key, store = stage.key, stage.store
        with store.forward_of(key, scope="stage"):
            out = _timed(times, "F", lambda: _run(modules, x))
        with store.deferring(key):
            _timed(times, "B", lambda: torch.autograd.backward(out, stage.grad))
        _timed(times, "W", lambda: store.run(key))
        return times
    out = _timed(times, "F", lambda: _run(modules, x))
    if way == "fused":
        _timed(times, "B", lambda: torch.autograd.backward(out, stage.grad))
    elif way == "torch split":
        params = [p for m in modules for p in m.parameters()]
        _, groups = _timed(times, "B", lambda: stage_backward_input([out], [stage.grad], [x[0]], iter(params)))
        _timed(times, "W", lambda: stage_backward_weight(iter(params), groups))
    return times


def measure(stage: Stage, *, reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds per pass and way; the ways rotate rep by rep, the collector off while timed."""
    samples: dict[str, list[Passes]] = {w: [] for w in WAYS}
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + reps):
            for i in range(len(WAYS)):
                way = WAYS[(rep + i) % len(WAYS)]
                times = run_way(stage, way)
                for m in stage.modules[way]:
                    m.zero_grad(set_to_none=True)
                if rep >= warmup:
                    samples[way].append(times)
            gc.collect()
    finally:
        gc.enable()
    medians = {}
    for way, runs in samples.items():
        per = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
        per["total"] = statistics.median(sum(r.values()) for r in runs)
        medians[way] = per
    return medians


def render(medians: dict[str, dict[str, float]], *, setting: str, command: str) -> str:
    fused = medians["fused"]["total"]
    plain_f = medians["forward"]["F"]
    lines = [
        "# Host cost of one stage's passes (host-bound: tiny shapes, one thread)", "",
        f"Measured on: {setting}.", f"Command: `{command}`", "",
        "Median ms per pass; `x fused` is the way's F+B(+W) against the fused F+B, `F x plain` its forward "
        "against the plain forward.", "",
        "| way | F | B | W | F+B(+W) | x fused | F x plain |", "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for way in WAYS:
        m = medians[way]
        cells = [f"{m[p] * 1e3:.3f}" if p in m else "-" for p in ("F", "B", "W")]
        ratio = "-" if way == "forward" else f"{m['total'] / fused:.2f}x"
        lines.append(f"| {way} | {' | '.join(cells)} | {m['total'] * 1e3:.3f} | {ratio} | {m['F'] / plain_f:.2f}x |")
    ds = medians["ds_vshape"]
    lines += ["", "Targets (issue 28 a): ds_vshape F+B+W <= 1.10x fused and below torch's split; F <= 1.05x a plain forward.",
              f"Here: {ds['total'] / fused:.2f}x fused, torch's split {medians['torch split']['total'] / fused:.2f}x, "
              f"F {ds['F'] / plain_f:.2f}x plain.", ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4, help="decoder blocks in the stage")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the recipe's model size")
    parser.add_argument("--reps", type=int, default=200, help="timed micro-batches per way")
    parser.add_argument("--warmup", type=int, default=20, help="untimed micro-batches per way first")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host_stage.md", help="report path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(SEED)
    stage = build(blocks=args.blocks, seq_len=args.seq_len, micro_batch=args.micro_batch, size=args.size)
    medians = measure(stage, reps=args.reps, warmup=args.warmup)
    setting = (f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} thread, torch {torch.__version__}; "
               f"{args.blocks} {args.size} Llama blocks (hidden {SIZES[args.size][0]}), micro-batch {args.micro_batch}x{args.seq_len} "
               f"tokens, {args.reps} reps")
    command = "OMP_NUM_THREADS=1 python benchmarks/host_stage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(medians, setting=setting, command=command.strip())
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
