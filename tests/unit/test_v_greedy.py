"""V schedules for given pass costs: the greedy V orders (``v_greedy``) they weigh against their blocks, and ``pass_costs``."""

from __future__ import annotations

import pytest

from ds_vshape.cli import main as cli_main
from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.schedules import Costs, Schedule, generate, simulate, validate
from ds_vshape.schedules.generators.v_greedy import VGreedyPolicy, v_greedy_schedule
from ds_vshape.schedules.ir import Kind

# Costs a real stage has: B above F (attention's backward), W far below it (host-bound passes), a hop; with
# the share W keeps counted until W at 0 (the simulator's default), 1 (the config's default) and between.
COSTS = (Costs(f=1, b=1.14, w=0.39), Costs(f=1, b=2, w=1), Costs(f=1, b=1, w=0.5, comm=0.1),
         Costs(f=1, b=1.14, w=0.39, w_memory=1.0), Costs(f=1, b=2, w=1, w_memory=0.5))
UNEVEN = Costs(f=1, b=1.5, w=0.7, comm=0.05, stage_scale=(1.3, 1, 1, 0.8))


V_NAMES = ("v-zb", "v-half", "v-min", "v-adaptive")
BOUND = {"v-zb": lambda p: p, "v-half": lambda p: (p + 2) // 2, "v-min": lambda p: (p + 4) // 3, "v-adaptive": lambda p: p}


def _block(p: int, m: int, name: str = "v-zb", *, w_memory: float = 0.0) -> Schedule:
    return generate(name, p, m, costs=Costs(w_memory=w_memory))  # slot-model costs: the block's order for that share


def _within(schedule: Schedule, costs: Costs, bound: float) -> bool:
    """The V schedules' rule: the peak with the share ``w_memory`` held until W within the bound, and
    everything W keeps (the strictest count) within twice it."""
    return (simulate(schedule, costs).max_peak_memory <= bound + 1e-9
            and simulate(schedule, costs, kept_until_w=1.0).max_peak_memory <= 2 * bound + 1e-9)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("costs", COSTS, ids=str)
def test_every_greedy_order_is_valid_complete_and_within_its_memory(p: int, m: int, costs: Costs) -> None:
    built = 0
    for policy in VGreedyPolicy.grid():
        schedule = v_greedy_schedule(p, m, costs=costs, memory_limit=p, policy=policy)
        if schedule is None:
            continue
        built += 1
        validate(schedule)
        for rank, actions in enumerate(schedule.ranks):
            for stage in schedule.stages_of_rank(rank):
                for kind in (Kind.F, Kind.B, Kind.W):
                    assert sorted(a.micro_batch for a in actions if a.stage == stage and a.kind is kind) == list(range(m))
        assert _within(schedule, costs, p), policy
    assert built > 0


def test_a_policy_with_no_room_stalls_and_says_so() -> None:
    # Half an M_B of room: a first-chunk forward would leave none for the second chunk (reserve 1).
    assert v_greedy_schedule(2, 4, costs=Costs(), memory_limit=0.5, policy=VGreedyPolicy()) is None


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 8), (3, 6), (4, 16), (5, 10)])
def test_slot_model_costs_keep_the_papers_block(name: str, p: int, m: int) -> None:
    block = _block(p, m, name)
    for costs in (Costs(f=2, b=2, w=2), Costs(w_memory=0.5), Costs(stage_scale=(1.0,) * 2 * p)):
        kept = generate(name, p, m, costs=costs)
        assert kept.ranks == generate(name, p, m, costs=Costs(w_memory=costs.w_memory)).ranks and "picked" not in kept.params
    assert generate(name, p, m, costs=Costs(f=2, b=2, w=2)).ranks == block.ranks


def test_slot_model_costs_keep_the_block_even_where_a_greedy_order_is_faster() -> None:
    slot = Costs(f=2, b=2, w=2, w_memory=1.0)  # V-Half at p=6, m=6: a greedy order would save two slots
    greedy = min(simulate(s, slot).makespan for s in (v_greedy_schedule(6, 6, costs=slot, memory_limit=4, policy=pol)
                                                      for pol in VGreedyPolicy.grid()) if s is not None)
    kept = generate("v-half", 6, 6, costs=slot)
    assert greedy < simulate(kept, slot).makespan and kept.ranks == _block(6, 6, "v-half", w_memory=1.0).ranks


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (3, 6), (4, 8), (4, 16), (5, 10)])
@pytest.mark.parametrize("costs", COSTS, ids=str)
def test_for_costs_never_slower_than_the_block_and_within_its_bound(name: str, p: int, m: int, costs: Costs) -> None:
    chosen = generate(name, p, m, costs=costs)
    assert simulate(chosen, costs).makespan <= simulate(_block(p, m, name, w_memory=costs.w_memory), costs).makespan + 1e-9
    if "picked" in chosen.params:
        assert chosen.params["picked"].startswith("v-greedy") and chosen.name == name
        assert _within(chosen, costs, BOUND[name](p))
        assert chosen.params["peak_memory"] == simulate(chosen, costs).max_peak_memory
        assert chosen.params["w_memory"] == costs.w_memory and "block" not in chosen.params
    assert generate(name, p, m, costs=costs) == chosen  # deterministic: every rank builds the same order


