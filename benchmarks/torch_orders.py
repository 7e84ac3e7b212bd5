"""torch.distributed.pipelining's schedule orders as ds_vshape IR, so our simulator can time them.

``get_schedule_ops`` (torch's own visualiser helper) builds a schedule on mock stages and
returns each rank's action list. Mapping: F -> F, full backward -> BW, I -> B, W -> W.
DualPipeV's overlapped F+B pairs become the F then the B. One runtime detail is folded in: torch's first stage skips its I pass (its input needs no
gradient) and runs the whole backward at W, so there I is dropped and W becomes BW.
"""

from __future__ import annotations

from ds_vshape.schedules import Action, Kind, Schedule

__all__ = ["torch_schedule"]

_KIND = {"FORWARD": Kind.F, "FULL_BACKWARD": Kind.BW, "BACKWARD_INPUT": Kind.B, "BACKWARD_WEIGHT": Kind.W}


def torch_schedule(class_name: str, p: int, m: int) -> Schedule:
    from torch.distributed import pipelining
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = getattr(pipelining, class_name)
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    if single:
        # Schedule1F1B's pipeline_order is only a drawing (its last rank reads F1..F8 for
        # m=8); the runtime runs plain 1F1B, which is ours.
        from ds_vshape.schedules import generate

        return generate("1f1b", p, m)
    ops = get_schedule_ops(cls, p, m, num_stages_per_rank=1 if single else 2)
    v = 1 if single else 2
    owner: dict[int, int] = {}
    ranks = []
    for rank, actions in enumerate(ops):
        out = []
        flat = []
        for a in actions:
            if a is not None and a.sub_actions is not None:  # OVERLAP_F_B: its parts, in order
                flat.extend(a.sub_actions)
            elif a is not None and a.computation_type.name in _KIND:  # skips REDUCE_GRAD etc.
                flat.append(a)
        for a in flat:
            kind = _KIND[a.computation_type.name]
            stage, mb = a.stage_index, a.microbatch_index
            owner[stage] = rank
            if stage == 0 and kind is Kind.B:
                continue  # torch: the first stage's I is a no-op ...
            if stage == 0 and kind is Kind.W:
                kind = Kind.BW  # ... and its W runs the whole backward
            out.append(Action(kind, stage, mb))
        ranks.append(tuple(out))
    placement = tuple(owner[s] for s in range(p * v))
    return Schedule(f"torch-{class_name}", p, m, v, 1, placement, tuple(ranks))
