"""What the benches and their reports share: the JSONL record, a case run on every rank, the
rank-0 status line, the commit and machine measured, and table cells.

Benches import these from here, never a private name from each other. torch.distributed is
imported inside the functions that need it, so the reports (which read JSONL on a laptop)
import this module without torch.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "ROOT", "append_jsonl", "cell", "case_status", "cpu_model", "git_commit", "machine_brief", "machine_info", "recorded_commit",
    "record_case", "release_groups", "run_everywhere",
]

ROOT = Path(__file__).resolve().parents[1]


# ---- records ---------------------------------------------------------------------------------
def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    """One JSON line appended to ``path`` (rank 0's record of a case or a setting)."""
    with path.open("a") as fh:
        fh.write(json.dumps(obj) + "\n")


def case_status(gathered: list[dict[str, Any]], step: Callable[[float], str], *, error_chars: int = 200) -> str:
    """A case's status: the first rank's error, cut to ``error_chars``, else ``step`` of rank 0's median step time (s)."""
    errors = [g["error"] for g in gathered if "error" in g]
    if errors:
        return "ERROR " + errors[0][:error_chars]
    return step(statistics.median(s["step_s"] for s in gathered[0]["steps"]))


def record_case(path: Path, record: dict[str, Any], gathered: list[dict[str, Any]], step: Callable[[float], str], *,
                error_chars: int = 200) -> str:
    """Rank 0's part of a case: append its record to ``path``, return its status (``case_status``)."""
    append_jsonl(path, record)
    return case_status(gathered, step, error_chars=error_chars)


# ---- a case on every rank --------------------------------------------------------------------
def _process_groups() -> set[Any]:
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map)


def release_groups(before: set[Any]) -> int:
    """Destroy the process groups a case created (DeepSpeed makes ~10 per engine).

    Each gloo group keeps threads, and they are not free: with a few dozen engines'
    worth alive in one process, later cases ran up to 2x slower. Every rank calls this
    after the case's final collective.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    new = [pg for pg in _process_groups() - before if pg is not distributed_c10d.GroupMember.WORLD]
    for pg in new:
        dist.destroy_process_group(pg)
    return len(new)


def run_everywhere(case: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """Run one case on every rank and return every rank's result. An exception is recorded as
    the rank's result (so the other cases still run); the process groups the case made are
    released after the final collective."""
    import torch.distributed as dist

    groups = _process_groups()
    try:
        mine = case()
    except Exception as err:  # recorded so the other cases still run
        mine = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    gc.collect()
    dist.barrier()
    release_groups(groups)
    gc.collect()
    return gathered


# ---- what was measured, and where ------------------------------------------------------------
def git_commit(dirty_note: str = " (ds_vshape/ had uncommitted changes)") -> str:
    """HEAD's short hash, with ``dirty_note`` when ds_vshape/ has uncommitted changes; "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ds_vshape"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (dirty_note if dirty else "")


def recorded_commit(raw: Path) -> str:
    """The commit measured: the one ``run.sh`` recorded in ``raw/commit.txt`` when the run started; else HEAD now."""
    recorded = raw / "commit.txt"
    if recorded.exists():
        words = recorded.read_text().split()
        if words:
            return words[0] + (" (ds_vshape/ had uncommitted changes)" if "dirty" in words[1:] else "")
    return git_commit(" (ds_vshape/ has uncommitted changes)")


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo; None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info(raw: Path) -> dict[str, Any]:
    """The machine, versions, commit (``recorded_commit``) and the load files ``run.sh`` left in ``raw``."""
    import deepspeed
    import torch
    import transformers

    load = {f.stem[5:]: f.read_text().strip() for f in sorted(raw.glob("load_*.txt"))}
    return {
        "cpu": cpu_model() or "unknown", "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "commit": recorded_commit(raw), "load": load,
    }


def machine_brief() -> dict[str, Any]:
    """Python, platform, CPU model (when /proc says), cores, and torch's and DeepSpeed's versions (when installed)."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    cpu = cpu_model()
    if cpu is not None:
        info["cpu"] = cpu
    info["cores"] = os.cpu_count()
    try:
        import deepspeed
        import torch

        info["torch"], info["deepspeed"] = torch.__version__, deepspeed.__version__
    except ImportError:
        pass
    return info


# ---- tables ----------------------------------------------------------------------------------
def cell(x: Any, fmt: str, missing: str = "-") -> str:
    """``x`` formatted for a markdown table cell; ``missing`` where there is no figure."""
    return missing if x is None else format(x, fmt)
