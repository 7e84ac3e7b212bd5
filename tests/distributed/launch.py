"""Launch worker.py on N real gloo ranks once for a list of cases; return per-rank results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from .nccl_emulation.settings import FIRST_CONTACT_ENV, ONE_QUEUE_ENV, SYNCHRONIZE_ENV, env_switch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
SPAWN = Path(__file__).with_name("spawn.py")
# Where each launch appends a line of where its time went (unset: nowhere), e.g.
#   DS_VSHAPE_TEST_TIMES=/tmp/launch_times.jsonl pytest -m distributed tests
TIMES_ENV = "DS_VSHAPE_TEST_TIMES"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every rule of the emulation at once: first contact, synchronize, one queue per rank.
ALL_RULES = {"first_contact": True, "synchronize": True, "one_queue": True}
MODE_ENV = "DS_VSHAPE_TEST_NCCL"  # the emulation mode of launches that do not name one: eager (default), lazy or off


def default_mode() -> str | None:
    """What a launch that names no mode runs under: NCCL's eager rules unless the env says otherwise."""
    mode = os.environ.get(MODE_ENV, "eager")
    if mode not in ("eager", "lazy", "off"):
        raise ValueError(f"{MODE_ENV} must be eager, lazy or off, got {mode!r}")
    return None if mode == "off" else mode


def stricter_rules() -> bool:
    """Whether launches run under more than eager init's rules (``DS_VSHAPE_TEST_NCCL``, a rule's switch)."""
    switches = (FIRST_CONTACT_ENV, SYNCHRONIZE_ENV, ONE_QUEUE_ENV)
    return default_mode() != "eager" or any(env_switch(name, os.environ.get(name)) for name in switches)


def launch(cases: list[dict[str, Any]], nproc: int, workdir: Path, *, timeout: int = 600,
           nccl: bool | str | None = None, backend: str = "gloo", first_contact: bool | None = None,
           synchronize: bool | None = None, one_queue: bool | None = None) -> list[dict[str, Any]]:
    """Run every case on ``nproc`` ranks; returns one dict (case name -> result) per rank.

    ``nccl="eager"`` or ``"lazy"`` runs the ranks under tests/distributed/nccl_emulation: gloo
    with NCCL's rules (one ordered queue per communicator, tags ignored, rendezvous sends) in
    that init mode; ``nccl=True`` means "eager" (DeepSpeed's mode on GPUs). ``backend="nccl"``
    is the real thing (tests/gpu): one CUDA device per rank, DeepSpeed's accelerator left to
    detect CUDA. ``first_contact=True`` adds the emulation's first-contact rule (a rank's first
    p2p call with a peer blocks until the peer's first call with it); None leaves the env's
    ``DS_VSHAPE_NCCL_FIRST_CONTACT`` as it is (off when unset). ``synchronize=True`` adds the
    synchronize rule (``get_accelerator().synchronize()`` waits for every op the rank queued),
    ``one_queue=True`` the one-queue rule (every communicator of a rank feeds one ordered queue)
    and sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as a Megatron-DeepSpeed job does, so the runtime
    sees what it would see there; None leaves ``DS_VSHAPE_NCCL_SYNCHRONIZE`` /
    ``DS_VSHAPE_NCCL_ONE_QUEUE`` as they are (off when unset).
    """
    if nccl is None:  # users run NCCL: every engine test obeys its rules unless it says otherwise
        nccl = default_mode() if backend == "gloo" else False
    mode = "eager" if nccl is True else nccl or None
    if backend not in ("gloo", "nccl") or mode not in (None, "eager", "lazy") or (mode and backend != "gloo"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', nccl False, True, 'eager' or 'lazy' (emulation only on "
                         f"gloo); got backend={backend!r}, nccl={nccl!r}")
    workdir.mkdir(parents=True, exist_ok=True)
    cases_file = workdir / "cases.json"
    cases_file.write_text(json.dumps(cases))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TMPDIR=str(workdir))
    emulation_env(env, mode, first_contact=first_contact, synchronize=synchronize, one_queue=one_queue)
    env["DS_VSHAPE_TEST_BACKEND"] = backend
    if backend == "nccl":
        del env["DS_ACCELERATOR"]
    # spawn.py starts the ranks with torchrun's environment, without its agent's seconds per launch; the
    # GPU tier keeps torchrun, the launcher its jobs use.
    cmd = ([sys.executable, str(SPAWN), f"--nproc={nproc}", f"--port={free_port()}", f"--preload={_preload_arg(cases)}"]
           if backend == "gloo" else
           [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"])
    cmd += [str(WORKER), str(cases_file), str(workdir)]
    # A rank still running shortly before the timeout prints every thread's stack (worker.py),
    # so that a hang names where each rank waits.
    env.setdefault("DS_VSHAPE_TEST_DUMP_AFTER_S", str(max(timeout - 20, 10)))
    began, ok = time.monotonic(), False
    try:
        _run(cmd, env=env, timeout=timeout, workdir=workdir, nproc=nproc)
        ok = True
    finally:
        _log_times(workdir, nproc, mode, time.monotonic() - began, ok=ok)
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(nproc)]


# What every rank imports before or during its first case (``python -X importtime``): torch._dynamo (the first
# ``zero_grad`` of torch's optimizers), DeepSpeed's pipeline engine, ds_vshape; with ZeRO also its optimizers
# and their Muon check (torch._inductor behind it, seconds). spawn.py imports them once and then forks the
# ranks, rather than every rank on shared cores; a module this DeepSpeed lacks is skipped there.
PRELOAD = ("torch._dynamo", "deepspeed", "deepspeed.pipe", "deepspeed.runtime.pipe.engine", "ds_vshape.api",
           "tests.distributed.cpu_fp16")
PRELOAD_ZERO = ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                "deepspeed.runtime.zero.muon.muon_optimizer")
FORK_ENV = "DS_VSHAPE_TEST_FORK"  # "0": every rank a new interpreter that imports everything itself


