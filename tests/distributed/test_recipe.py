"""recipes/train_hf.py end to end: 2 gloo ranks, V-Half, the default tiny Llama.

One launch trains 3 steps and saves checkpoints after steps 2 and 3; a second resumes from
step 2's (as after a kill in step 3's save) to step 4, with step 3's loss again.
Together about 30-40 s on 2 idle cores (most of it process start-up).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .launch import ROOT, free_port, run_ranks

pytestmark = pytest.mark.distributed
RECIPE = ROOT / "recipes" / "train_hf.py"
RANKS = 2


def _train(workdir: Path, *extra: str, timeout: int = 300, config: str | Path = "v-half", ranks: int = RANKS) -> str:
    """Run the recipe; ``config`` names a file of ds_configs/ (without .json) or is a path."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TMPDIR=str(workdir))
    path = config if isinstance(config, Path) else ROOT / "ds_configs" / f"{config}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}",
           str(RECIPE), "--deepspeed_config", str(path), *extra]
    proc = run_ranks(cmd, env=env, timeout=timeout)
    log = proc.stdout + proc.stderr
    (workdir / f"log-{len(list(workdir.glob('log-*')))}.txt").write_text(log)
    if proc.returncode != 0:
        raise AssertionError(f"train_hf.py exited {proc.returncode}; log tail:\n{log[-4000:]}")
    return proc.stdout


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("recipe")
    out = _train(work, "--steps", "3", "--metrics-out", str(work / "m.jsonl"), "--save", str(work / "ckpt"), "--save-every", "2")
    return work, out


def test_three_steps_write_metrics_summary_and_checkpoint(first_run: tuple[Path, str]) -> None:
    work, stdout = first_run
    rows = _rows(work / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["loss"]) and 0 < row["loss"] < 10
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
        peaks = row["peak_activation_bytes"]
        # The meter runs on the first and the last step only; the step between pays nothing for it.
        assert row["metered"] == (row["step"] != 2)
        if row["metered"]:
            assert len(peaks) == RANKS and all(isinstance(p, int) and p > 0 for p in peaks)
        else:
            assert peaks == [None] * RANKS
    summary = json.loads((work / "m.summary.json").read_text())
    assert summary["schedule"] == "v-half" and summary["ranks"] == RANKS
    assert 0 <= summary["sim_bubble_rate"] < 1
    assert summary["losses"] == [r["loss"] for r in rows]
    assert "simulated bubble rate" in stdout and "measured peak activation" in stdout
    files = os.listdir(work / "ckpt" / "global_step3")
    # V placement: 10 layers, each saved once under its global index.
    assert sum(f.startswith("layer_") for f in files) == 10


def test_resume_continues_step_count_and_metrics(first_run: tuple[Path, str]) -> None:
    """As if killed in the save of step 3: ``latest`` names step 2's checkpoint (``--save-every 2``).
    The restarted run reads on from step 3's micro-batches: the same step-3 loss, then step 4."""
    work, _ = first_run
    (work / "ckpt" / "latest").write_text("global_step2")
    _train(work, "--steps", "4", "--metrics-out", str(work / "m.jsonl"), "--resume", str(work / "ckpt"), "--no-eval")
    rows = _rows(work / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]  # the metrics file goes on: step 3 again, then 4
    assert rows[3]["loss"] == rows[2]["loss"], f"step 3 after the resume: {rows[3]['loss']}, before: {rows[2]['loss']}"
    assert math.isfinite(rows[-1]["loss"])


def test_auto_schedule_from_the_readme_trains_to_the_same_losses(first_run: tuple[Path, str], tmp_path: Path) -> None:
    """The README's "schedule": "auto" with a profiled cut (its sample sized for the recipe's byte vocabulary):
    measures, switches, reports the choice, and trains the model to the losses V-Half gave it."""
    config = json.loads((ROOT / "ds_configs" / "v-half.json").read_text())
    config["pipeline"] = {"schedule": "auto", "partition_method": "profile",
                          "profile_sample": {"inputs": {"shape": [4, 64], "dtype": "int64", "high": 256}}}
    (tmp_path / "auto.json").write_text(json.dumps(config))
    stdout = _train(tmp_path, "--steps", "3", "--no-eval", "--metrics-out", str(tmp_path / "a.jsonl"),
                    config=tmp_path / "auto.json")
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert summary["schedule"].startswith("auto: ") and f"schedule                 {summary['schedule']}" in stdout
    plain = [r["loss"] for r in _rows(first_run[0] / "m.jsonl")][:3]
    assert [r["loss"] for r in _rows(tmp_path / "a.jsonl")] == pytest.approx(plain, rel=1e-5)


def test_seq1f1b_config_trains_long_sequences_in_chunks(tmp_path: Path) -> None:
    """ds_configs/seq1f1b.json (k=4) under the recipe with a longer --seq-len: trains and measures every rank."""
    _train(tmp_path, "--steps", "2", "--seq-len", "256", "--no-eval", "--metrics-out", str(tmp_path / "s.jsonl"),
           config="seq1f1b")
    summary = json.loads((tmp_path / "s.summary.json").read_text())
    assert summary["schedule"] == "seq1f1b" and summary["ranks"] == RANKS
    rows = _rows(tmp_path / "s.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(isinstance(p, int) and p > 0 for r in rows for p in r["peak_activation_bytes"])
    # k=4 chunks of 64 tokens; the simulator's bubble for p=2, m=8, k=4: (p-1)/(k·m+p-1) = 1/33.
    assert abs(summary["sim_bubble_rate"] - 1 / 33) < 1e-9


def test_breadth_first_zero3_on_pp2xdp2_matches_stock_zero0(tmp_path: Path) -> None:
    """The recipe on 4 ranks, 2 stages x 2 replicas: breadth-first under ZeRO-3 (every weight
    sharded, ds_configs/zero/) gives stock DeepSpeed 1F1B's ZeRO-0 losses, each replica on its
    own data."""
    losses = {}
    for config in ("zero/breadth-first-zero3", "deepspeed-1f1b"):
        work = tmp_path / config.replace("/", "-")
        work.mkdir()
        _train(work, "--steps", "3", "--no-eval", "--pipeline-stages", "2", "--metrics-out", str(work / "m.jsonl"),
               config=config, ranks=4)
        losses[config] = [r["loss"] for r in _rows(work / "m.jsonl")]
    assert losses["zero/breadth-first-zero3"] == pytest.approx(losses["deepspeed-1f1b"], rel=1e-5), losses


def test_post_validation_config_gives_the_plain_losses(tmp_path: Path) -> None:
    """ds_configs/post_validation/zb-h2.json (clipping 1.0, AdamW, WarmupLR, speculating after 2
    steps) trains the recipe's model to the same losses as ds_configs/zb-h2.json."""
    losses, summaries = {}, {}
    for config in ("post_validation/zb-h2", "zb-h2"):
        work = tmp_path / config.replace("/", "-")
        work.mkdir()
        _train(work, "--steps", "5", "--metrics-out", str(work / "m.jsonl"), config=config)
        losses[config] = [r["loss"] for r in _rows(work / "m.jsonl")]
        summaries[config] = json.loads((work / "m.summary.json").read_text())
    assert losses["post_validation/zb-h2"] == pytest.approx(losses["zb-h2"], rel=1e-6), losses
    assert summaries["post_validation/zb-h2"]["val_loss"] == pytest.approx(summaries["zb-h2"]["val_loss"], rel=1e-6)