def test_v_adaptive_searches_within_the_users_limit() -> None:
    costs = COSTS[4]
    picked = 0
    for limit in (2.0, 2.5, 3.0):
        chosen = generate("v-adaptive", 4, 16, memory_limit=limit, costs=costs)
        if "picked" in chosen.params:
            picked += 1
            assert _within(chosen, costs, limit)
        assert simulate(chosen, costs).makespan <= simulate(generate("v-adaptive", 4, 16, memory_limit=limit), costs).makespan + 1e-9
    assert picked >= 2  # B = 2 F: the blocks of the family idle where a greedy order within the limit does not


def test_uneven_stages_are_weighed_too() -> None:
    costs = UNEVEN
    chosen = generate("v-zb", 2, 8, costs=costs)
    assert chosen.params["picked"].startswith("v-greedy")
    assert simulate(chosen, costs).makespan < simulate(_block(2, 8, w_memory=costs.w_memory), costs).makespan


@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("costs", [COSTS[0], COSTS[1], COSTS[3]], ids=str)
def test_host_bound_and_backward_heavy_costs_get_a_shorter_step_than_the_block_and_1f1b(p: int, m: int, costs: Costs) -> None:
    """Where the slot model is wrong (W at 0.39 F, or B at 2 F), the block comes out at about 1F1B's
    step or behind it; the order for the costs is at least 7% shorter than the block and beats 1F1B."""
    block = simulate(_block(p, m, w_memory=costs.w_memory), costs).makespan
    chosen = simulate(generate("v-zb", p, m, costs=costs), costs).makespan
    one_f_one_b = simulate(generate("1f1b", p, m), costs).makespan
    assert chosen <= 0.93 * block
    assert chosen < one_f_one_b


def test_v_half_with_a_heavy_backward_leaves_its_block_far_behind() -> None:
    costs = COSTS[1]  # B = 2 F: V-Half's block idles 28% longer than 1F1B at p=4
    block, chosen = (simulate(s, costs).makespan for s in (_block(4, 16, "v-half", w_memory=costs.w_memory),
                                                             generate("v-half", 4, 16, costs=costs)))
    assert chosen <= 0.85 * block and chosen < simulate(generate("1f1b", 4, 16), costs).makespan


@pytest.mark.parametrize("name", ["v-zb", "v-half", "v-min"])
def test_sequence_chunks_keep_the_block(name: str) -> None:
    assert generate(name, 2, 4, seq_chunks=2, costs=COSTS[0]).ranks == generate(name, 2, 4, seq_chunks=2).ranks


def test_pass_costs_reach_the_schedule_and_are_refused_where_nothing_reads_them() -> None:
    keys = {"f": 1, "b": 1.14, "w": 0.39}
    cfg = parse_pipeline_config({"pipeline": {"schedule": "v-zb", "pass_costs": keys}})
    assert cfg.costs == Costs(f=1, b=1.14, w=0.39, w_memory=cfg.w_memory)
    assert cfg.make_schedule(2, 8) == generate("v-zb", 2, 8, costs=cfg.costs)
    assert cfg.make_schedule(2, 8).params["picked"].startswith("v-greedy")
    zb_auto = parse_pipeline_config({"pipeline": {"schedule": "zb-auto", "pass_costs": keys}})
    assert zb_auto.make_schedule(2, 8) == generate("zb-auto", 2, 8, costs=zb_auto.costs)
    fused = parse_pipeline_config({"pipeline": {"schedule": "zb-h2", "fuse_idle_w": True, "pass_costs": keys}})
    assert fused.make_schedule(2, 8) == generate("zb-h2", 2, 8, costs=fused.costs, fuse_idle_w=True)
    refused = {
        "1f1b": r"pipeline\.pass_costs applies only to the schedules that order for costs \(zb-auto, v-zb, v-half, v-min, v-adaptive\)",
        "auto": r"pipeline\.pass_costs does not apply with \"schedule\": \"auto\"",
        None: r"pipeline\.pass_costs is set but pipeline\.schedule is not",
    }
    for schedule, needle in refused.items():
        with pytest.raises(ConfigError, match=needle):
            parse_pipeline_config({"pipeline": {"schedule": schedule, "pass_costs": keys}})
    with pytest.raises(ConfigError, match=r"pipeline\.pass_costs: 'v-zb' orders for costs on whole sequences only, and "
                                          r"pipeline\.seq_chunks is 2; remove pass_costs or seq_chunks"):
        parse_pipeline_config({"pipeline": {"schedule": "v-zb", "seq_chunks": 2, "pass_costs": keys}})
    chunked = {"schedule": "zb-h2", "seq_chunks": 2, "fuse_idle_w": True, "pass_costs": keys}  # fusion reads them at any k
    assert parse_pipeline_config({"pipeline": chunked}).costs.b == 1.14
    for bad, needle in (({**keys, "t_w": 1}, r"pipeline\.pass_costs\.t_w"), ({**keys, "b": 0}, r"pipeline\.pass_costs\.b"),
                        ({"f": 1, "b": 1}, r"pipeline\.pass_costs\.w"), ({**keys, "w": float("inf")}, r"pipeline\.pass_costs\.w")):
        with pytest.raises(ConfigError, match=needle):
            parse_pipeline_config({"pipeline": {"schedule": "v-zb", "pass_costs": bad}})


