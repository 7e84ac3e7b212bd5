"""What a finished save recorded about its files, and the check of a tag against it.

A save lists every file of its tag directory (DeepSpeed's and ds_vshape's) with its size and
sha256 into the layout file, written last. The hashing is spread over the ranks (``shares``:
each file to one rank, largest first onto the least loaded), at the save and again at a load,
so each costs one read of the tag split over the job. ``MARKER`` sits in a tag directory from
the start of its save until the layout file is in place: a tag that has it (or ds_vshape's
optimizer files without a layout file) is a save that did not finish.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Mapping
from typing import Any

from .atomic import fsync_path, is_temp

__all__ = ["MARKER", "Entry", "list_files", "shares", "sha256_of", "record", "problems", "finished_tags",
           "sizes_match"]

MARKER = "vs_saving"
CHUNK = 1 << 20
Entry = dict[str, Any]  # {"size": bytes, "sha256": hex digest}


def list_files(ckpt_dir: str, skip: Collection[str] = ()) -> dict[str, int]:
    """Every regular file under ``ckpt_dir`` (relative, '/'-separated) -> its size; temporaries and ``skip`` left out."""
    sizes: dict[str, int] = {}
    for root, dirs, names in os.walk(ckpt_dir):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, ckpt_dir).replace(os.sep, "/")
            if rel in skip or name == MARKER or is_temp(name) or not os.path.isfile(path):
                continue
            sizes[rel] = os.path.getsize(path)
    return sizes


def shares(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """Split the files over ``world`` ranks by bytes; the same split on every rank for the same sizes."""
    loads = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        out[rank].append(name)
        loads[rank] += sizes[name]
    return [sorted(names) for names in out]


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record(ckpt_dir: str, name: str, *, sync: bool = False) -> Entry:
    """Size and sha256 of one file of the tag; ``sync`` also flushes it to the disk first."""
    path = os.path.join(ckpt_dir, name)
    if sync:
        fsync_path(path)
    return {"size": os.path.getsize(path), "sha256": sha256_of(path)}


def problems(ckpt_dir: str, files: Mapping[str, Entry], names: Collection[str]) -> list[str]:
    """What is wrong with each of ``names`` against the save's record ``files``; empty when all match."""
    found = []
    for name in sorted(names):
        want, path = files[name], os.path.join(ckpt_dir, name)
        try:
            size = os.path.getsize(path)
            if size != want["size"]:
                found.append(f"{name} has {size} bytes where the save wrote {want['size']} (cut off, or replaced)")
            elif sha256_of(path) != want["sha256"]:
                found.append(f"{name} differs from what the save wrote (same size, other sha256: damaged, or "
                             "another checkpoint's file)")
        except FileNotFoundError:
            found.append(f"{name} is missing (the save wrote {want['size']} bytes)")
        except OSError as err:
            found.append(f"{name} cannot be read ({err})")
    return found


def finished_tags(load_dir: str, layout_file: str) -> list[str]:
    """The tags under ``load_dir`` whose save finished (a layout file and no marker), newest first."""
    try:
        tags = os.listdir(load_dir)
    except OSError:
        return []
    done = []
    for tag in tags:
        path = os.path.join(load_dir, tag, layout_file)
        if os.path.isfile(path) and not os.path.exists(os.path.join(load_dir, tag, MARKER)):
            done.append((os.path.getmtime(path), tag))
    return [tag for _, tag in sorted(done, reverse=True)]


def sizes_match(ckpt_dir: str, files: Mapping[str, Entry]) -> bool:
    """Every recorded file is there with its recorded size (a stat each; no hashing)."""
    for name, entry in files.items():
        try:
            if os.path.getsize(os.path.join(ckpt_dir, name)) != entry["size"]:
                return False
        except OSError:
            return False
    return True
