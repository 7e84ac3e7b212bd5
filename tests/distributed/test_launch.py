"""The launcher's own guarantees: a timed-out launch leaves no process behind, a dead build's lock is cleared.

torchrun starts each rank in a session of its own, as the command below starts its child: a
timeout that killed only the command left that child running (holding the cores, or a build
lock every later rank waits on), and every later launch of the session timed out behind it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .deepspeed_ops import EXTENSIONS_ENV, clear_stale_locks, extensions_dir
from .launch import FORK_ENV, SPAWN, launch, process_alive, run_ranks

pytestmark = pytest.mark.distributed

# A parent that starts a child in a new session (as torchrun starts ranks), prints its pid, then waits.
_PARENT = ("import subprocess, sys, time; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
           "print(child.pid, flush=True); time.sleep(600)")


def test_a_timed_out_launch_ends_the_processes_it_started_in_sessions_of_their_own() -> None:
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_ranks([sys.executable, "-c", _PARENT], env=dict(os.environ), timeout=3)
    child = int(err.value.stdout.split()[0])  # the output so far comes with the timeout
    assert not process_alive(child) or _zombie(child), f"the child {child} outlived the timed-out launch"
    assert time.monotonic() - started < 60


def test_a_finished_launch_returns_its_output_and_status() -> None:
    proc = run_ranks([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], env=dict(os.environ), timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (3, "out")


def test_ranks_waiting_on_a_build_lock_time_out_naming_it_and_leave_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last CI's hang, made on purpose: the session's built op with a lock beside it, as a rank
    killed in its build leaves it. The launch times out; the log shows each rank's stack (SIGTERM
    makes every rank print it, whenever its imports finished), and no rank is left running."""
    folder = tmp_path / "extensions"
    shutil.copytree(extensions_dir(), folder)
    for lock in (*folder.glob("*/lock"), *folder.glob("*/*/lock")):
        lock.unlink()
    (folder / "deepspeed_shm_comm").mkdir(exist_ok=True)
    (folder / "deepspeed_shm_comm" / "lock").touch()
    monkeypatch.setenv(EXTENSIONS_ENV, str(folder))
    monkeypatch.setenv(FORK_ENV, "0")  # every rank its own interpreter: each prints its stack, however far its imports got
    with pytest.raises(RuntimeError, match="ranks timed out after 20 s") as err:
        launch([{"name": "waits", "p": 2, "m": 2, "schedule": "1f1b"}], 2, tmp_path / "launch", timeout=20)
    # One stack per rank, its main thread's bottom frame the worker's module: on a loaded machine a rank
    # may still be importing at the timeout, otherwise it waits on the lock (file_baton, in build_shm_op).
    stacks = re.findall(r'tests/distributed/worker\.py", line \d+ in <module>', str(err.value))
    assert len(stacks) >= 2, str(err.value)[-3000:]
    # This launch's ranks name its folder on their command line. process_iter's attributes read a
    # process that ends meanwhile as None instead of raising.
    workdir = str(tmp_path / "launch")
    left = [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] not in (None, psutil.STATUS_ZOMBIE) and any(workdir in a for a in p.info["cmdline"] or ())]
    assert not left, f"ranks outlived the timed-out launch: {left}"


# A rank of spawn.py: prints what it was given (and whether it found json imported); rank 0 then says so
# in a file and would wait 600 s, rank 1 waits for that file and fails.
_RANK = r"""import os, sys, time
names = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')
row = [str(os.getpid()), *(os.environ[n] for n in names), str('json' in sys.modules)]
os.write(1, (' '.join(row) + '\n').encode())  # one write: the ranks share the pipe
ready = sys.argv[1]
if os.environ['RANK'] == '0':
    open(ready, 'w').close()
    time.sleep(600)
while not os.path.exists(ready):
    time.sleep(0.01)
sys.exit(3)
"""


@pytest.mark.parametrize("preload", ["", "json,no_such_module_here"], ids=["processes", "forked"])
def test_spawn_gives_each_rank_torchruns_variables_and_ends_the_others_when_one_fails(tmp_path: Path, preload: str) -> None:
    """The test launches' launcher: one rank failing ends the job (as under torchrun), naming it; nothing is left.
    With ``--preload`` the ranks are forked after its imports (a module missing is skipped) and find them done."""
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    cmd = [sys.executable, str(SPAWN), "--nproc=2", "--port=29123", f"--preload={preload}", str(script), str(tmp_path / "ready")]
    proc = run_ranks(cmd, env=dict(os.environ), timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 exited with status 3" in proc.stderr
    rows = sorted((line.split() for line in proc.stdout.splitlines()), key=lambda row: row[1])
    loaded = str(bool(preload))
    assert [row[1:] for row in rows] == [["0", "0", "2", "2", "127.0.0.1", "29123", loaded],
                                         ["1", "1", "2", "2", "127.0.0.1", "29123", loaded]]
    assert not any(process_alive(int(row[0])) and not _zombie(int(row[0])) for row in rows), rows


def test_a_forked_rank_that_raises_fails_the_job_with_its_traceback(tmp_path: Path) -> None:
    """A forked rank's uncaught exception is printed as the interpreter would and fails the job (status 1)."""
    script = tmp_path / "rank.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank 1 gives up')\n")
    cmd = [sys.executable, str(SPAWN), "--nproc=2", "--port=29124", "--preload=json", str(script)]
    proc = run_ranks(cmd, env=dict(os.environ), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "ValueError: rank 1 gives up" in proc.stderr and "rank 1 exited with status 1" in proc.stderr


def test_only_a_lock_no_build_touched_for_long_is_cleared(tmp_path: Path) -> None:
    old, fresh = tmp_path / "old_op" / "lock", tmp_path / "fresh_op" / "lock"
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    with pytest.warns(UserWarning, match="left by a killed process"):
        assert clear_stale_locks(tmp_path, older_than_s=900) == [old]
    assert not old.exists() and fresh.exists()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return False