def _preload_arg(cases: list[dict[str, Any]]) -> str:
    """spawn.py's ``--preload``: ``PRELOAD``; ``PRELOAD_ZERO`` where a case names ZeRO anywhere (its stage,
    its config, its name: a module imported in vain costs less than one imported per rank), transformers
    where a case builds a Hugging Face model."""
    if os.environ.get(FORK_ENV, "1") == "0":
        return ""
    zero = PRELOAD_ZERO if any("zero" in json.dumps(case) for case in cases) else ()
    return ",".join(PRELOAD + zero + (("transformers",) if any("hf" in case for case in cases) else ()))


def _run(cmd: list[str], *, env: dict[str, str], timeout: int, workdir: Path, nproc: int) -> None:
    """Run the launch's command; its log goes to ``workdir/log.txt``. Raises, with the log's tail, where
    it timed out or exited non-zero."""
    try:
        proc = run_ranks(cmd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        log = _text(err.stdout) + _text(err.stderr)
        (workdir / "log.txt").write_text(log)
        done = [r for r in range(nproc) if (workdir / f"rank{r}.json").exists()]
        raise RuntimeError(f"the launch of {nproc} ranks timed out after {timeout} s; ranks that wrote their results: {done}; "
                           f"full log in {workdir / 'log.txt'}; its tail:\n{log[-12000:]}") from None
    (workdir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the launch of {nproc} ranks exited {proc.returncode}; log tail:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _log_times(workdir: Path, nproc: int, mode: str | None, wall_s: float, *, ok: bool) -> None:
    """Append the launch's wall time, whether it ended well (not: timed out or exited non-zero) and
    rank 0's seconds before its first case and per case (where rank 0 wrote them) to
    ``$DS_VSHAPE_TEST_TIMES``, if set: which launches and cases the suite's time goes to."""
    path = os.environ.get(TIMES_ENV)
    if not path:
        return
    seconds = workdir / "rank0.seconds.json"
    cases = json.loads(seconds.read_text()) if seconds.exists() else {}
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    line = {"test": test, "nproc": nproc, "mode": mode, "ok": ok, "wall_s": round(wall_s, 2),
            "cases": {k: round(v, 2) for k, v in cases.items()}}
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")


GRACE_S = 10.0  # how long a timed-out launch's processes get to end on SIGTERM before SIGKILL


def run_ranks(cmd: list[str], *, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a command that starts ranks (spawn.py, torchrun, the fault driver); past ``timeout`` end all it started.

    torchrun starts each rank in a session of its own (spawn.py's ranks share its session), so
    killing torchrun alone would leave its ranks running: they would keep the cores busy, so that
    every later launch runs slower, up to its own timeout, and one of them may hold the lock of a
    DeepSpeed op's build, on which every later rank then waits forever. On timeout the command and
    every process below it get SIGTERM, then SIGKILL after ``GRACE_S``; raises
    ``subprocess.TimeoutExpired`` with the output so far.
    """
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_process_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired as late:  # a process outside the tree still holds the pipes
            out, err = _text(late.stdout), _text(late.stderr)
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def end_process_tree(pid: int) -> None:
    """SIGTERM to ``pid`` and every process below it, then SIGKILL to those still there after ``GRACE_S``."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for each in tree:
        try:
            each.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=GRACE_S)
    for each in alive:
        try:
            each.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def by_case(per_rank: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``launch``'s per-rank results regrouped per case: case name -> one result per rank."""
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


def process_alive(pid: int) -> bool:
    """Whether a process of this id still exists (a test's check that no rank outlived its case)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def emulation_env(env: dict[str, str], mode: str | None, *, first_contact: bool | None = None,
                  synchronize: bool | None = None, one_queue: bool | None = None) -> dict[str, str]:
    """Set ``env`` (the ranks' environment) for NCCL emulation ``mode`` (None: off) and its rules.

    A rule given as None keeps what the environment says (``DS_VSHAPE_NCCL_*``, off when unset).
    Under the one-queue rule the ranks also get ``CUDA_DEVICE_MAX_CONNECTIONS=1``, as a
    Megatron-DeepSpeed job sets it: that is what the runtime reads to adapt its transfer order.
    """
    env.pop("DS_VSHAPE_NCCL_EMULATION", None)  # only the mode turns it on
    if mode:
        env["DS_VSHAPE_NCCL_EMULATION"] = mode
    for var, value in ((FIRST_CONTACT_ENV, first_contact), (SYNCHRONIZE_ENV, synchronize), (ONE_QUEUE_ENV, one_queue)):
        if value is not None:
            env[var] = "1" if value else "0"
    if env.get(ONE_QUEUE_ENV) == "1" and mode:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env
