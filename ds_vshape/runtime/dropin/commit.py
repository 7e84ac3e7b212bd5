"""Atomic saves: a tag becomes loadable, and ``latest``, only once every rank's files of it are complete.

``AtomicSaveMixin.save_checkpoint`` wraps DeepSpeed's:

1. ``begin``: the directory's writer puts the marker ``vs_saving`` into the tag directory (and
   drops the layout file of an earlier save of the same tag); barrier. From here until step 3
   the tag reads as a save that did not finish.
2. DeepSpeed's save with ``save_latest=False`` (ds_vshape's own files are written under a
   temporary name, fsynced and renamed: ``atomic``); it ends with a barrier.
3. ``commit``: barrier; every rank flushes and hashes its share of the tag's files; global rank
   0 writes the layout file with that record (atomically, last) and removes the marker;
   barrier; global rank 0, the rank DeepSpeed writes ``latest`` on, replaces ``latest``
   atomically; barrier.

A process killed anywhere in this leaves ``latest`` naming the previous tag, whose files are
untouched. Saving again under the tag ``latest`` names gives that tag up until its save ends.
With node-local storage each node's local rank 0 writes its directory's layout, without the
file record (each node sees only its own files). A decoupled (asynchronous) checkpoint engine
commits DeepSpeed's files later, on its own: its saves keep DeepSpeed's ``latest`` and record
no files.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from .atomic import fsync_dir, is_temp, write_text
from .layout_file import LAYOUT_FILE, layout_of
from .manifest import MARKER, Entry, list_files, record, shares

__all__ = ["AtomicSaveMixin", "begin", "commit", "record_files"]


class AtomicSaveMixin:
    """DeepSpeed's ``save_checkpoint``, made atomic across ranks (see the module)."""

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Any = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        engine: Any = self
        tag = str(f"global_step{engine.global_steps}" if tag is None else tag)  # DeepSpeed's default tag
        save = super().save_checkpoint  # type: ignore[misc]
        if _decoupled(engine):
            save(save_dir, tag, client_state or {}, save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
            _write_layout(engine, os.path.join(save_dir, tag), files=None)
            dist.barrier()
            return True
        begin(engine, save_dir, tag)
        save(save_dir, tag, client_state or {}, save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
        commit(engine, save_dir, tag, save_latest=save_latest)
        return True


def _decoupled(engine: Any) -> bool:
    return bool(getattr(engine.checkpoint_engine, "is_decoupled", lambda: False)())


def _node_local(engine: Any) -> bool:
    return bool(engine.use_node_local_storage())


def _writes_dir(engine: Any) -> bool:
    """The rank that writes a tag directory's marker and layout: DeepSpeed's directory maker."""
    return (engine.local_rank if _node_local(engine) else engine.global_rank) == 0


def begin(engine: Any, save_dir: str, tag: str) -> None:
    """Mark the tag as being saved before any rank writes a file of it."""
    if _writes_dir(engine):
        ckpt_dir = os.path.join(save_dir, tag)
        os.makedirs(ckpt_dir, exist_ok=True)
        write_text(os.path.join(ckpt_dir, MARKER), f"ds_vshape: the save of tag {tag} has not finished\n")
        stale = [LAYOUT_FILE] + [n for n in os.listdir(ckpt_dir) if is_temp(n)]  # an earlier save's, or a killed one's
        for name in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(ckpt_dir, name))
        fsync_dir(ckpt_dir)
    dist.barrier()


def record_files(ckpt_dir: str) -> dict[str, Entry]:
    """Every file of the tag with its size and sha256, each flushed and hashed by one rank; on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing: list[Any] = [list_files(ckpt_dir, skip={LAYOUT_FILE}) if rank == 0 else None]
    dist.broadcast_object_list(listing, src=0)
    mine = {name: record(ckpt_dir, name, sync=True) for name in shares(listing[0], world)[rank]}
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    merged = {name: entry for part in parts for name, entry in part.items()}
    return dict(sorted(merged.items()))


def _write_layout(engine: Any, ckpt_dir: str, *, files: dict[str, Entry] | None) -> None:
    if _writes_dir(engine):
        write_text(os.path.join(ckpt_dir, LAYOUT_FILE), replace(layout_of(engine), files=files).to_json())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(ckpt_dir, MARKER))
        fsync_dir(ckpt_dir)


def commit(engine: Any, save_dir: str, tag: str, *, save_latest: bool) -> None:
    """Record the tag's files, write its layout file last, then point ``latest`` at it."""
    ckpt_dir = os.path.join(save_dir, tag)
    dist.barrier()  # every rank's files of the tag are complete
    files = None if _node_local(engine) else record_files(ckpt_dir)
    _write_layout(engine, ckpt_dir, files=files)
    dist.barrier()  # the layout file is in place on every directory: the tag is complete
    if save_latest and engine.global_rank == 0:
        write_text(os.path.join(save_dir, "latest"), tag)
    dist.barrier()
