"""What activation offload cannot run with, and what it leaves on the device, checked and worded at
``initialize`` (before any engine exists)."""

from __future__ import annotations

from typing import Any

from ...schedules.offload import check_share

__all__ = ["check_offload_config", "offload_notes"]


def check_offload_config(config: dict[str, Any], *, share: float) -> None:
    """Refuse what offload cannot run with; raises ``ValueError`` naming the key to change."""
    check_share(share)
    if share > 0 and (config.get("activation_checkpointing") or {}).get("cpu_checkpointing"):
        raise ValueError("pipeline.offload cannot run with activation_checkpointing.cpu_checkpointing: both move the "
                         "checkpointed activations to host memory, DeepSpeed without overlap; set one of them off")


def offload_notes(share: float, *, checkpoint_interval: int, split_backward: bool) -> list[str]:
    """What offload leaves on the device in this setup, worded for the log."""
    if share <= 0:
        return []
    notes = []
    if split_backward:
        notes.append("pipeline.offload: what split backward keeps from B to W (weight GEMMs' inputs and output "
                     "gradients) goes to host for every unit whose W runs two or more passes after its B, inside the "
                     "share or not; where W follows B at once it stays on the device")
    if checkpoint_interval > 0:
        notes.append(f"pipeline.offload with activation_checkpoint_interval={checkpoint_interval}: DeepSpeed's "
                     "checkpoint keeps each checkpointed block's inputs itself, out of reach of offload; they stay on "
                     "the device, only layers outside checkpointed blocks are offloaded")
    return notes
