"""Activation offload (``pipeline.offload``) and compute-wise sequence chunks
(``pipeline.seq_partition: compute``) in the engine: exact training.

One 2-rank and one 4-rank launch of the tiny transformers Llama (worker.run_hf_case): every
case trains two steps with clipping and compares losses and every parameter with the model's
own ``labels=`` training (fp32, 1e-5). Under split backward (zb-h1, v-zb, v-half) what B keeps
for W goes to host too, for the offloaded units whose W runs apart from their B: every rank
with such units must have moved some. The p=2 launch also runs offload with activation
checkpointing and ZeRO-2, a no-offload twin of the V-Half case and one whose W-kept tensors
stay on the device, for the memory comparisons, and the refusal of DeepSpeed's cpu_checkpointing. The sequence-chunk cases come last in each launch
(a failing chunked case times out a receive): 32- to 48-token sequences (37: any length), where the
causal cost makes the compute-wise chunks unequal, for seq1f1b and v-half, one with offload.
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_vshape.schedules.seq_partition import chunk_boundaries

from .launch import by_case, launch
from .test_engine import _assert_parity

pytestmark = pytest.mark.distributed
SCHEDULES = ("1f1b", "zb-h1", "v-zb", "v-half")
BASE = {"hf": "llama", "seq": True, "steps": 2, "m": 4}


def _case(name: str, schedule: str, p: int, share: float, **extra: Any) -> dict[str, Any]:
    pipeline = {"schedule": schedule, "offload": share, "measure_memory": True, **extra.pop("pipeline", {})}
    return {"name": name, **BASE, "schedule": schedule, "pipeline": pipeline, "p": p, **extra}


def _cases_p2() -> list[dict[str, Any]]:
    # Linear schedules offload every unit they can (share 1); V schedules their first chunk (0.5).
    cases = [_case(f"p2-{s}", s, 2, 0.5 if s.startswith("v-") else 1.0) for s in SCHEDULES]
    return cases + [
        _case("p2-v-half-none", "v-half", 2, 0.0),
        _case("p2-v-half-wdev", "v-half", 2, 0.5, w_on_device=True),
        # DeepSpeed's checkpoint keeps each block's inputs itself, out of the hooks' sight: offload
        # leaves them and stays exact (worker's plain blocks, 128 rows so tensors pass MIN_BYTES).
        {"name": "p2-zb-h1-ckpt", "schedule": "zb-h1", "p": 2, "m": 4, "ckpt": 1, "layerspec": True, "rows": [128],
         "pipeline": {"offload": 1.0, "measure_memory": True}},
        _case("p2-v-half-zero2", "v-half", 2, 0.5, zero=2),
        # auto, one candidate, a limit nothing meets: it runs the share with the least memory, from step 3 on.
        {"name": "p2-auto", **BASE, "steps": 4, "p": 2, "schedule": "auto",
         "pipeline": {"schedule": "auto", "auto_candidates": ["v-zb"], "memory_limit_bytes": 1.0, "offload": "auto",
                      "measure_memory": True}},
        _case("p2-refuse-cpu-ckpt", "1f1b", 2, 0.5, extra_config={"activation_checkpointing": {"cpu_checkpointing": True}}),
        *_chunked_p2(),
    ]


def _chunked_p2() -> list[dict[str, Any]]:
    # GPT-2 (learned positions, tied head) with offload: the chunks' K/V buffers stay on the device.
    return [_case("p2-seq1f1b-compute", "seq1f1b", 2, 0.0, seq_len=37, pipeline={"seq_partition": "compute"}),
            _case("p2-v-half-k3-compute-offload", "v-half", 2, 1.0, hf="gpt2", seq_len=40,
                  pipeline={"seq_chunks": 3, "seq_partition": "compute"})]


def _cases_p4() -> list[dict[str, Any]]:
    # Six blocks, so that the V schedules' 8 stages all get a layer; SDPA attention. Middle stages
    # of the chunked cases size their K/V buffers from chunk 0's length.
    return [_case(f"p4-{s}", s, 4, 0.5 if s.startswith("v-") else 1.0, blocks=6, attn="sdpa") for s in SCHEDULES] + [
        _case("p4-v-half-k4-compute", "v-half", 4, 0.0, blocks=6, attn="sdpa", seq_len=32,
              pipeline={"seq_chunks": 4, "seq_partition": "compute"}),
        _case("p4-seq1f1b-k4-compute", "seq1f1b", 4, 0.0, hf="gpt2", blocks=6, seq_len=48,
              pipeline={"seq_chunks": 4, "seq_partition": "compute"}),
    ]


@pytest.fixture(scope="module")
def results_p2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_cases_p2(), 2, tmp_path_factory.mktemp("offload_p2")))


@pytest.fixture(scope="module")
def results_p4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_cases_p4(), 4, tmp_path_factory.mktemp("offload_p4")))


def _check_offloaded(name: str, ranks: list[dict[str, Any]], *, idle: tuple[int, ...]) -> None:
    """Exact training, and activations moved to host on every rank but those in ``idle``."""
    _assert_parity(name, ranks)
    for rank, res in enumerate(ranks):
        assert res["params_compared"] > 0, f"{name} rank {rank}: no parameter compared"
    moved = [res["offloaded_units"] > 0 and res["peak_host_activation_bytes"] > 0 for res in ranks]
    assert moved == [r not in idle for r in range(len(ranks))], f"{name}: units offloaded per rank {moved}"
    planned = [res["w_planned"] > 0 for res in ranks]
    # 1F1B runs fused backward; the split schedules have a pass between some unit's B and its W on some
    # rank, and every such unit's W-kept tensors go (offloaded activations or not).
    assert any(planned) == ("1f1b" not in name), f"{name}: W-kept offload planned {planned}"
    w_moved = [res["w_offloaded_units"] > 0 for res in ranks]
    # Where the engine held W to w_memory by computing every parked weight gradient of the rank's
    # split stages in B (a head stage: its GEMM keeps more than half its activation), nothing is left to move.
    keeps = [not res["w_fit"] or any(after > 0 for *_, after in res["w_fit"].values()) for res in ranks]
    want = [p and k for p, k in zip(planned, keeps)]
    assert w_moved == want, f"{name}: W-kept tensors offloaded per rank {w_moved}, planned {planned}, W keeps some {keeps}"


def _idle(name: str, p: int) -> tuple[int, ...]:
    """Linear placement: the last rank's backward follows each forward at once, nothing to hide a copy
    behind. V at p=4: rank 0's first chunk is the embedding alone, which saves only token ids."""
    if not name.startswith(f"p{p}-v-"):
        return (p - 1,)
    return (0,) if p == 4 else ()