def test_cli_shows_the_order_for_the_costs(capsys: pytest.CaptureFixture[str]) -> None:
    cli_main(["export", "-s", "v-zb", "-p", "2", "-m", "8", "--t-b", "1.14", "--t-w", "0.39"])
    assert Schedule.from_json(capsys.readouterr().out) == generate("v-zb", 2, 8, costs=Costs(b=1.14, w=0.39))  # --w-memory 0
    cli_main(["simulate", "-s", "v-zb", "-p", "2", "-m", "8", "--t-b", "1.14", "--t-w", "0.39"])
    assert "; ordered for these costs: v-greedy-" in capsys.readouterr().out.splitlines()[0]
    cli_main(["simulate", "-s", "v-zb", "-p", "2", "-m", "8"])
    assert "ordered for these costs" not in capsys.readouterr().out


def test_auto_predicts_from_the_order_its_measuring_steps_ran() -> None:
    """The step's time beyond the passes is measured against the measuring schedule as it ran (made
    before any cost was known), not against the order the measured costs would give it now."""
    from ds_vshape.schedules.auto import AutoSettings, Measured, make_chosen, pick, to_costs

    settings = AutoSettings(placement="v", names=("v-zb",), w_memory=1.0)
    measured = Measured(f=(1.0,) * 4, b=(1.14,) * 4, w=(0.39,) * 4, activation_bytes=(1.0,) * 4)
    costs = to_costs(measured, chunks_per_rank=2, w_memory=1.0)
    ran = generate(settings.safe, 2, 8, costs=Costs(w_memory=1.0))  # what the measuring steps ran: v-min's block
    assert ran.ranks != generate(settings.safe, 2, 8, costs=costs).ranks  # the costs would reorder it
    step = simulate(ran, costs).makespan  # a step with no time outside the passes
    choice = pick(settings, Measured(**{**measured.__dict__, "step": step}), stages=2, micro_batches=8)
    chosen = make_chosen(choice, settings, stages=2, micro_batches=8)
    assert chosen.params["picked"].startswith("v-greedy")
    assert choice.predicted_s == simulate(chosen, costs).makespan  # no overhead invented


