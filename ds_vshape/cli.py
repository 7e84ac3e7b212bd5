"""``ds-vshape`` / ``python -m ds_vshape``: export, simulate, compare and list schedules.

Everything here runs on the pure schedule layer: no torch, no deepspeed, no GPU. User
errors (unknown schedule, too few micro-batches, ...) become one line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .schedules.costs import Costs
from .schedules.ir import Schedule
from .schedules.lowering import lower
from .schedules.ops import format_ops
from .schedules.trace_ops import data_parallel_events
from .schedules.registry import GeneratorInfo, generate, get_info, schedule_names
from .schedules.seq_partition import MODES, chunk_boundaries, chunk_costs, chunk_lengths
from .schedules.render import (
    BASELINE,
    ascii_timeline,
    chrome_trace,
    compare_rows,
    format_table,
    plot_timeline,
    rank_rows,
)
from .schedules.simulate import SimResult, simulate
from .schedules.validate import ScheduleError

__all__ = ["main", "build_parser"]

_EXIT_USAGE = 2  # argparse's own status for bad usage; we use it for every user error
_EXIT_IO = 1


def main(argv: Sequence[str] | None = None, *, prog: str = "ds-vshape") -> int:
    """Run one command; returns the exit status (the console script passes it to sys.exit)."""
    parser = build_parser(prog=prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, or argparse's own usage error (already printed)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else _EXIT_USAGE)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ScheduleError as err:
        # A generator produced a broken schedule: a bug, and the grid in the message is the clue.
        print(f"{prog}: error: {err}", file=sys.stderr)
        return _EXIT_USAGE
    except ValueError as err:
        print(f"{prog}: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return _EXIT_USAGE
    except OSError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return _EXIT_IO


# ---- parser -------------------------------------------------------------------------------
def build_parser(*, prog: str = "ds-vshape") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Pipeline-parallel schedules for DeepSpeed: export, simulate, compare.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    export = sub.add_parser("export", help="print one schedule as JSON (the stable export contract)")
    _add_schedule_options(export)
    _add_cost_options(export, memory=False)
    export.set_defaults(handler=_cmd_export)

    sim = sub.add_parser("simulate", help="simulate one schedule: table, ASCII timeline, optional plot and trace")
    _add_schedule_options(sim)
    _add_cost_options(sim, memory=True)
    sim.add_argument("--width", type=int, metavar="N", help="characters of the ASCII timeline (default: fit passes, at most 160)")
    sim.add_argument("--plot", type=Path, metavar="FILE.png", help="write a PNG timeline (needs matplotlib)")
    sim.add_argument("--trace", type=Path, metavar="FILE.json", help="write a Chrome trace (open in ui.perfetto.dev)")
    sim.add_argument("--ops", type=int, metavar="RANK", help="also print the operations pipeline rank RANK executes per step "
                     "(lowered: transfers, ZeRO's reduce_stage_grads and gather_params/release_params, the step tail)")
    _add_seq_partition_options(sim)
    off = sim.add_argument_group("activation offload (pipeline.offload)")
    off.add_argument("--offload", type=float, default=0.0, metavar="S",
                     help="share of each rank's activation offloaded to host between F and B, 0..1 (default 0)")
    off.add_argument("--t-copy", type=float, default=0.0, metavar="T",
                     help="time to copy one M_B between device and host, one way (default 0)")
    sim.set_defaults(handler=_cmd_simulate)

    cmp = sub.add_parser(
        "compare",
        help="simulate every schedule at one (p, m) and tabulate against 1f1b; with --seq-chunks K the schedules "
        "that cut sequences use K, the others run unchunked (column k says which)",
    )
    _add_schedule_options(cmp, with_name=False)
    _add_cost_options(cmp, memory=True)
    cmp.add_argument("--format", choices=("text", "markdown"), default="text", help="table style (default text)")
    cmp.set_defaults(handler=_cmd_compare)

    lst = sub.add_parser("list", help="list the schedules, their aliases and the options they take")
    lst.set_defaults(handler=_cmd_list)
    return parser


def _add_schedule_options(parser: argparse.ArgumentParser, *, with_name: bool = True) -> None:
    if with_name:
        parser.add_argument("--schedule", "-s", required=True, metavar="NAME", help="schedule name or alias (see 'list')")
    parser.add_argument("--stages", "-p", type=int, required=True, metavar="P", help="pipeline ranks p")
    parser.add_argument("--micro-batches", "-m", type=int, required=True, metavar="M", help="micro-batches per step")
    parser.add_argument("--chunks", "-v", type=int, metavar="V", help="model chunks per rank, for schedules that let you pick")
    parser.add_argument("--seq-chunks", "-k", type=int, metavar="K",
                        help="sequence chunks per micro-batch, for schedules that cut sequences ('list' shows which)")
    parser.add_argument("--memory-limit", type=float, metavar="X", help="activation memory limit in M_B, for schedules that take one")
    if with_name:
        parser.add_argument("--fuse-idle-w", action="store_true",
                            help="run each W that fills no bubble under these costs fused with its B, as the engine "
                                 "does with pipeline.fuse_idle_w true (the engine: with pipeline.pass_costs, else equal F, B and W)")


def _add_cost_options(parser: argparse.ArgumentParser, *, memory: bool) -> None:
    group = parser.add_argument_group("pass costs (relative; a rank with v chunks runs each in 1/v of these)")
    group.add_argument("--t-f", type=float, default=1.0, metavar="T", help="forward time (default 1)")
    group.add_argument("--t-b", type=float, default=1.0, metavar="T", help="input-gradient time (default 1)")
    group.add_argument("--t-w", type=float, default=1.0, metavar="T", help="weight-gradient time (default 1)")
    group.add_argument("--t-comm", type=float, default=0.0, metavar="T", help="latency of one hop between ranks (default 0)")
    group.add_argument("--w-memory", type=float, default=0.0, metavar="S",
                       help="share of a unit's activation that split backward keeps from B until W, 0..1; "
                            "the split-backward schedules keep their memory bound counting it (default 0)")
    if memory:
        group.add_argument("--kept-until-w", type=float, default=None, metavar="S",
                           help="count memory as if B kept this share for W instead, 0..1 (default: --w-memory)")


def _add_seq_partition_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sequence partition (with --seq-chunks: where chunks are cut, and what each costs)")
    group.add_argument("--seq-partition", choices=MODES, metavar="MODE",
                       help="uniform: equal tokens per chunk; compute: equal cost per chunk (later chunks shorter). "
                            "Prints the boundaries and each chunk's cost, and simulates with those costs")
    group.add_argument("--seq-len", type=int, default=4096, metavar="N", help="tokens per sequence (default 4096)")
    group.add_argument("--hidden", type=int, default=4096, metavar="H", help="hidden size (default 4096)")
    group.add_argument("--heads", type=int, default=32, metavar="A", help="attention heads (default 32)")
    group.add_argument("--head-dim", type=int, metavar="D", help="size of one head (default hidden / heads)")
    group.add_argument("--ffn", type=int, metavar="F", help="FFN width (default 4 * hidden)")


def _costs(args: argparse.Namespace) -> Costs:
    if not 0.0 <= args.w_memory <= 1.0:  # named as the flag, not as the Costs field
        raise ValueError(f"--w-memory must be between 0 and 1, got {args.w_memory}")
    return Costs(f=args.t_f, b=args.t_b, w=args.t_w, comm=args.t_comm, w_memory=args.w_memory,
                 copy=getattr(args, "t_copy", 0.0))


def _kept_until_w(args: argparse.Namespace, costs: Costs) -> float:
    """The share memory is counted with: what the schedules planned for unless overridden."""
    if args.kept_until_w is None:
        return costs.w_memory
    share = float(args.kept_until_w)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--kept-until-w must be between 0 and 1, got {share}")
    return share


def _generate(args: argparse.Namespace, costs: Costs) -> Schedule:
    return generate(
        args.schedule,
        args.stages,
        args.micro_batches,
        chunks=args.chunks,
        seq_chunks=args.seq_chunks,
        memory_limit=args.memory_limit,
        costs=costs,
        fuse_idle_w=args.fuse_idle_w,
    )


# ---- commands -----------------------------------------------------------------------------
def _cmd_export(args: argparse.Namespace) -> int:
    print(json.dumps(_generate(args, _costs(args)).to_dict()))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    costs = _costs(args)
    kept = _kept_until_w(args, costs)
    if args.width is not None and args.width < 10:
        raise ValueError(f"--width must be at least 10, got {args.width}")
    schedule = _generate(args, costs)
    partition = _seq_partition(args, schedule.seq_chunks)
    if partition is not None:
        costs = dataclasses.replace(costs, seq_weights=partition[1])
    result = simulate(schedule, costs, kept_until_w=kept, offload=args.offload)
    baseline = _baseline(args.stages, args.micro_batches, dataclasses.replace(costs, seq_weights=None), kept)
    print(_simulate_header(schedule, costs, kept))
    if args.offload:
        print(f"offload {args.offload:g} (copy {costs.copy:g} per M_B one way): device peak per rank "
              f"{' '.join(f'{x:.2f}' for x in result.peak_memory)} M_B, host peak per rank "
              f"{' '.join(f'{x:.2f}' for x in result.peak_host_memory)} M_B")
    print()
    if partition is not None:
        print(_partition_table(args, *partition))
        print()
    print(_summary_table(result, baseline))
    print()
    print(rank_rows(result, baseline))
    print()
    print(ascii_timeline(result, schedule, width=args.width))
    if args.ops is not None:
        if not 0 <= args.ops < schedule.stages:
            raise ValueError(f"--ops must name a pipeline rank in 0..{schedule.stages - 1}, got {args.ops}")
        print()
        print(format_ops(lower(schedule, args.ops)))
    _write_outputs(args, result, schedule)
    return 0


def _model_dims(args: argparse.Namespace) -> dict[str, int | None]:
    return {"hidden": args.hidden, "heads": args.heads, "head_dim": args.head_dim, "ffn": args.ffn}


def _seq_partition(args: argparse.Namespace, k: int) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
    """(boundaries, per-chunk cost per layer) for ``--seq-partition``, or None without it."""
    if args.seq_partition is None:
        return None
    dims = _model_dims(args)
    boundaries = chunk_boundaries(args.seq_len, k, mode=args.seq_partition, **dims)
    return boundaries, chunk_costs(boundaries, **dims)  # type: ignore[arg-type]


def _partition_table(args: argparse.Namespace, boundaries: tuple[int, ...], costs: tuple[float, ...]) -> str:
    d_h = args.head_dim or args.hidden // args.heads
    lines = [
        f"{args.seq_partition} partition of {args.seq_len} tokens into {len(costs)} chunks "
        f"(hidden {args.hidden}, heads {args.heads}, head_dim {d_h}, ffn {args.ffn or 4 * args.hidden}); "
        f"boundaries {' '.join(str(b) for b in boundaries)}",
        "chunk  tokens  cost/layer  share",
    ]
    total = sum(costs)
    for j, (tokens, cost) in enumerate(zip(chunk_lengths(boundaries), costs)):
        lines.append(f"{j:>5}  {tokens:>6}  {cost:>10.4g}  {cost / total:>5.1%}")
    return "\n".join(lines)


def _baseline(p: int, m: int, costs: Costs, kept: float) -> SimResult | None:
    try:
        return simulate(generate(BASELINE, p, m, costs=costs), costs, kept_until_w=kept)
    except ValueError:  # the baseline cannot serve these p, m: ratios become '-'
        return None


def _simulate_header(schedule: Schedule, costs: Costs, kept: float) -> str:
    return (
        f"{schedule.name}: p={schedule.stages} m={schedule.micro_batches} v={schedule.chunks_per_rank} "
        f"k={schedule.seq_chunks}  (costs f={costs.f:g} b={costs.b:g} w={costs.w:g} comm={costs.comm:g}, "
        f"w_memory={costs.w_memory:g}, kept until W={kept:g})"
        + (f"; {schedule.params['fused_w']} units' W fill no bubble and run fused with their B (--fuse-idle-w)"
           if schedule.params.get("fused_w") else "")
        + (f"; ordered for these costs: {schedule.params['picked']}" if schedule.params.get("picked") else "")
    )


def _summary_table(result: SimResult, baseline: SimResult | None) -> str:
    rows = [
        ("makespan", result.makespan, baseline.makespan if baseline else None, "{:.2f}"),
        ("bubble rate", result.bubble_rate, baseline.bubble_rate if baseline else None, "{:.1%}"),
        ("peak memory (M_B, busiest rank)", result.max_peak_memory, baseline.max_peak_memory if baseline else None, "{:.2f}"),
    ]
    cells = [["", "this", BASELINE, "ratio"]]
    for label, value, ref, fmt in rows:
        ratio = "-" if not ref else f"{value / ref:.2f}x"
        cells.append([label, fmt.format(value), "-" if ref is None else fmt.format(ref), ratio])
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join(
        "  ".join([c[0].ljust(widths[0])] + [c[i].rjust(widths[i]) for i in range(1, 4)]).rstrip() for c in cells
    )


def _write_outputs(args: argparse.Namespace, result: SimResult, schedule: Schedule) -> None:
    if args.plot is not None:
        plot_timeline(result, schedule, args.plot)
        print(f"wrote plot to {args.plot}", file=sys.stderr)
    if args.trace is not None:
        trace = chrome_trace(result, schedule)
        trace["traceEvents"] += data_parallel_events(result, schedule)  # ZeRO's reduce and gather points
        args.trace.write_text(json.dumps(trace))
        print(f"wrote Chrome trace to {args.trace} (open it in https://ui.perfetto.dev)", file=sys.stderr)


def _cmd_compare(args: argparse.Namespace) -> int:
    costs = _costs(args)
    rows = compare_rows(
        args.stages,
        args.micro_batches,
        costs=costs,
        chunks=args.chunks,
        seq_chunks=args.seq_chunks,
        memory_limit=args.memory_limit,
        kept_until_w=_kept_until_w(args, costs),
    )
    print(format_table(rows, style=args.format))
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    headers = ["schedule", "v", "options", "zero", "aliases", "summary"]
    cells = [_list_cells(get_info(name)) for name in schedule_names()]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    for line in [headers, ["-" * w for w in widths]] + cells:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip())
    return 0


def _list_cells(info: GeneratorInfo) -> list[str]:
    chunks = str(info.fixed_chunks) if info.fixed_chunks is not None else "any (default 2)"
    flags = [
        ("--chunks", info.fixed_chunks is None),
        ("--seq-chunks", info.seq_chunks),
        ("--memory-limit", info.memory_limit),
        ("costs", info.uses_costs),
        ("split backward", info.split_backward),
    ]
    options = ", ".join(flag for flag, on in flags if on) or "-"
    zero = ",".join(str(z) for z in info.zero_stages)
    return [info.name, chunks, options, zero, ", ".join(info.aliases) or "-", info.summary]