@pytest.mark.parametrize("case", [c["name"] for c in _cases_p2() if "refuse" not in c["name"] and "none" not in c["name"]
                                  and "ckpt" not in c["name"] and "compute" not in c["name"] and "auto" not in c["name"]
                                  and "wdev" not in c["name"]])
def test_offload_trains_exactly_p2(results_p2: dict, case: str) -> None:
    _check_offloaded(case, results_p2[case], idle=_idle(case, 2))


def test_offload_with_activation_checkpointing_is_exact(results_p2: dict) -> None:
    _assert_parity("p2-zb-h1-ckpt", results_p2["p2-zb-h1-ckpt"])


@pytest.mark.parametrize("case", [c["name"] for c in _cases_p4() if "compute" not in c["name"]])
def test_offload_trains_exactly_p4(results_p4: dict, case: str) -> None:
    _check_offloaded(case, results_p4[case], idle=_idle(case, 4))


@pytest.mark.parametrize("case", [c["name"] for c in _chunked_p2() + _cases_p4() if "compute" in c["name"]])
def test_compute_partition_trains_exactly(results_p2: dict, results_p4: dict, case: str) -> None:
    ranks = (results_p4 if case.startswith("p4-") else results_p2)[case]
    _assert_parity(case, ranks)
    cuts = [c for res in ranks for c in res["seq_cuts"]]
    lengths = {tuple(b - a for a, b in zip(c, c[1:])) for c in cuts}
    assert lengths and all(len(set(ls)) > 1 and list(ls) == sorted(ls, reverse=True) for ls in lengths), (case, lengths)
    # Not what an equal split of that length would give (with one token more or less per chunk).
    assert all(tuple(c) != chunk_boundaries(c[-1], len(c) - 1) for c in cuts), (case, cuts)
    if "offload" in case:
        _check_offloaded(case, ranks, idle=())


def test_offload_moves_device_bytes_to_host(results_p2: dict) -> None:
    """V-Half with its first chunk offloaded holds less on the device on every rank, and the same losses."""
    offloaded, plain = results_p2["p2-v-half"], results_p2["p2-v-half-none"]
    _assert_parity("p2-v-half-none", plain)
    for rank, (mine, theirs) in enumerate(zip(offloaded, plain)):
        assert mine["losses"] == theirs["losses"], f"rank {rank}: offload changed the losses"
        assert mine["peak_activation_bytes"] < theirs["peak_activation_bytes"], (rank, mine, theirs)
        assert theirs["peak_host_activation_bytes"] == 0


def test_w_kept_tensors_offloaded_cut_device_bytes(results_p2: dict) -> None:
    """The same V-Half plan with W's tensors kept on the device: the same losses to the bit, more on
    the device at the busiest rank's peak, less on the host; offloaded, the parked figure falls."""
    moved, kept = results_p2["p2-v-half"], results_p2["p2-v-half-wdev"]
    _assert_parity("p2-v-half-wdev", kept)
    for rank, (mine, theirs) in enumerate(zip(moved, kept)):
        assert mine["losses"] == theirs["losses"], f"rank {rank}: offloading W's tensors changed the losses"
        assert theirs["w_offloaded_units"] == 0 < mine["w_offloaded_units"], (rank, mine, theirs)
        assert mine["peak_activation_bytes"] <= theirs["peak_activation_bytes"], (rank, mine, theirs)
    busiest = max(theirs["peak_activation_bytes"] for theirs in kept)
    assert max(mine["peak_activation_bytes"] for mine in moved) < busiest
    assert sum(m["peak_host_activation_bytes"] for m in moved) > sum(k["peak_host_activation_bytes"] for k in kept)


def test_cpu_checkpointing_with_offload_is_refused(results_p2: dict) -> None:
    for res in results_p2["p2-refuse-cpu-ckpt"]:
        assert "cpu_checkpointing" in res.get("error", ""), res
        assert "pipeline.offload" in res["error"]


def test_auto_picks_an_offload_share_under_a_memory_limit(results_p2: dict) -> None:
    """Measured under v-min, then v-zb with the share the simulator gives the least memory, exactly."""
    ranks = results_p2["p2-auto"]
    _check_offloaded("p2-auto", ranks, idle=())
    for res in ranks:
        assert res["auto"]["name"] == "v-zb" and res["auto"]["offload"] >= 0.5, res["auto"]
