"""``"schedule": "auto"``: measure while a safe schedule runs, then switch to the fastest.

A named schedule with ``"pass_costs": "measure"`` runs here too, as auto with itself the only
candidate and its equal-cost order the measuring schedule: what it picks is its own order for
the measured costs.

The first ``warmup_steps`` calls of ``train_batch`` run the placement's safe schedule
(``schedules.auto.SAFE``). They time every F, B and W pass per stage (the device is
synchronised around each, the current stream only, so the figures are the passes' own), count the activation bytes
each F keeps, and note the largest activation message; the last of them runs plain and
times the whole step (see ``_times_passes``). After it the pipeline
ranks time a round trip of that message between neighbours, every rank's figures are
gathered, global rank 0 simulates every schedule of the placement with them
(``schedules.auto.pick``) and broadcasts its choice; every rank builds the chosen schedule
and runs it from the next step on: the engine swaps in its plan, as for a batch ramp-up. The log
states the choice and its predicted step time, and after the next step the measured one.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger as log

from ..schedules import Schedule, get_info
from ..schedules.auto import AutoSettings, Choice, Measured, choice_fits, make_chosen, pick
from .engine import VShapeEngine
from .program import instructions as ins
from .program.plan import Plan
from .step_end.failures import bounded_step

__all__ = ["AutoEngine"]

_ROUND_TRIPS = 3


def _times_passes(step: int, warmup_steps: int) -> bool:
    """Whether warm-up step ``step`` (1-based) times its passes. The last warm-up step runs
    plain, for a step time without the timing's synchronisation and hooks; the first pays
    one-time costs (allocator, first transfers) and is left out when there are three or more."""
    if warmup_steps == 1:
        return True
    return step < warmup_steps and not (step == 1 and warmup_steps >= 3)


def _now() -> float:
    """The clock, once the compute stream is idle (passes run asynchronously on a GPU).

    Only the current stream: a device-wide synchronize would also wait for every receive the
    rank has posted ahead, whose sender may need this rank's next pass (a deadlock under NCCL).
    The current stream waits only for receives a pass already needed."""
    stream = get_accelerator().current_stream()
    if stream is not None:  # DeepSpeed's CPU accelerator has no streams
        stream.synchronize()
    return time.perf_counter()


class AutoEngine(VShapeEngine):
    """A ``VShapeEngine`` that starts with a safe schedule and picks the fastest after measuring."""

    def __init__(self, *args: Any, plan: Plan, **kwargs: Any) -> None:
        """``plan``: made for ``"schedule": "auto"`` or ``"pass_costs": "measure"`` (its ``auto`` settings set); its
        schedule is the one run while measuring."""
        if plan.auto is None:  # before DeepSpeed builds anything
            raise ValueError("AutoEngine needs a plan that measures (\"schedule\": \"auto\" or \"pass_costs\": \"measure\"; "
                             "plan.auto is None)")
        super().__init__(*args, plan=plan, **kwargs)
        self.auto_choice: Choice | None = None  # set on every rank once chosen
        self.auto_measured: Measured | None = None  # rank 0's merged figures
        self.auto_step_s: float | None = None  # a step under the chosen schedule, this rank's wall time (see train_batch)
        self._auto_steps = 0
        self._auto_recording = False
        self._auto_times: dict[tuple[str, int], list[float]] = defaultdict(list)
        self._auto_bytes: dict[int, list[int]] = defaultdict(list)
        self._auto_message = 0
        self._auto_step_time = 0.0
        self._auto_chosen_steps = 0

    @property
    def auto(self) -> AutoSettings:
        """What auto chooses from and within (its plan's; the same in every plan it swaps in)."""
        assert self._plan.auto is not None  # refused in __init__ otherwise
        return self._plan.auto

    def train_batch(self, *args: Any, **kwargs: Any) -> Any:
        step, choosing = self._auto_steps + 1, self.auto_choice is None
        self._auto_recording = choosing and _times_passes(step, self.auto.warmup_steps)
        keep = self.measure_memory
        self.measure_memory = keep or self._auto_recording  # the saved-tensor hooks count each F's bytes
        start = _now()
        try:
            loss = super().train_batch(*args, **kwargs)
        finally:
            self.measure_memory, self._auto_recording = keep, False
        elapsed = _now() - start
        self._auto_steps = step
        if choosing and step == self.auto.warmup_steps:
            self._auto_step_time = elapsed
            with bounded_step(self, "choice"):  # a peer that died here fails every survivor within p2p_timeout_s, named
                self._choose()
        elif not choosing and self.auto_step_s is None:
            self._chosen_step(elapsed)
        return loss

    def _chosen_step(self, elapsed: float) -> None:
        # The first step under the new schedule lowers it (once per schedule): the second is typical.
        self._auto_chosen_steps += 1
        if self._auto_chosen_steps < 2:
            return
        self.auto_step_s = elapsed
        if dist.get_rank() == 0 and self.auto_choice is not None:
            log.info("ds_vshape auto: %s measured step %.2f ms (predicted %.2f ms)", self.auto_choice.name,
                     elapsed * 1e3, self.auto_choice.predicted_s * 1e3)

    # ---- measuring ------------------------------------------------------------------------
    def _timed(self, kind: str, handler: Any, kwargs: dict[str, Any]) -> None:
        if not self._auto_recording:
            handler(self, **kwargs)
            return
        before = self._meter.saved_bytes  # where they live: offloaded bytes are the forward's too
        start = _now()
        handler(self, **kwargs)
        self._auto_times[(kind, kwargs["stage"])].append(_now() - start)
        if kind == "F":
            self._auto_bytes[kwargs["stage"]].append(self._meter.saved_bytes - before)

    def _exec_send_act(self, **kwargs: Any) -> None:  # type: ignore[override]
        if self._auto_recording:
            sent = self._act_in[(kwargs["stage"], kwargs["micro_batch"], kwargs["seq_chunk"])]
            tensors = sent if isinstance(sent, (tuple, list)) else (sent,)
            self._auto_message = max(self._auto_message, sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)))
        VShapeEngine._INSTRUCTION_MAP[ins.SendActivation](self, **kwargs)

    def _hop_seconds(self, nbytes: int) -> float:
        """Half the median round trip of an ``nbytes`` message to the next pipeline rank (0 on the last).

        Pairs (r, r+1) go in two phases, even r first, so no rank is in two exchanges at once.
        """
        buf = torch.zeros(max(nbytes, 4) // 4, dtype=torch.float32, device=self.device)
        peer = lambda r: self.grid.stage_to_global(stage_id=r)  # noqa: E731
        mine = 0.0
        for phase in (0, 1):
            for r in range(phase, self.num_stages - 1, 2):
                if self.stage_id not in (r, r + 1):
                    continue
                trips = []
                for _ in range(_ROUND_TRIPS):
                    start = _now()
                    if self.stage_id == r:
                        dist.send(buf, peer(r + 1))
                        dist.recv(buf, peer(r + 1))
                    else:
                        dist.recv(buf, peer(r))
                        dist.send(buf, peer(r))
                    trips.append(_now() - start)
                if self.stage_id == r:
                    mine = statistics.median(trips) / 2
        return mine

    def _copy_seconds_per_byte(self, samples: list[int]) -> float:
        """One way between device and host memory (pinned on CUDA): half the median round trip of one
        forward's activation bytes, per byte (0 when nothing was measured)."""
        nbytes = int(statistics.median(samples)) if samples else 0
        if nbytes <= 0:
            return 0.0
        device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        trips = []
        for _ in range(_ROUND_TRIPS):
            start = _now()
            host.copy_(device, non_blocking=True)
            device.copy_(host, non_blocking=True)
            trips.append(_now() - start)
        return statistics.median(trips) / 2 / nbytes

    # ---- choosing -------------------------------------------------------------------------
    def _choose(self) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        largest = torch.tensor([float(self._auto_message)], dtype=torch.float64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # both ends of every hop time the same message
        hop = self._hop_seconds(int(largest.item()))
        local = {"times": dict(self._auto_times), "bytes": dict(self._auto_bytes), "hop": hop,
                 "step": self._auto_step_time, "copy": self._copy_seconds_per_byte([n for v in self._auto_bytes.values() for n in v])}
        dist.all_gather_object(gathered, local)
        box: list[Any] = [None]
        if dist.get_rank() == 0:  # one rank decides; every rank builds the same schedule from it
            try:
                measured = _merge(gathered, self.num_model_stages, seq_chunks=self.schedule.seq_chunks)
                self.auto_measured = measured
                box[0] = (pick(self.auto, measured, stages=self.num_stages, micro_batches=self.micro_batches), None)
                _log_choice(measured, box[0][0], self.auto)
            except ValueError as err:  # sent on, so that no rank waits for a choice that never comes
                box[0] = (None, str(err))
        dist.broadcast_object_list(box, src=0, device=self.device if dist.get_backend() == "nccl" else None)
        choice, error = box[0]
        if error is not None:
            raise ValueError(f"rank {dist.get_rank()}: {self.auto.label} could not choose: {error}")
        self._install(choice)
        self._auto_times.clear()
        self._auto_bytes.clear()

    def resume_choice(self, choice: Choice) -> bool:
        """Run ``choice``, restored from a checkpoint, where this job's settings could have made it (``choice_fits``);
        else measure again (its config names other candidates, another limit or share). Every rank decides alike."""
        if not choice_fits(choice, self.auto, stages=self.num_stages, micro_batches=self.micro_batches):
            if dist.get_rank() == 0:
                log.warning("ds_vshape: the checkpoint's choice %s is not one %s could make here (other candidates, "
                            "memory limit, w_memory or offload share); measuring again", choice.name, self.auto.label)
            return False
        self._install(choice)
        return True

    def _install(self, choice: Choice) -> None:
        """Swap in the plan of ``choice`` (every rank has the same); a later batch ramp-up remakes the
        chosen schedule, not the safe one."""
        def remake(micro_batches: int) -> Schedule:
            return make_chosen(choice, self.auto, stages=self.num_stages, micro_batches=micro_batches)

        self._swap_plan(self._plan.switched(remake, micro_batches=self.micro_batches))
        self._offload.set_share(choice.offload)
        self.auto_choice = choice

    _INSTRUCTION_MAP = {
        **VShapeEngine._INSTRUCTION_MAP,
        # Each compute pass through _timed (one closure per instruction, bound to its kind and handler).
        **{cls: (lambda kind, handler: lambda self, **kw: self._timed(kind, handler, kw))(kind, VShapeEngine._INSTRUCTION_MAP[cls])
           for cls, kind in ((ins.ForwardPass, "F"), (ins.BackwardInput, "B"), (ins.BackwardWeight, "W"), (ins.FusedBackward, "BW"))},
        ins.SendActivation: _exec_send_act,
    }


def _merge(gathered: list[dict[str, Any]], stages: int, *, seq_chunks: int) -> Measured:
    """Per stage, medians over every rank's samples (data-parallel replicas pooled), per micro-batch.

    A stage whose backward always ran fused gets B and W in the ratio the other stages showed
    (half each when none showed one).
    """
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    nbytes: dict[int, list[int]] = defaultdict(list)
    for g in gathered:
        for key, values in g["times"].items():
            times[key] += values
        for stage, values in g["bytes"].items():
            nbytes[stage] += values
    med = {key: statistics.median(v) * seq_chunks for key, v in times.items()}  # a unit is 1/k of a micro-batch
    split = [(med[("B", s)], med[("W", s)]) for s in range(stages) if ("B", s) in med and ("W", s) in med]
    b_share = sum(b for b, _ in split) / sum(b + w for b, w in split) if split and sum(b + w for b, w in split) > 0 else 0.5
    f, b, w = [], [], []
    for s in range(stages):
        f.append(med.get(("F", s), 0.0))
        fused = med.get(("BW", s), med.get(("B", s), 0.0) + med.get(("W", s), 0.0))
        b.append(med.get(("B", s), fused * b_share))
        w.append(med.get(("W", s), fused - b[-1] if ("B", s) in med else fused * (1 - b_share)))
    act = tuple(statistics.median(nbytes[s]) * seq_chunks if nbytes.get(s) else 0.0 for s in range(stages))
    hops = [g["hop"] for g in gathered if g["hop"] > 0]
    step = max(g["step"] for g in gathered)  # the step ends when its slowest rank does
    copies = [g.get("copy", 0.0) for g in gathered if g.get("copy", 0.0) > 0]
    return Measured(tuple(f), tuple(b), tuple(w), act, comm=statistics.median(hops) if hops else 0.0, step=step,
                    copy=statistics.median(copies) if copies else 0.0)


def _log_choice(measured: Measured, choice: Choice, settings: AutoSettings) -> None:
    ms = lambda xs: "[" + ", ".join(f"{x * 1e3:.2f}" for x in xs) + "]"  # noqa: E731
    log.info("ds_vshape auto: measured under %s per stage T_F %s T_B %s T_W %s ms, activation %s MiB, hop %.3f ms",
             settings.safe, ms(measured.f), ms(measured.b), ms(measured.w),
             [round(a / 2**20, 3) for a in measured.activation_bytes], measured.comm * 1e3)
    fitting = [c for c in choice.table if c.fits]
    if not fitting:
        log.warning("ds_vshape auto: no candidate of %s fits the memory limit; running the one with the least memory",
                    settings.label)
    log.info("ds_vshape auto: picked %s", choice.summary())
    if not get_info(choice.name).uses_costs:
        return
    c = choice.costs  # per rank (all its chunks), as pipeline.pass_costs counts them; stage imbalance aside
    log.info("ds_vshape auto: as config, in ms: \"pass_costs\": {\"f\": %.4g, \"b\": %.4g, \"w\": %.4g, \"comm\": %.4g}",
             c.f * 1e3, c.b * 1e3, c.w * 1e3, c.comm * 1e3)
