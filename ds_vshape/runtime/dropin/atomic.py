"""Files that appear whole or not at all: written under a temporary name, fsynced, then renamed.

A process killed mid-write leaves at most a temporary file (``.NAME.vs_tmp.PID``) beside the
target; the target itself is either absent, the old file, or the complete new one. ``rename``
is atomic within a directory on POSIX file systems, and the directory is fsynced after it so
the new name survives a crash of the machine too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import IO, Any

import torch

__all__ = ["TEMP_MARK", "temp_path", "is_temp", "atomic_write", "write_text", "save_torch", "fsync_path", "fsync_dir"]

TEMP_MARK = ".vs_tmp."


def temp_path(path: str) -> str:
    """The temporary name ``path`` is written under first (hidden, this process's own)."""
    head, base = os.path.split(path)
    return os.path.join(head, f".{base}{TEMP_MARK}{os.getpid()}")


def is_temp(name: str) -> bool:
    """True for a temporary file a write left behind (its process died before the rename)."""
    return TEMP_MARK in os.path.basename(name)


def atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    """``write`` fills a temporary file; fsynced, it replaces ``path`` in one rename."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_text(path: str, text: str) -> None:
    atomic_write(path, lambda fh: fh.write(text.encode()))


def save_torch(obj: Any, path: str) -> None:
    """``torch.save`` of ``obj`` that never leaves a partial ``path``."""
    atomic_write(path, lambda fh: torch.save(obj, fh))


def fsync_path(path: str) -> None:
    """Flush a file another call wrote (DeepSpeed's own files) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make renames and removals in ``path`` durable; a no-op where the file system refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and platforms) cannot fsync a directory
    finally:
        os.close(fd)
