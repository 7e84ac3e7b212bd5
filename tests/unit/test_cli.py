"""The ``ds-vshape`` command line, run in-process through ``main``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_vshape.cli import main
from ds_vshape.schedules import Schedule, generate, get_info, schedule_names

_CONTRACT_KEYS = ["schedule", "stages", "micro_batches", "chunks_per_rank", "seq_chunks", "stage_to_rank", "ranks"]
_ACTION_KEYS = ["kind", "stage", "micro_batch", "seq_chunk"]


def _export(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["export", *args]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1  # exactly one line
    return out


def test_export_matches_contract_and_round_trips(capsys: pytest.CaptureFixture[str]) -> None:
    out = _export(capsys, "--schedule", "1f1b", "--stages", "4", "--micro-batches", "8")
    data = json.loads(out)
    assert list(data) == _CONTRACT_KEYS
    assert all(list(a) == _ACTION_KEYS for actions in data["ranks"] for a in actions)
    schedule = Schedule.from_dict(data)
    assert schedule == generate("1f1b", 4, 8)
    assert out == json.dumps(schedule.to_dict()) + "\n"


@pytest.mark.parametrize("name", schedule_names())
def test_export_every_schedule(capsys: pytest.CaptureFixture[str], name: str) -> None:
    info = get_info(name)
    m = max(16, info.min_micro_batches(4, info.chunks(None), 2 if info.seq_chunks else 1))
    out = _export(capsys, "-s", name, "-p", "4", "-m", str(m))
    schedule = Schedule.from_dict(json.loads(out))
    assert schedule.name and schedule.stages == 4 and schedule.micro_batches == m


def test_export_accepts_alias(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(_export(capsys, "-s", "one-f-one-b", "-p", "2", "-m", "2"))
    assert data["schedule"] == "1f1b"


def test_simulate_prints_table_and_writes_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    argv = ["simulate", "-s", "gpipe", "-p", "4", "-m", "8", "--t-b", "2", "--plot", str(png), "--trace", str(trace)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for word in ("makespan", "bubble rate", "peak memory", "1f1b", "ratio", "rank 3"):
        assert word in out
    assert "2.00x" in out  # gpipe holds 8 M_B on rank 0 against 1f1b's 4
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 4 * 16


def test_simulate_kept_until_w_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--kept-until-w", "1.5"]) == 2
    assert "kept-until-w" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_compare_lists_every_schedule(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    assert main(["compare", "--stages", "4", "--micro-batches", "16", "--format", fmt]) == 0
    out = capsys.readouterr().out
    first_cells = {line.strip("| ").split()[0] for line in out.splitlines()[2:]}
    assert first_cells == set(schedule_names())


def test_compare_passes_options_only_where_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "-p", "4", "-m", "16", "--chunks", "2", "--seq-chunks", "2", "--t-comm", "0.1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    gpipe = next(line for line in out.splitlines() if line.startswith("gpipe"))
    assert "does not" not in gpipe and "always uses" not in gpipe  # options dropped, not errors


def test_list_shows_names_and_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in schedule_names():
        assert name in out
    assert "one-f-one-b" in out


def test_bad_schedule_name_exits_2_with_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "-s", "no-such-schedule", "-p", "4", "-m", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert "no-such-schedule" in captured.err
    for name in schedule_names():
        assert name in captured.err


def test_too_few_micro_batches_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-s", "1f1b", "-p", "4", "-m", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "micro-batches" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["export", "-s", "1f1b"]) == 2  # missing --stages
    assert main(["compare", "-p", "4", "-m", "8", "--format", "html"]) == 2
    capsys.readouterr()
    assert main(["--help"]) == 0
    assert "simulate" in capsys.readouterr().out


def test_python_dash_m_entry_point() -> None:
    root = Path(__file__).resolve().parents[2]
    ok = subprocess.run([sys.executable, "-m", "ds_vshape", "export", "-s", "gpipe", "-p", "2", "-m", "2"],
                        cwd=root, capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["schedule"] == "gpipe"
    bad = subprocess.run([sys.executable, "-m", "ds_vshape", "export", "-s", "nope", "-p", "2", "-m", "2"],
                         cwd=root, capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "valid names" in bad.stderr


def test_compare_with_seq_chunks_uses_k_where_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-p", "4", "-m", "8", "--seq-chunks", "4"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    for name in schedule_names():
        assert rows[name][2] == ("4" if get_info(name).seq_chunks else "1"), name  # column k
    assert set(rows) == set(schedule_names())  # none skipped


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "v-half", "v-zb"])
def test_simulate_with_seq_chunks(capsys: pytest.CaptureFixture[str], name: str) -> None:
    assert main(["simulate", "-s", name, "-p", "4", "-m", "8", "--seq-chunks", "2"]) == 0
    assert f"{name}: p=4 m=8 v=" in (out := capsys.readouterr().out) and "k=2" in out


def test_simulate_prints_compute_partition(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "-s", "1f1b", "-p", "4", "-m", "8", "-k", "4", "--seq-partition", "compute",
            "--seq-len", "8192", "--hidden", "2048", "--heads", "16", "--ffn", "8192"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compute partition of 8192 tokens into 4 chunks" in out and "boundaries 0 " in out
    table = out.split("cost/layer  share\n")[1].split("\n\n")[0].splitlines()
    tokens = [int(line.split()[1]) for line in table]
    assert len(tokens) == 4 and sum(tokens) == 8192 and tokens == sorted(tokens, reverse=True)
    assert all(line.split()[3] == "25.0%" for line in table)


def test_seq_chunks_refused_by_other_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-s", "interleaved", "-p", "4", "-m", "8", "--seq-chunks", "2"]) == 2
    assert "does not cut sequences" in capsys.readouterr().err
