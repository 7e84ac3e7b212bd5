"""The shipped ds_configs/*.json: each parses, and they differ only in the "pipeline" block.

That last property is what makes a schedule comparison fair: optimizer, batch shape,
clipping and precision are the same in every file, so only the schedule changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ds_vshape.config import parse_pipeline_config
from ds_vshape.schedules import generate, get_info

CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
STOCK = "deepspeed-1f1b"  # no schedule key: plain DeepSpeed 1F1B
EXPECTED = {STOCK, "1f1b", "gpipe", "zb-h1", "zb-h2", "zb-auto", "interleaved", "breadth-first",
            "v-zb", "v-half", "v-min", "v-adaptive"}
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
