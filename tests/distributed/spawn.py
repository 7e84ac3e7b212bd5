"""Start N ranks of a script on this machine as torchrun does, without torchrun's agent.

    python tests/distributed/spawn.py --nproc 4 --port 29500 worker.py ARGS...

Each rank gets the environment torchrun's static rendezvous gives a single-node job (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``deepspeed.init_distributed`` takes the
``env://`` path and rank 0 hosts the store, as it does under torchrun. What it leaves out is the
agent: torchrun imports torch and sets up its elastic agent and store before the first rank
starts, and takes its time to tear them down after the last one ends, seconds that every test
launch paid on top of cases that often take no longer. The ranks share this process's stdout
and stderr. As under torchrun, the first rank to fail ends the others (SIGTERM, then SIGKILL
after a grace period) and the exit status is non-zero, with a line naming that rank.

It imports nothing beyond the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

__all__ = ["main", "rank_env"]

GRACE_S = 10.0  # how long the other ranks get to end on SIGTERM after one failed
POLL_S = 0.02


def rank_env(base: dict[str, str], *, rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of a single-node job of ``nproc`` ranks."""
    env = dict(base)
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("GROUP_RANK", 0), ("ROLE_RANK", rank),
                        ("WORLD_SIZE", nproc), ("LOCAL_WORLD_SIZE", nproc), ("ROLE_WORLD_SIZE", nproc),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
        env[name] = str(value)
    return env


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every rank still running, SIGKILL to those left after ``GRACE_S``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(procs: list[subprocess.Popen[bytes]]) -> int:
    """0 once every rank ended well; else the first failure's status, after ending the rest."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"spawn.py: rank {rank} exited with status {code}; ending the other ranks", file=sys.stderr, flush=True)
            _end(procs)
            return code if code > 0 else 128 - code  # killed by a signal: the shell's convention
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start")
    parser.add_argument("--port", type=int, required=True, help="MASTER_PORT: rank 0 hosts the store there")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    procs = [subprocess.Popen([sys.executable, args.script, *args.args],
                              env=rank_env(dict(os.environ), rank=rank, nproc=args.nproc, port=args.port))
             for rank in range(args.nproc)]
    # Ended from outside (launch.py's timeout ends the whole tree too): take the ranks along.
    signal.signal(signal.SIGTERM, lambda *_: (_end(procs), sys.exit(128 + signal.SIGTERM)))
    return _wait(procs)


if __name__ == "__main__":
    raise SystemExit(main())
