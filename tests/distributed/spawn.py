"""Start N ranks of a script on this machine with torchrun's environment, without torchrun's agent.

    python tests/distributed/spawn.py --nproc 4 --port 29500 worker.py ARGS...

Each rank gets the variables torchrun gives a single-node job's worker (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT`` and the ``TORCHELASTIC_*``
run id and restart counts), so ``deepspeed.init_distributed`` takes the ``env://`` path. One
difference: under torchrun its agent hosts the rendezvous store and every rank is a client
(``TORCHELASTIC_USE_AGENT_STORE``); here rank 0 hosts it, as in a job started without torchrun.
What this leaves out is the agent itself: torchrun imports torch and sets up its agent and store
before the first rank starts, and tears them down after the last one ends, seconds that every
test launch paid on top of cases that often take no longer. The ranks share this process's
stdout and stderr. As under torchrun, a rank that fails ends the others (SIGTERM, then SIGKILL
after a grace period) and the exit status is non-zero, with a line naming the failed rank (the
lowest one seen failed at a poll: a peer may fail in the same instant because of it). Ended by a
signal itself (SIGTERM, SIGINT, SIGHUP), it ends its ranks the same way.

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
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # those that end the spawner, and its ranks with it


def rank_env(base: dict[str, str], *, rank: int, nproc: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of a single-node job of ``nproc`` ranks."""
    env = dict(base)
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("GROUP_RANK", 0), ("ROLE_RANK", rank),
                        ("WORLD_SIZE", nproc), ("LOCAL_WORLD_SIZE", nproc), ("ROLE_WORLD_SIZE", nproc),
                        ("GROUP_WORLD_SIZE", 1), ("ROLE_NAME", "default"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", port), ("TORCHELASTIC_RUN_ID", "none"), ("TORCHELASTIC_RESTART_COUNT", 0),
                        ("TORCHELASTIC_MAX_RESTARTS", 0)):
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
    """0 once every rank ended well; else the status of the first failure seen (the caller ends the rest)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"spawn.py: rank {rank} exited with status {code}; ending the other ranks", file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code  # killed by a signal: the shell's convention
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def _raise_exit(signum: int, _frame: object) -> None:
    # Only raise here: ending the ranks waits on them, which must not happen inside a handler that may
    # have interrupted a wait on the same process (Popen's wait lock). main's ``finally`` ends them.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Start the ranks, wait for them, end those left; the exit status as described above."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="ranks to start (at least 1)")
    parser.add_argument("--port", type=int, required=True, help="MASTER_PORT: rank 0 hosts the store there")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    for signum in SIGNALS:  # before any rank exists
        signal.signal(signum, _raise_exit)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(args.nproc):
            env = rank_env(dict(os.environ), rank=rank, nproc=args.nproc, port=args.port)
            procs.append(subprocess.Popen([sys.executable, args.script, *args.args], env=env))
        return _wait(procs)
    finally:
        for signum in SIGNALS:  # a second signal must not cut the ending short
            signal.signal(signum, signal.SIG_IGN)
        _end(procs)


if __name__ == "__main__":
    raise SystemExit(main())
