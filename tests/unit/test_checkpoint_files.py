"""Checkpoint files, the parts that run in one process: atomic writes, the save's file record, the layout's
format, a save's order (marker, DeepSpeed's files, record, layout, ``latest``) and the check a load makes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_vshape.runtime.dropin import commit as commit_mod
from ds_vshape.runtime.dropin.atomic import atomic_write, is_temp, save_torch, temp_path, write_text
from ds_vshape.runtime.dropin.commit import AtomicSaveMixin
from ds_vshape.runtime.dropin.integrity import checked_layout, fix_for, intact_tag, tag_problems
from ds_vshape.runtime.dropin.layout_file import FORMAT, LAYOUT_FILE, CheckpointError, Layout, read_layout
from ds_vshape.runtime.dropin.manifest import MARKER, finished_tags, list_files, problems, record, shares

LAYOUT = Layout(schedule="1f1b", p=2, placement=(0, 1), stage_parts=(0, 2, 4), num_layers=4, zero_stage=0,
                optimizer="AdamW", mapped=True, holders={"0": [0], "1": [0], "2": [1], "3": [1]})


# ---- atomic writes ---------------------------------------------------------------------------
def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    write_text(str(target), "old")
    write_text(str(target), "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]


def test_a_write_cut_off_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    target = tmp_path / "f.pt"
    write_text(str(target), "old")

    def half(fh: Any) -> None:
        fh.write(b"half of it")
        raise KeyboardInterrupt  # the process stops mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(target), half)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["f.pt"]


def test_torch_save_round_trips_and_temporaries_are_recognised(tmp_path: Path) -> None:
    path = str(tmp_path / "s.pt")
    save_torch({"a": torch.arange(3)}, path)
    assert torch.equal(torch.load(path)["a"], torch.arange(3))
    assert is_temp(temp_path(path)) and not is_temp(path)


# ---- the save's record of its files -----------------------------------------------------------
def _tag(root: Path, name: str = "t1", files: dict[str, bytes] | None = None) -> Path:
    tag = root / name
    (tag / "sub").mkdir(parents=True)
    for rel, data in (files or {"mp_rank_00_model_states.pt": b"a" * 50, "layer_01-model_states.pt": b"b" * 20,
                                "vs_optim_pp_rank_01.pt": b"c" * 30, "sub/x.pt": b"d" * 5}).items():
        (tag / rel).write_bytes(data)
    return tag


def test_listing_skips_temporaries_the_marker_and_the_layout_file(tmp_path: Path) -> None:
    tag = _tag(tmp_path)
    for extra in (MARKER, LAYOUT_FILE, Path(temp_path(str(tag / "vs_optim_pp_rank_00.pt"))).name):
        (tag / extra).write_text("x")
    sizes = list_files(str(tag), skip={LAYOUT_FILE})
    assert sizes == {"layer_01-model_states.pt": 20, "mp_rank_00_model_states.pt": 50, "sub/x.pt": 5,
                     "vs_optim_pp_rank_01.pt": 30}


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shares_cover_every_file_once_balanced_and_alike_on_every_rank(world: int) -> None:
    sizes = {f"f{i}": size for i, size in enumerate([50, 40, 30, 20, 10, 5, 5])}
    split = shares(sizes, world)
    assert sorted(n for part in split for n in part) == sorted(sizes) and split == shares(dict(reversed(sizes.items())), world)
    loads = [sum(sizes[n] for n in part) for part in split]
    assert max(loads) - min(loads) <= max(sizes.values())


def test_problems_name_each_missing_cut_off_or_changed_file(tmp_path: Path) -> None:
    tag = _tag(tmp_path)
    files = {name: record(str(tag), name, sync=True) for name in list_files(str(tag))}
    assert problems(str(tag), files, files) == []
    (tag / "vs_optim_pp_rank_01.pt").unlink()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"a" * 10)
    (tag / "layer_01-model_states.pt").write_bytes(b"B" * 20)
    found = problems(str(tag), files, files)
    assert len(found) == 3, found
    assert "mp_rank_00_model_states.pt has 10 bytes where the save wrote 50 (cut off" in found[1]
    assert "layer_01-model_states.pt differs from what the save wrote" in found[0] and "another checkpoint's" in found[0]
    assert "vs_optim_pp_rank_01.pt is missing (the save wrote 30 bytes)" in found[2]


def test_finished_tags_are_newest_first_and_skip_unfinished_saves(tmp_path: Path) -> None:
    for name, finished in (("a", True), ("b", True), ("c", False)):
        tag = _tag(tmp_path, name)
        (tag / LAYOUT_FILE).write_text("{}")
        if not finished:
            (tag / MARKER).write_text("")
    os.utime(tmp_path / "a" / LAYOUT_FILE, (1, 1))
    assert finished_tags(str(tmp_path), LAYOUT_FILE) == ["b", "a"]
    assert finished_tags(str(tmp_path / "nowhere"), LAYOUT_FILE) == []


def test_the_tag_suggested_instead_is_the_newest_whose_files_have_their_sizes(tmp_path: Path) -> None:
    for age, name in enumerate(("d_other_version", "c_cut_off", "b_whole", "a_whole_older")):
        tag = _tag(tmp_path, name)
        files = {n: record(str(tag), n) for n in list_files(str(tag))}
        layout = Layout(**{**LAYOUT.__dict__, "files": files}).to_json()
        (tag / LAYOUT_FILE).write_text(layout.replace(FORMAT, "ds_vshape.checkpoint/9") if age == 0 else layout)
        os.utime(tag / LAYOUT_FILE, (100 - age, 100 - age))
    os.truncate(tmp_path / "c_cut_off" / "sub" / "x.pt", 1)
    assert intact_tag(str(tmp_path), but="x") == "b_whole"
    assert intact_tag(str(tmp_path), but="b_whole") == "a_whole_older"
    assert "tag='b_whole'" in fix_for(str(tmp_path), "x") and "No other tag" in fix_for(str(tmp_path / "a_whole_older"), "x")


# ---- the layout file's format ------------------------------------------------------------------
def test_layout_round_trips_with_its_file_record_and_names_its_format() -> None:
    layout = Layout(**{**LAYOUT.__dict__, "files": {"a.pt": {"size": 3, "sha256": "00"}}})
    text = layout.to_json()
    assert json.loads(text)["format"] == FORMAT == "ds_vshape.checkpoint/2"
    assert Layout.from_json(text, path="x") == layout


def test_a_format_1_layout_still_loads_without_a_file_record() -> None:
    data = {**json.loads(LAYOUT.to_json()), "format": "ds_vshape.checkpoint/1"}
    del data["files"]
    assert Layout.from_json(json.dumps(data), path="x") == LAYOUT


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        (json.dumps({**json.loads(LAYOUT.to_json()), "format": "ds_vshape.checkpoint/9"}),
         ["d/vs_layout.json has format 'ds_vshape.checkpoint/9'", "reads ds_vshape.checkpoint/1 and ds_vshape.checkpoint/2",
          "another ds_vshape version", "with the ds_vshape version that wrote it"]),
        (LAYOUT.to_json()[:40], ["d/vs_layout.json is not valid JSON", "cut off or damaged"]),
        (json.dumps({"format": FORMAT, "p": 2}), ["fields do not match", "edited or damaged"]),
        ("[1, 2]", ["has format None"]),
    ],
)
def test_a_layout_file_of_another_version_or_damaged_is_refused_by_name(text: str, needles: list[str]) -> None:
    with pytest.raises(CheckpointError) as err:
        Layout.from_json(text, path="d/vs_layout.json")
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("leftover", [MARKER, "vs_optim_pp_rank_00.pt"])
def test_a_tag_without_its_layout_file_is_a_save_that_did_not_finish(tmp_path: Path, leftover: str) -> None:
    tag = tmp_path / "t"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert read_layout(str(tag)) is not None  # stock DeepSpeed's files alone: a stock checkpoint
    (tag / leftover).write_bytes(b"x")
    with pytest.raises(CheckpointError, match="the save of this tag did not finish: vs_layout.json, which a save writes last"):
        read_layout(str(tag))


def test_each_rank_checks_its_share_and_together_they_check_every_file(tmp_path: Path) -> None:
    tag = _tag(tmp_path)
    files = {name: record(str(tag), name) for name in list_files(str(tag))}
    (tag / LAYOUT_FILE).write_text(Layout(**{**LAYOUT.__dict__, "files": files}).to_json())
    (tag / "sub" / "x.pt").write_bytes(b"e" * 5)
    found = [tag_problems(str(tag), rank=r, world=2) for r in range(2)]
    assert all(saved is not None and saved.files == files for saved, _ in found)
    assert sorted(len(ps) for _, ps in found) == [0, 1] and "sub/x.pt differs" in (found[0][1] + found[1][1])[0]


# ---- a save's order, and a load's check, on a gloo group of one process -------------------------
class _DeepSpeedSave:
    """Stands for DeepSpeed's save: writes the rank files; ``stop_after`` files, it dies (an exception here)."""

    global_steps, global_rank, local_rank = 7, 0, 0
    checkpoint_engine = object()

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after, self.calls = stop_after, []

    def use_node_local_storage(self) -> bool:
        return False

    def save_checkpoint(self, save_dir: str, tag: str, client_state: Any, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        self.calls.append(save_latest)
        for i, name in enumerate(["mp_rank_00_model_states.pt", "layer_00-model_states.pt", "vs_optim_pp_rank_00.pt"]):
            if i == self.stop_after:
                raise SystemExit("killed")
            Path(save_dir, tag, name).write_bytes(tag.encode() * (i + 1))
        return True


class _Engine(AtomicSaveMixin, _DeepSpeedSave):
    pass


def test_latest_names_a_tag_only_after_its_layout_file_and_record(gloo_world_of_one: None, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_mod, "layout_of", lambda engine: LAYOUT)
    root = str(tmp_path)
    engine = _Engine()
    assert engine.save_checkpoint(root, "t1") and engine.calls == [False]  # DeepSpeed never writes latest
    assert (tmp_path / "latest").read_text() == "t1" and not (tmp_path / "t1" / MARKER).exists()
    saved = checked_layout(root, "t1")
    assert saved is not None and sorted(saved.files) == ["layer_00-model_states.pt", "mp_rank_00_model_states.pt",
                                                         "vs_optim_pp_rank_00.pt"]
    engine.save_checkpoint(root)  # no tag: DeepSpeed's global_step<N>
    assert (tmp_path / "latest").read_text() == "global_step7"


@pytest.mark.parametrize("stop_after", [0, 1, 2])
def test_a_save_cut_off_keeps_latest_on_the_previous_tag_which_still_loads(gloo_world_of_one: None, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            stop_after: int) -> None:
    monkeypatch.setattr(commit_mod, "layout_of", lambda engine: LAYOUT)
    root = str(tmp_path)
    _Engine().save_checkpoint(root, "t1")
    with pytest.raises(SystemExit):
        _Engine(stop_after=stop_after).save_checkpoint(root, "t2")
    assert (tmp_path / "latest").read_text() == "t1" and (tmp_path / "t2" / MARKER).exists()
    assert checked_layout(root, "t1") is not None
    with pytest.raises(CheckpointError) as err:
        checked_layout(root, "t2")
    for needle in ["rank 0: checkpoint", "t2 cannot be loaded", "did not finish", "Nothing was loaded",
                   "Load the newest other tag whose save finished, 't1'"]:
        assert needle in str(err.value), str(err.value)


def test_saving_again_under_the_same_tag_gives_it_up_until_the_save_ends(gloo_world_of_one: None, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_mod, "layout_of", lambda engine: LAYOUT)
    root = str(tmp_path)
    _Engine().save_checkpoint(root, "t1")
    with pytest.raises(SystemExit):
        _Engine(stop_after=1).save_checkpoint(root, "t1")
    with pytest.raises(CheckpointError, match="No other tag in .* finished its save"):
        checked_layout(root, "t1")
    _Engine().save_checkpoint(root, "t1")
    assert checked_layout(root, "t1") is not None and os.listdir(tmp_path / "t1").count(LAYOUT_FILE) == 1


def test_a_damaged_file_is_refused_with_its_name_and_what_to_do(gloo_world_of_one: None, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commit_mod, "layout_of", lambda engine: LAYOUT)
    root = str(tmp_path)
    for tag in ("t1", "t2"):
        _Engine().save_checkpoint(root, tag)
    os.truncate(tmp_path / "t2" / "vs_optim_pp_rank_00.pt", 1)
    with pytest.raises(CheckpointError) as err:
        checked_layout(root, "t2")
    assert "vs_optim_pp_rank_00.pt has 1 bytes where the save wrote 6 (cut off" in str(err.value)
    assert "tag='t1'" in str(err.value) and "copy the directory of tag 't2' again" in str(err.value)
