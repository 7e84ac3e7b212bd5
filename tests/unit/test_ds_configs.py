"""The shipped ds_configs/*.json: each parses, and they differ only in the "pipeline" block.

That last property is what makes a schedule comparison fair: optimizer, batch shape,
clipping and precision are the same in every file, so only the schedule changes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from ds_vshape.config import parse_pipeline_config
from ds_vshape.schedules import generate, get_info

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
STOCK = "deepspeed-1f1b"  # no schedule key: plain DeepSpeed 1F1B
EXPECTED = {STOCK, "1f1b", "gpipe", "zb-h1", "zb-h2", "zb-auto", "interleaved", "breadth-first",
            "v-zb", "v-half", "v-min", "v-adaptive", "seq1f1b"}
FILES = sorted(CONFIG_DIR.glob("*.json"))


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _without_pipeline(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "pipeline"}


def test_every_expected_schedule_has_a_config() -> None:
    assert {p.stem for p in FILES} >= EXPECTED


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_config_parses_and_names_its_schedule(path: Path) -> None:
    config = parse_pipeline_config(_load(path))
    if path.stem == STOCK:
        assert config.schedule is None
    else:
        # The file name is the schedule's canonical name, so `ds_configs/<name>.json` is predictable.
        assert config.schedule == get_info(path.stem).name == path.stem


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_config_differs_from_stock_only_in_pipeline(path: Path) -> None:
    assert _without_pipeline(_load(path)) == _without_pipeline(_load(CONFIG_DIR / f"{STOCK}.json"))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_micro_batches_suit_the_recipe_rank_counts(path: Path, ranks: int) -> None:
    """train_hf.py runs these on 2 (test) and 4 (demo) ranks: the schedule must exist there."""
    raw = _load(path)
    config = parse_pipeline_config(raw)
    name = config.schedule or "1f1b"
    schedule = generate(name, ranks, raw["gradient_accumulation_steps"], chunks=config.chunks,
                        seq_chunks=config.seq_chunks, memory_limit=config.memory_limit)
    # The default model has 10 pipeline layers (embedding, 8 blocks, head).
    assert schedule.num_model_stages <= 10


def _check_seq_len() -> Any:
    sys.path.insert(0, str(CONFIG_DIR.parent))
    try:
        from recipes.train_hf import check_seq_len
    finally:
        sys.path.remove(str(CONFIG_DIR.parent))
    return check_seq_len


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_recipe_default_seq_len_suits_every_config(path: Path) -> None:
    _check_seq_len()(_load(path), 64, str(path))  # train_hf.py's default --seq-len


def test_recipe_refuses_a_seq_len_the_chunks_cannot_cut() -> None:
    raw = _load(CONFIG_DIR / "seq1f1b.json")
    with pytest.raises(SystemExit, match=r"--seq-len 1022 is not a multiple of pipeline.seq_chunks=4 in s.json.*"
                                         r"use --seq-len 1020 or 1024, set pipeline.seq_chunks to a divisor of 1022, "
                                         r"or set pipeline.seq_partition to \"compute\""):
        _check_seq_len()(raw, 1022, "s.json")
    _check_seq_len()({**raw, "pipeline": {**raw["pipeline"], "seq_partition": "compute"}}, 1022, "s.json")
    default_k = {**raw, "pipeline": {"schedule": "seq1f1b"}}
    with pytest.raises(SystemExit, match=r"pipeline.seq_chunks=2 \(seq1f1b's default\).*use --seq-len 2 or 4"):
        _check_seq_len()(default_k, 3, "s.json")
    _check_seq_len()(raw, 1024, "s.json")


def test_recipe_accepts_schedule_auto() -> None:
    # auto runs every schedule with the config's seq_chunks, 1 when absent: any --seq-len goes.
    stock = _load(CONFIG_DIR / f"{STOCK}.json")
    for pipeline in ({"schedule": "auto"}, {"schedule": "auto", "auto_placement": "linear"},
                     {"schedule": "auto", "auto_placement": "looped", "memory_limit": 3.0}):
        _check_seq_len()({**stock, "pipeline": pipeline}, 63, "a.json")
    with pytest.raises(SystemExit, match=r"--seq-len 66 is not a multiple of pipeline.seq_chunks=4 in a.json"):
        _check_seq_len()({**stock, "pipeline": {"schedule": "auto", "auto_placement": "linear", "seq_chunks": 4}},
                         66, "a.json")


def _readme_pipeline_blocks() -> list[dict[str, Any]]:
    """Every ```json block of the README that holds a "pipeline" object (snippets get their braces)."""
    text = (CONFIG_DIR.parent / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```json\n(.*?)```", text, flags=re.S):
        if '"pipeline"' in body:
            loaded = json.loads(body if body.lstrip().startswith("{") else "{" + body + "}")
            blocks.append(loaded["pipeline"])
    return blocks


def test_recipe_accepts_every_pipeline_config_the_readme_shows() -> None:
    blocks = _readme_pipeline_blocks()
    assert any(block.get("schedule") == "auto" for block in blocks) and len(blocks) >= 2
    stock = _load(CONFIG_DIR / f"{STOCK}.json")
    for block in blocks:
        _check_seq_len()({**stock, "pipeline": block}, 64, "README.md")  # train_hf.py's default --seq-len
