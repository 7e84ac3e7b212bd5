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

Its own code imports nothing beyond the standard library, so it starts in milliseconds. With
``--preload torch,deepspeed,...`` it imports those modules first and then forks each rank from
itself (``os.fork``; the rank runs the script as ``__main__`` in its own environment): the ranks
find them imported, where each rank would otherwise import them on cores it shares with the
others. What the imports made is frozen first (``gc.freeze``): no rank's collection walks it
again, nor touches (and so copies) the memory it shares with the others. It forks only while it
has a single thread (a forked child would find another thread's locks held for good), and starts
new processes otherwise.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import os
import runpy
import signal
import subprocess
import sys
import time
from typing import Any, NoReturn, Protocol

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


class _Rank(Protocol):
    """What the spawner asks of a rank's process: ``subprocess.Popen``'s calls, which ``_Forked`` has too."""

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class _Forked:
    """A rank forked from this process (``--preload``), with the ``subprocess.Popen`` calls the spawner
    makes: its status as ``Popen.returncode`` gives it (negative: ended by that signal)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by an earlier poll that a signal cut short: as Popen, 0
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def _signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended since the poll; the next poll reaps it
                pass


_Handlers = dict[signal.Signals, Any]  # signal -> handler, as ``signal.getsignal`` gives it


def _fork(script: str, args: list[str], env: dict[str, str], handlers: _Handlers) -> _Forked:
    """Run ``script`` as ``__main__`` in a child of this process, in ``env``, as ``python script args`` would;
    ``handlers``: the signal handlers this process had before it set its own (the child's). Called with
    ``SIGNALS`` blocked."""
    sys.stdout.flush()
    sys.stderr.flush()  # nothing buffered here may come out twice
    pid = os.fork()
    if pid == 0:
        _run_rank(script, args, env, handlers)
    return _Forked(pid)


def _run_rank(script: str, args: list[str], env: dict[str, str], handlers: _Handlers) -> NoReturn:
    """The forked child: runs the script and exits with its status, never returning into the spawner.
    What differs from a new interpreter: ``atexit`` handlers do not run, and an interrupt ends it with
    status 1 (the worker itself ends through ``os._exit``)."""
    code = 1
    try:
        try:
            for signum, handler in handlers.items():
                if handler is not None:  # None: set outside Python, and left as it is
                    signal.signal(signum, handler)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's failure, printed as the interpreter would
        sys.excepthook(*sys.exc_info())
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _preload(modules: list[str]) -> bool:
    """Import ``modules`` here, once for every rank; True where forking is then safe (this process
    still has one thread: a thread's locks would be held forever in a forked child)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:  # not in this version of the package: the ranks import what theirs has
            if err.name is None or not name.startswith(err.name):
                raise
    if not os.path.isdir("/proc/self/task"):
        print("spawn.py: cannot count this process's threads (no /proc); starting the ranks as new processes",
              file=sys.stderr, flush=True)
        return False
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"spawn.py: {threads} threads after --preload; starting the ranks as new processes", file=sys.stderr, flush=True)
    return threads == 1


def _end(procs: list[_Rank]) -> None:
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


def _wait(procs: list[_Rank]) -> int:
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
    parser.add_argument("--preload", default="", help="modules to import here, comma-separated: the ranks are then "
                        "forked from this process and find them imported (their imports paid once, not per rank)")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}  # what a forked rank gets back
    for signum in SIGNALS:  # before any rank exists
        signal.signal(signum, _raise_exit)
    # A launch that times out ends this process with SIGTERM: while it imports (no ranks yet) its stack
    # shows where, as every rank's does (worker.py); the handler above runs after the dump (chained).
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    procs: list[_Rank] = []
    try:
        fork = bool(args.preload) and _preload([m for m in args.preload.split(",") if m])
        if fork:  # what the imports made, out of the collector's sight: no rank's collection touches (copies) it
            gc.freeze()
        for rank in range(args.nproc):
            env = rank_env(dict(os.environ), rank=rank, nproc=args.nproc, port=args.port)
            if not fork:
                procs.append(subprocess.Popen([sys.executable, args.script, *args.args], env=env))
                continue
            # Blocked from before the fork until the rank is listed: the child must not run this process's
            # handlers (they raise into code it must never return to; it unblocks once it has its own), and
            # a signal must not end this process with a rank it does not know of.
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            try:
                procs.append(_fork(args.script, args.args, env, handlers))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        return _wait(procs)
    finally:
        for signum in SIGNALS:  # a second signal must not cut the ending short
            signal.signal(signum, signal.SIG_IGN)
        _end(procs)


if __name__ == "__main__":
    raise SystemExit(main())
