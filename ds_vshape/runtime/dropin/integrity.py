"""A load's first step: the tag's files against what its save recorded, refused on every rank at once.

Each rank reads the layout file and checks its share of the tag's files (size, then sha256;
``manifest.shares``), then the ranks exchange what they found: a save that did not finish, a
cut-off, damaged or foreign file, a missing rank's file, a layout file of another version. If
any rank found something, every rank raises the same ``CheckpointError`` naming the files and
what is wrong, before DeepSpeed's loader (or any step) reads anything.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from .layout_file import LAYOUT_FILE, CheckpointError, Layout, read_layout
from .manifest import finished_tags, problems, shares, sizes_match

__all__ = ["checked_layout", "tag_problems", "intact_tag", "fix_for"]

SHOWN = 8  # problems named in one error; the rest are counted


def tag_problems(ckpt_dir: str, *, rank: int, world: int) -> tuple[Layout | None, list[str]]:
    """The tag's layout (None: not a pipeline checkpoint) and what this rank finds wrong with its share."""
    try:
        saved = read_layout(ckpt_dir)
    except CheckpointError as err:
        return None, [str(err).removeprefix(f"{ckpt_dir}: ")]  # the refusal names the directory once
    if saved is None or saved.files is None:
        return saved, []  # stock DeepSpeed, or a save that did not record its files (format 1)
    mine = shares({name: entry["size"] for name, entry in saved.files.items()}, world)[rank]
    return saved, problems(ckpt_dir, saved.files, mine)


def intact_tag(load_dir: str, *, but: str) -> str | None:
    """The newest other tag whose save finished and whose files have the recorded sizes (stats only)."""
    for tag in finished_tags(load_dir, LAYOUT_FILE):
        ckpt_dir = os.path.join(load_dir, tag)
        try:
            saved = read_layout(ckpt_dir) if tag != but else None
        except CheckpointError:
            continue
        if saved is not None and (saved.files is None or sizes_match(ckpt_dir, saved.files)):
            return tag
    return None


def fix_for(load_dir: str, tag: str) -> str:
    """What to do instead: load the newest other intact-looking tag, or copy this one again."""
    other = intact_tag(load_dir, but=tag)
    again = f"copy the directory of tag {tag!r} again, whole, from where it was saved"
    if other is None:
        return f"No other tag in {load_dir} finished its save: {again}, or start without this checkpoint"
    latest = os.path.join(load_dir, "latest")
    return (f"Load the newest other tag whose save finished, {other!r} (load_checkpoint({load_dir!r}, tag={other!r}), "
            f"or write {other} into {latest}), or {again}")


def checked_layout(load_dir: str, tag: str) -> Layout | None:
    """``read_layout`` of the tag once every rank has checked its share of the files; else raise on all ranks."""
    ckpt_dir = os.path.join(load_dir, tag)
    rank, world = dist.get_rank(), dist.get_world_size()
    saved, found = tag_problems(ckpt_dir, rank=rank, world=world)
    everyone: list[list[str] | None] = [None] * world
    dist.all_gather_object(everyone, found)
    union = list(dict.fromkeys(p for ps in everyone for p in ps or []))
    if union:
        more = f" (and {len(union) - SHOWN} more)" if len(union) > SHOWN else ""
        raise CheckpointError(f"rank {rank}: checkpoint {ckpt_dir} cannot be loaded: {'; '.join(union[:SHOWN])}{more}. "
                              f"Nothing was loaded, on any rank. {fix_for(load_dir, tag)}")
    return saved
