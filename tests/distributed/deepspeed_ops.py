"""DeepSpeed's CPU communication op, built once per test session before any rank starts.

Every rank's ``deepspeed.init_distributed`` loads DeepSpeed's shared-memory op (``deepspeed/comm/
torch.py``'s ``build_shm_op``). The first load on a machine compiles it (a minute or more on two
cores); every load takes the build folder's lock file for a moment, and a rank that finds it taken
waits until it is gone. Compiled inside a launch, the build ate into that launch's timeout, and a
rank killed while holding the lock (a timed-out launch) left it behind: every rank of every later
launch then waited on it forever, and the suite ran out its time with nothing but timeouts.

So the session builds the op once, first, through DeepSpeed's own op builder (the same flags as
the ranks', so they find it built), in a folder of this virtual environment's own, clearing a
lock no build has touched for ``STALE_LOCK_S``; a build that fails or hangs fails the session's
distributed tests at once, naming the op and the folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from .launch import run_ranks

__all__ = ["BUILD_TIMEOUT_S", "STALE_LOCK_S", "build_shm_op", "extensions_dir"]

EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
BUILD_TIMEOUT_S = 900
STALE_LOCK_S = 900  # far beyond a build: a lock this old was left by a killed process
_BUILD = ("from deepspeed.accelerator import get_accelerator; "
          "builder = get_accelerator().create_op_builder('ShareMemCommBuilder'); "
          "builder.load(verbose=False); print(builder.absolute_name())")


def extensions_dir() -> Path:
    """Where the ranks' JIT-built ops live: ``$TORCH_EXTENSIONS_DIR``, or a folder of this venv's own.

    A folder per virtual environment, because a build's flags name the DeepSpeed install it came
    from: two checkouts with their own venvs sharing torch's default folder rebuild it in turn.
    Sets the variable in this process's environment, which every launch passes on.
    """
    os.environ.setdefault(EXTENSIONS_ENV, str(Path(sys.prefix) / "torch_extensions"))
    return Path(os.environ[EXTENSIONS_ENV])


def clear_stale_locks(folder: Path, *, older_than_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove build locks in ``folder`` (torch's ``<op>/lock``) untouched for ``older_than_s``; returns them."""
    now = time.time()
    stale = [lock for lock in folder.glob("*/lock") if now - lock.stat().st_mtime > older_than_s]
    for lock in stale:
        warnings.warn(f"removing {lock}: a build lock untouched for over {older_than_s:.0f} s, left by a "
                      "killed process (every rank loading that op would wait on it forever)", stacklevel=2)
        lock.unlink(missing_ok=True)
    return stale


def build_shm_op(*, timeout: float = BUILD_TIMEOUT_S) -> None:
    """Build (or find built) DeepSpeed's shared-memory op as the ranks will load it; raise naming the folder."""
    folder = extensions_dir()
    folder.mkdir(parents=True, exist_ok=True)
    clear_stale_locks(folder)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    try:
        proc = run_ranks([sys.executable, "-c", _BUILD], env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"DeepSpeed's shm op did not build within {timeout:.0f} s in {folder} "
                           f"({EXTENSIONS_ENV}); its output:\n{err.stdout}{err.stderr}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"DeepSpeed's shm op failed to build in {folder} ({EXTENSIONS_ENV}), exit "
                           f"{proc.returncode}; its output:\n{(proc.stdout + proc.stderr)[-4000:]}")