def test_pass_costs_measure_runs_the_named_schedule_then_its_order_for_the_measured_costs() -> None:
    """'measure': the engine starts with the schedule's equal-cost order and is handed auto's settings with the
    schedule as its own only candidate, measured under itself; what pick returns is its order for the costs."""
    from ds_vshape.schedules.auto import Measured, make_chosen, pick

    cfg = parse_pipeline_config({"pipeline": {"schedule": "v-zb", "pass_costs": "measure", "auto_warmup_steps": 3}})
    assert cfg.measures and cfg.costs == Costs(w_memory=cfg.w_memory)
    assert cfg.make_schedule(2, 8) == generate("v-zb", 2, 8, costs=Costs(w_memory=cfg.w_memory))  # the block first
    settings = cfg.auto_settings(zero_stage=1, stages=2, micro_batches=8)
    assert (settings.names, settings.safe, settings.placement, settings.warmup_steps) == (("v-zb",), "v-zb", "v", 3)
    assert settings.label == "schedule 'v-zb' with pass_costs 'measure'"
    measured = Measured(f=(1.0,) * 4, b=(1.14,) * 4, w=(0.39,) * 4, activation_bytes=(1.0,) * 4)
    choice = pick(settings, measured, stages=2, micro_batches=8)
    assert choice.name == "v-zb" and [c.name for c in choice.table] == ["v-zb"]
    assert make_chosen(choice, settings, stages=2, micro_batches=8).params["picked"].startswith("v-greedy")
    bounded = parse_pipeline_config({"pipeline": {"schedule": "v-adaptive", "memory_limit": 3, "pass_costs": "measure"}})
    assert bounded.auto_settings(zero_stage=0, stages=4, micro_batches=8).warmup_limit == 3
    linear = parse_pipeline_config({"pipeline": {"schedule": "zb-auto", "pass_costs": "measure"}})
    assert linear.auto_settings(zero_stage=0, stages=2, micro_batches=8).placement == "linear"
    assert not parse_pipeline_config({"pipeline": {"schedule": "v-zb"}}).measures
    refused = {
        (("schedule", "v-zb"), ("pass_costs", "mesure")): r"pipeline\.pass_costs: takes 'measure' or the pass times",
        (("schedule", "v-zb"), ("pass_costs", "measure"), ("fuse_idle_w", True)):
            r"pipeline\.pass_costs 'measure' does not apply with pipeline\.fuse_idle_w true",
        (("schedule", "zb-h2"), ("pass_costs", "measure")): r"pipeline\.pass_costs 'measure' applies only to the schedules "
                                                             r"that order for costs \(zb-auto, v-zb, v-half, v-min, "
                                                             r"v-adaptive\); 'zb-h2' ignores them: remove pass_costs",
        (("schedule", "auto"), ("pass_costs", "measure")): r"pipeline\.pass_costs does not apply with \"schedule\": \"auto\"",
        (("schedule", "v-zb"), ("pass_costs", "measure"), ("seq_chunks", 2)): r"orders for costs on whole sequences only",
        (("schedule", "v-zb"), ("auto_warmup_steps", 3)): r"pipeline\.auto_warmup_steps applies only with \"schedule\": "
                                                           r"\"auto\" \(auto_warmup_steps also with pipeline\.pass_costs",
        (("schedule", "v-zb"), ("pass_costs", "measure"), ("auto_candidates", ("v-min",))): r"pipeline\.auto_candidates applies only",
    }
    for keys, needle in refused.items():
        with pytest.raises(ConfigError, match=needle):
            parse_pipeline_config({"pipeline": dict(keys)})


def test_a_restored_choice_runs_only_where_the_resumed_config_could_have_made_it() -> None:
    """A checkpoint's choice against the resumed job's settings: another candidate list, memory limit, w_memory or
    offload share means measuring again (``choice_fits``), not running what the saving job's config chose."""
    from ds_vshape.schedules.auto import Measured, choice_fits, pick

    def settings(pipeline: dict) -> object:
        return parse_pipeline_config({"pipeline": pipeline}).auto_settings(zero_stage=0, stages=2, micro_batches=8)

    measured = Measured(f=(1.0,) * 4, b=(1.14,) * 4, w=(0.39,) * 4, activation_bytes=(1.0,) * 4)
    auto = settings({"schedule": "auto", "auto_candidates": ["v-half", "v-zb"], "w_memory": 1.0})
    choice = pick(auto, measured, stages=2, micro_batches=8)
    fits = lambda other: choice_fits(choice, other, stages=2, micro_batches=8)  # noqa: E731
    assert fits(auto) and fits(settings({"schedule": "auto", "w_memory": 1.0}))
    assert fits(settings({"schedule": choice.name, "pass_costs": "measure", "w_memory": 1.0}))
    other = next(n for n in ("v-half", "v-zb") if n != choice.name)
    assert not fits(settings({"schedule": other, "pass_costs": "measure", "w_memory": 1.0}))
    assert not fits(settings({"schedule": "auto", "auto_candidates": [other], "w_memory": 1.0}))
    assert not fits(settings({"schedule": "auto", "w_memory": 0.5}))
    assert not fits(settings({"schedule": "auto", "w_memory": 1.0, "offload": 0.5}))
    adaptive = settings({"schedule": "v-adaptive", "pass_costs": "measure", "memory_limit": 2, "w_memory": 1.0})
    bounded = pick(adaptive, measured, stages=2, micro_batches=8)
    assert bounded.memory_limit == 2 and choice_fits(bounded, adaptive, stages=2, micro_batches=8)
    tighter = settings({"schedule": "v-adaptive", "pass_costs": "measure", "memory_limit": 1.5, "w_memory": 1.0})
    assert not choice_fits(bounded, tighter, stages=2, micro_batches=8)
