"""Run fault cases: each rank of a case in an independent process, several cases at once.

``python -m tests.distributed.fault_driver CASES_JSON OUT_DIR [CONCURRENT]``. The driver imports
torch, DeepSpeed and ds_vshape once and forks every rank from there (each start would otherwise
pay seconds of imports); a rank process is a child of the driver only, never of another rank,
and the driver stops none of them: as on several nodes, nothing tells a survivor that a peer
died except what the runtime itself notices. Each rank runs as a script would: an uncaught
error ends it with a traceback on its stderr (``OUT/CASE/rank{r}.err``) and exit status 1
(through ``os._exit``: a forked copy must never return into the driver's code).

The driver waits for every rank of a case (``os.waitpid``) and writes ``OUT/CASE/result.json``:
each rank's exit status, the time it ended and its last error line, and the killed rank's
record (``killed{r}.json``: the time of its SIGKILL). A rank still running
``DS_VSHAPE_FAULT_AFTER_KILL_S`` after the kill (or ``DS_VSHAPE_FAULT_HARD_LIMIT_S`` after its
case started) is recorded as ``left_running``, writes every thread's stack to its ``.err``
(SIGUSR1, kept in the result's ``stacks``) and is then killed, so a hang fails the test instead
of the suite and shows where it waited. The dead rank's socket holder is ended after the survivors.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

from .launch import emulation_env

__all__ = ["main"]

_POLL_S = 0.05


def _subreaper() -> None:
    """Become the reaper of orphans (the killed ranks' socket holders), so none outlives the driver."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _rank_main(case: dict[str, Any], rank: int, port: int, case_dir: str) -> None:
    """The forked rank: stderr to its file, the process group's env, the case; exits like a script."""
    err = os.open(os.path.join(case_dir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 1)
    os.dup2(err, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for every stack before it ends a hang
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case["world"]), LOCAL_WORLD_SIZE=str(case["world"]),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        import deepspeed

        from .fault_checks import run_fault_rank

        _case_rules(case)
        deepspeed.init_distributed(dist_backend="gloo")
        run_fault_rank(case, case_dir)
    except BaseException:  # what a user's script prints before it exits non-zero
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # past this point the process is the driver's copy: never return into it


def _case_rules(case: dict[str, Any]) -> None:
    """A case's own NCCL emulation rules (``case["nccl"]``: mode and rule switches), set in its
    rank before the process group exists; cases without keep what the driver installed."""
    rules = case.get("nccl")
    if not rules:
        return
    from tests.distributed import nccl_emulation

    # The rules go into the environment once (CUDA_DEVICE_MAX_CONNECTIONS with one queue, as every
    # launch sets it); install reads its switches from there.
    os.environ.update(emulation_env(dict(os.environ), rules["mode"], first_contact=rules.get("first_contact"),
                                    synchronize=rules.get("synchronize"), one_queue=rules.get("one_queue")))
    nccl_emulation.install(mode=rules["mode"])


def _case_port() -> int:
    """A port for a case's rendezvous, below Linux's ephemeral range (32768 and up): the other cases'
    gloo connections take their local ports from that range and could take a port picked there
    between its pick and rank 0's bind (EADDRINUSE)."""
    import random
    import socket

    while True:
        port = random.randint(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _start(case: dict[str, Any], out_dir: str) -> dict[str, Any]:
    case_dir = os.path.join(out_dir, case["name"])
    os.makedirs(case_dir, exist_ok=True)
    port = _case_port()
    pids = {}
    for rank in range(case["world"]):
        pid = os.fork()
        if pid == 0:
            _rank_main(case, rank, port, case_dir)
        pids[pid] = rank
    return {"case": case, "dir": case_dir, "pids": pids, "started": time.time(), "ranks": {}}


def _last_error(path: str) -> str | None:
    with open(path, errors="replace") as fh:
        lines = [line.rstrip() for line in fh if line.strip()]
    errors = [line for line in lines if not line.startswith((" ", "[", "Traceback", "During handling", "The above"))]
    return errors[-1] if errors else None


def _record(run: dict[str, Any], pid: int, status: int, at: float) -> None:
    rank = run["pids"].pop(pid)
    code = os.waitstatus_to_exitcode(status)
    run["ranks"][rank] = {"exit": code, "ended": at, "error": _last_error(os.path.join(run["dir"], f"rank{rank}.err"))}


def _finish(run: dict[str, Any]) -> dict[str, Any]:
    """The case's result; ends the killed rank's socket holder."""
    killed = _killed(run)
    if killed is not None:
        _end(killed["holder"])
    result = {"killed": killed, "started": run["started"], "ranks": {str(r): v for r, v in sorted(run["ranks"].items())},
              "left_running": run.get("left_running", []), "stacks": run.get("stacks", {})}
    with open(os.path.join(run["dir"], "result.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


def _port_taken(result: dict[str, Any]) -> bool:
    """The case never started: its rendezvous port was taken before rank 0 could listen on it."""
    return result["killed"] is None and any("EADDRINUSE" in (r.get("error") or "") for r in result["ranks"].values())


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _killed(run: dict[str, Any]) -> dict[str, Any] | None:
    """The killed rank's record (``killed{r}.json``: when, its pid, its socket holder's), once written."""
    path = os.path.join(run["dir"], f"killed{run['case']['kill_rank']}.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):  # not yet, or being written
        return None


def _killed_at(run: dict[str, Any]) -> float | None:
    """When the case's rank died, once it has; read once."""
    if run.get("killed_at") is None:
        killed = _killed(run)
        run["killed_at"] = killed["at"] if killed is not None else None
    return run["killed_at"]


def _overdue(run: dict[str, Any], hard_limit_s: float, after_kill_s: float) -> bool:
    """Ranks still running ``after_kill_s`` after the kill, or ``hard_limit_s`` after the start
    (a case slow to reach its kill point is not mistaken for a hang after it)."""
    now, killed = time.time(), _killed_at(run)
    return now - run["started"] > hard_limit_s or (killed is not None and now - killed > after_kill_s)


def _end_hung(run: dict[str, Any]) -> None:
    """Record the hung ranks, ask each for every thread's stack (into its .err, kept in the result
    so a failing test shows where it waited), then end them."""
    run["left_running"] = sorted(run["pids"].values())
    for pid in run["pids"]:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    run["stacks"] = {}
    for pid in list(run["pids"]):
        rank = run["pids"][pid]
        with open(os.path.join(run["dir"], f"rank{rank}.err"), errors="replace") as fh:
            run["stacks"][str(rank)] = fh.read()[-6000:]
        _end(pid)
        _record(run, pid, os.waitpid(pid, 0)[1], time.time())


def _poll(running: list[dict[str, Any]], hard_limit_s: float, after_kill_s: float) -> list[dict[str, Any]]:
    """Reap what ended; returns the runs all of whose ranks are done."""
    done = []
    for run in running:
        for pid in list(run["pids"]):
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                _record(run, pid, status, time.time())
        if run["pids"] and _overdue(run, hard_limit_s, after_kill_s):
            _end_hung(run)
        if not run["pids"]:
            done.append(run)
    return done


def _import_engine_init_modules() -> None:
    """What DeepSpeed's engine imports inside its constructor, imported here once: ``torch._dynamo`` (torch's
    optimizers load it on first construction) and ZeRO's check of supported optimizers, whose Muon module
    calls ``torch.compile`` as it loads. Otherwise every forked rank of every concurrent case would import
    them at once, seconds each on two cores, and a case's ranks could miss their kill point's time limit."""
    for name in ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"):
        try:
            importlib.import_module(name)
        except ImportError:  # another DeepSpeed or torch version: the ranks import what theirs needs
            pass


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    concurrent = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    _subreaper()
    if os.environ.get("DS_VSHAPE_NCCL_EMULATION"):  # before any process group, as in worker.py
        from tests.distributed import nccl_emulation

        nccl_emulation.install(mode=nccl_emulation.env_mode(os.environ["DS_VSHAPE_NCCL_EMULATION"]))
    import deepspeed  # noqa: F401  (imported once, here, for every forked rank)

    import ds_vshape.api  # noqa: F401  (initialize's module: the runtime's imports)
    from tests.distributed import fault_checks  # noqa: F401

    _import_engine_init_modules()
    from tests.distributed.cpu_fp16 import allow_cpu_fp16

    allow_cpu_fp16()
    pending, running, results = list(cases), [], {}
    while pending or running:
        while pending and len(running) < concurrent:
            running.append(_start(pending.pop(0), out_dir))
        for run in _poll(running, float(os.environ.get("DS_VSHAPE_FAULT_HARD_LIMIT_S", "120")),
                         float(os.environ.get("DS_VSHAPE_FAULT_AFTER_KILL_S", "30"))):
            running.remove(run)
            result = _finish(run)
            if _port_taken(result) and run["case"].get("attempt", 0) < 2:  # the rendezvous lost its port: again
                pending.insert(0, {**run["case"], "attempt": run["case"].get("attempt", 0) + 1})
                continue
            results[run["case"]["name"]] = result
        time.sleep(_POLL_S)
    time.sleep(0.2)
    _reap_orphans()
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    tempfile.tempdir = os.environ.get("TMPDIR", tempfile.gettempdir())
    main()
