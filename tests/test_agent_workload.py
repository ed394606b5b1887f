"""Fast checks of the agent-workload benchmark's generator, sizing and metrics (no stack)."""

from __future__ import annotations

import argparse
import math
import statistics

import pytest

from kvtier.controller.prefetch import Outcome, PauseOutcome, PrefetchStats
from kvtier.domain.tiers import Tier
from loadtests.agent_calibration import MachineSpeed, calibrate
from loadtests.agent_workload import (
    CPU_LINK_BYTES_PER_S,
    DEFAULT_SEEDS,
    EMULATED_LINK_BYTES_PER_S,
    WORKLOAD_MODEL_CONFIG,
    TurnRecord,
    WorkloadSpec,
    _page_bytes,
    _policy_options,
    across_seeds,
    build_parser,
    emulated_link_summary,
    hbm_pages_for,
    headline,
    hold_demand,
    join_outcomes,
    make_workload,
    orchestrator_params,
    parse_hbm_sessions,
    parse_hold_fraction,
    parse_link_gbps,
    parse_seeds,
    parse_slow_down,
    parse_tools,
    pct,
    prefetch_summary,
    saturation,
    seeds_of,
    seeds_table,
    spec_from_args,
    summarize,
    targets,
    tenant_tools,
    warm_history,
    with_retaken,
    with_unseen_waste,
    worker_counted_waste,
)


def test_workload_is_deterministic_and_bounded() -> None:
    spec = WorkloadSpec.quick()
    a, b = make_workload(spec, 4096), make_workload(spec, 4096)
    assert a == b
    assert make_workload(WorkloadSpec(seed=1), 4096) != make_workload(WorkloadSpec(), 4096)
    assert len(a.sessions) == spec.num_tenants * spec.sessions_per_tenant
    for plan in a.sessions:
        assert len(plan.turns) == spec.turns
        assert plan.turns[-1].tool is None
        assert all(t.tool and t.tool_ms > 0 for t in plan.turns[:-1])
    assert a.working_set_pages() > 0


def test_hbm_is_under_pressure_and_recompute_costs_more_than_the_lower_tier() -> None:
    """What makes the comparison mean something: the sessions' pages do not all fit in HBM,
    and bringing a context back from the lower tier is cheaper than recomputing it, by the
    orchestrator's own cost model (so it parks rather than keeps everything)."""
    for spec in (WorkloadSpec.quick(), WorkloadSpec()):
        workload = make_workload(spec, WORKLOAD_MODEL_CONFIG["vocab_size"])
        hbm = hbm_pages_for(spec, workload)
        session_pages = math.ceil(workload.max_context_tokens() / spec.page_size)
        assert 2 * session_pages < hbm < 0.6 * workload.working_set_pages()
        params = orchestrator_params(spec)
        page_bytes = _page_bytes(WORKLOAD_MODEL_CONFIG, spec.page_size)
        assert params.cost_model.page_bytes == page_bytes
        promote_s = session_pages * page_bytes / params.bandwidth_bytes_per_s[(Tier.NVME, Tier.HBM)]
        assert promote_s < params.cost_model.prefix_recompute_s(session_pages) / 3
    # A resumed turn adds far less than its context: its prefill is short, the context is not.
    spec = WorkloadSpec()
    assert spec.tool_result_tokens + spec.max_tokens < (spec.system_prompt_tokens + spec.user_tokens) / 8


def _rec(turn: int, ttft: float, cacheable: int, cached: int, recomputed: int = 0, promoted: int = 0,
         session: str = "t/s0") -> TurnRecord:
    return TurnRecord("p", session, turn, 100, cacheable, cached, promoted, recomputed, ttft)


def test_summarize_and_headline() -> None:
    records = [_rec(0, 500.0, 0, 0), _rec(1, 100.0, 96, 96), _rec(2, 300.0, 160, 128, recomputed=5, promoted=32)]
    s = summarize(records)
    assert s["resume_ttft_ms"]["p50"] in (100.0, 300.0)
    assert s["recomputed_tokens"] == 32 + 5
    assert s["resumes_promoting"] == 1 and s["resume_promoted_tokens"] == 32
    assert s["resume_ttft_ms_samples"] == [100.0, 300.0]
    stats = PrefetchStats(num_demoted=4, demoted_bytes=40, num_prefetched=4, prefetched_bytes=40,
                          num_on_time=3, on_time_bytes=30, num_late=1, late_bytes=10)
    stats.count_waste("evicted", 2)
    pf = prefetch_summary(stats)
    assert pf["on_time_fraction"] == 0.75 and pf["wasted_fraction"] == 0.05
    assert pf["wasted_bytes_by_reason"] == {"evicted": 2}
    policies = {"kvtier": {"resume_ttft_ms": {"p50": 110.0}, "prefetch": pf},
                "infinite-hbm": {"resume_ttft_ms": {"p50": 100.0}},
                "reactive": {"resume_ttft_ms": {"p50": 200.0}}}
    head = headline(policies)
    assert abs(head["kvtier_over_infinite_hbm"] - 1.1) < 1e-9 and head["kvtier_over_reactive"] == 0.55
    assert head["infinite_hbm_over_reactive"] == 0.5  # the least kvtier_over_reactive within reach
    met = targets(head)
    assert met["kvtier_over_infinite_hbm<=1.1"] and not met["kvtier_over_reactive<=0.5"]
    assert met["prefetch_on_time>=0.95"] is False and met["wasted_prefetch<=0.10"] is True
    # Nothing parked, nothing to score: not a met target.
    assert targets(headline({"kvtier": {"prefetch": prefetch_summary(PrefetchStats())}}))["wasted_prefetch<=0.10"] is None


def test_resume_split_tells_promoting_resumes_from_the_fixed_cost_of_the_others() -> None:
    def resume(ttft: float, worker: float, promoted: int = 0) -> TurnRecord:
        return TurnRecord("p", "t/s0", 1, 100, 96, 96, promoted, 0, ttft, worker)

    records = [TurnRecord("p", "t/s0", 0, 100, 0, 0, 0, 0, 900.0, 890.0),  # a first turn: not a resume
               resume(30.0, 25.0), resume(34.0, 28.0), resume(31.0, 24.0), resume(200.0, 190.0, promoted=64)]
    split = summarize(records)["resume_ttft_ms_by_promotion"]
    assert split["promoting"] == {"n": 1, "p50": 200.0}
    assert split["not_promoting"] == {"n": 3, "p50": 31.0, "worker_p50": 25.0, "outside_worker_p50": 6.0}


def test_waste_the_controller_did_not_see_is_counted_from_the_turns() -> None:
    """A prefetch's pages given up just before the turn look in HBM to the controller (its
    directory lags the worker): the turn that promoted them again is the evidence. Each pause
    adds what its turn promoted beyond what the controller counted, up to the pages the
    prefetch brought up (a guard that moved nothing wasted nothing)."""
    MiB = 1 << 20

    def pause(session: str, tier: Tier, num_pages: int, wasted: int, lead_ms: float | None) -> PauseOutcome:
        return PauseOutcome(session, "t", tier, num_pages, num_pages * MiB, Outcome.ON_TIME, wasted, 900.0, 900.0,
                            None, lead_ms)

    records = [_rec(1, 60.0, 96, 96, promoted=48, session="a/s0"),  # 3 pages promoted
               _rec(1, 60.0, 96, 96, promoted=96, session="a/s1"),  # 6, but its prefetch moved 4
               _rec(1, 60.0, 96, 96, promoted=32, session="a/s2"),  # a kept session's guard moved none
               _rec(1, 60.0, 96, 96, promoted=64, session="a/s3")]  # the prefetch was late
    outcomes = [pause("a/s0", Tier.DRAM, 5, 1 * MiB, 300.0), pause("a/s1", Tier.DRAM, 4, 0, 50.0),
                pause("a/s2", Tier.HBM, 0, 0, 800.0), pause("a/s3", Tier.DRAM, 6, 0, None)]
    joined = join_outcomes(records, outcomes, page_size=16, page_bytes=MiB)
    assert joined["wasted_bytes_unseen_by_controller"] == (3 - 1 + 4) * MiB
    stats = PrefetchStats(num_prefetched=4, prefetched_bytes=20 * MiB)
    stats.count_waste("evicted", 1 * MiB)
    pf = with_unseen_waste({**with_retaken(prefetch_summary(stats), 0, 0), **joined})
    assert pf["wasted_bytes"] == 7 * MiB and pf["wasted_fraction"] == pytest.approx(7 / 20)
    assert pf["wasted_bytes_by_reason"] == {"evicted": 1 * MiB, "unseen": 6 * MiB}
    seen = {**with_retaken(prefetch_summary(stats), 0, 0), "wasted_bytes_unseen_by_controller": 0}
    assert with_unseen_waste(seen)["wasted_fraction"] == pytest.approx(1 / 20)


def test_retaken_holds_count_as_prefetched_and_wasted_bytes() -> None:
    """A hold the worker retook looks unwasted to the controller: the benchmark adds the bytes
    moved up again to the prefetched ones, and those a prefetch had moved up before (they went
    down unused) to the wasted ones."""
    stats = PrefetchStats(num_prefetched=4, prefetched_bytes=100)
    stats.count_waste("evicted", 10)
    pf = with_retaken(prefetch_summary(stats), 25, 20)
    assert pf["prefetched_bytes"] == 125 and pf["wasted_bytes"] == 30 and pf["retaken_bytes"] == 25
    assert pf["wasted_fraction"] == pytest.approx(30 / 125)
    assert pf["wasted_bytes_by_reason"] == {"evicted": 10, "retaken": 20}
    assert targets(headline({"kvtier": {"prefetch": pf}}))["wasted_prefetch<=0.10"] is False
    guards = with_retaken(prefetch_summary(stats), 25, 0)  # guards' pages: moved up once, used
    assert guards["wasted_fraction"] == pytest.approx(10 / 125) and "retaken" not in guards["wasted_bytes_by_reason"]
    assert with_retaken({}, 25, 20) == {}  # a policy without hints has no prefetch numbers


def test_the_workers_own_count_of_waste_is_reported_in_bytes() -> None:
    counted = worker_counted_waste({"session_prefetched_pages": 40, "session_prefetch_wasted_pages": 6}, 1024)
    assert counted == {"moved_bytes": 40 * 1024, "wasted_bytes": 6 * 1024, "wasted_fraction": 0.15}
    assert worker_counted_waste({}, 1024) == {"moved_bytes": 0, "wasted_bytes": 0, "wasted_fraction": None}
    # The headline's waste is the worker's count where the run has one, the controller's otherwise.
    stats = PrefetchStats(num_prefetched=4, prefetched_bytes=40 * 1024)
    stats.count_waste("evicted", 2 * 1024)
    pf = prefetch_summary(stats)
    assert headline({"kvtier": {"prefetch": pf}})["wasted_prefetch_fraction"] == pytest.approx(0.05)
    pf["worker_counted"] = counted
    assert headline({"kvtier": {"prefetch": pf}})["wasted_prefetch_fraction"] == 0.15
    assert targets(headline({"kvtier": {"prefetch": pf}}))["wasted_prefetch<=0.10"] is False


def test_across_seeds_pools_every_resume_prefetch_and_byte() -> None:
    def policies(kv: list[float], inf: list[float], on_time: int, late: int, moved: int, wasted: int,
                 counted: bool = True) -> dict:
        prefetch = {"num_on_time": on_time, "num_late": late, "prefetched_bytes": moved * 2, "wasted_bytes": 0}
        if counted:
            prefetch["worker_counted"] = {"moved_bytes": moved, "wasted_bytes": wasted,
                                          "wasted_fraction": wasted / moved}
        return {"kvtier": {"resume_ttft_ms_samples": kv, "prefetch": prefetch},
                "infinite-hbm": {"resume_ttft_ms_samples": inf, "prefetch": {}}}

    def run(pols: dict) -> dict:
        head = headline({name: {**p, "resume_ttft_ms": {"p50": pct(p["resume_ttft_ms_samples"], 0.5)}}
                         for name, p in pols.items()})
        return {**head, "targets_met": targets(head), "policies": pols}

    # Seed 0: few resumes, all fast, 1 of 10 late, 1 of 4 bytes wasted; seed 1: many, slower.
    small = policies([100.0, 100.0, 100.0], [100.0, 100.0, 100.0], 9, 1, 400, 100)
    large = policies([120.0] * 5 + [130.0] * 4, [110.0] * 9, 90, 0, 3600, 0)
    summary = across_seeds({0: run(small), 1: run(large)})
    assert summary["wasted_prefetch_fraction"]["per_seed"] == [0.25, 0.0]
    assert summary["wasted_prefetch_fraction"]["median"] == 0.125  # each seed weighs the same
    pooled = summary["pooled"]
    assert pooled["wasted_prefetch_fraction"] == pytest.approx(100 / 4000)  # each byte does
    assert pooled["prefetch_on_time"] == pytest.approx(99 / 100)
    # The p50 of the 12 resumes together (the 7th smallest of kvtier's: 120) over infinite HBM's (110).
    assert pooled["kvtier_over_infinite_hbm"] == pytest.approx(120 / 110)
    assert pooled["targets_met"]["wasted_prefetch<=0.10"] is True
    assert pooled["targets_met"]["kvtier_over_infinite_hbm<=1.1"] is True
    assert pooled["targets_met"]["kvtier_over_reactive<=0.5"] is None  # no reactive run to compare with
    assert "pooled targets: " in seeds_table(summary) and "wasted_prefetch_fraction 0.025" in seeds_table(summary)
    # Without the worker's count in every run, the controller's bytes pool instead.
    uncounted = policies([100.0], [100.0], 1, 0, 1000, 0, counted=False)
    assert across_seeds({0: run(small), 1: run(uncounted)})["pooled"]["wasted_prefetch_fraction"] == 0.0


def test_across_seeds_reports_each_seed_and_the_median_of_those_measured() -> None:
    def run(over_inf: float, over_reactive: float | None, on_time: float | None) -> dict:
        head = {"kvtier_over_infinite_hbm": over_inf, "kvtier_over_reactive": over_reactive,
                "prefetch_on_time": on_time, "wasted_prefetch_fraction": None,
                "infinite_hbm_over_reactive": None if over_reactive is None else over_reactive / over_inf}
        return {**head, "targets_met": targets(head)}

    summary = across_seeds({2: run(1.5, 0.4, 0.9), 0: run(1.0, 0.6, None), 1: run(1.2, None, 1.0)})
    assert summary["seeds"] == [0, 1, 2]
    assert summary["kvtier_over_infinite_hbm"] == {"per_seed": [1.0, 1.2, 1.5], "median": 1.2}
    assert summary["kvtier_over_reactive"] == {"per_seed": [0.6, None, 0.4], "median": 0.5}  # of the two measured
    assert summary["prefetch_on_time"]["median"] == pytest.approx(0.95)
    assert summary["wasted_prefetch_fraction"] == {"per_seed": [None, None, None], "median": None}
    assert summary["targets_met"]["kvtier_over_infinite_hbm<=1.1"] == [True, False, False]
    assert summary["targets_met"]["prefetch_on_time>=0.95"] == [None, True, False]
    text = seeds_table(summary)
    assert "1.00 / 1.20 / 1.50   median 1.20" in text
    assert "prefetch_on_time>=0.95: met in 1 of 3 (1 not measurable)" in text
    # Seed 0: infinite HBM itself at 0.6x reactive, so no policy could meet that target there.
    assert summary["infinite_hbm_over_reactive"]["per_seed"][0] == pytest.approx(0.6)
    assert "kvtier_over_reactive<=0.5: met in 1 of 3 (1 not measurable); out of reach in 1 " in text


def test_seeds_flag_takes_distinct_non_negative_integers() -> None:
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("7") == [7]
    for bad in ("0,x", "1,1", "-1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
            parse_seeds(bad)


def test_tools_span_sub_second_to_tens_of_seconds_and_a_short_mix_can_be_drawn() -> None:
    """The default mix has the issue's long end (a test suite of ~10 s, the longest runs past
    15 s) beside sub-second searches, for every tenant; ``--tools`` restricts the mix, and the
    three short tools alone give each tenant only tools of a few seconds."""
    vocab = WORKLOAD_MODEL_CONFIG["vocab_size"]
    durations: dict[str, list[float]] = {}
    for plan in make_workload(WorkloadSpec(), vocab).sessions:
        for turn in plan.turns[:-1]:
            durations.setdefault(turn.tool, []).append(turn.tool_ms)
    assert set(durations) == {"search", "code_exec", "browse", "test_suite"}
    assert min(durations["search"]) < 1_000 and max(durations["test_suite"]) > 15_000
    assert statistics.median(durations["search"]) < 1_000 < 5_000 < statistics.median(durations["test_suite"])
    tenants = {}
    for plan in make_workload(WorkloadSpec(), vocab).sessions:
        tenants.setdefault(plan.tenant, set()).update(t.tool for t in plan.turns[:-1])
    assert all("test_suite" in tools for tools in tenants.values())
    assert "browse" not in tenants["tenant-a"] and "browse" not in tenants["tenant-c"]

    short = WorkloadSpec(tools=("search", "code_exec", "browse"))
    assert [t.name for t in tenant_tools(short, 0)] == ["search", "code_exec"]
    assert [t.name for t in tenant_tools(short, 1)] == ["search", "code_exec", "browse"]
    drawn = {t.tool for p in make_workload(short, vocab).sessions for t in p.turns[:-1]}
    assert drawn == {"search", "code_exec", "browse"}
    # A tenant none of whose own tools is selected draws from those selected.
    only_browse = WorkloadSpec(tools=("browse",))
    assert {t.tool for p in make_workload(only_browse, vocab).sessions for t in p.turns[:-1]} == {"browse"}
    assert parse_tools("search,test_suite") == ("search", "test_suite")
    for bad in ("", "search,search", "grep", "search,,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--tools"):
            parse_tools(bad)


def test_hbm_sessions_flag_takes_a_positive_number_and_sizes_hbm() -> None:
    assert parse_hbm_sessions("7") == 7.0 and parse_hbm_sessions("2.5") == 2.5
    for bad in ("0", "-3", "nan", "inf", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--hbm-sessions"):
            parse_hbm_sessions(bad)
    spec = WorkloadSpec()
    workload = make_workload(spec, WORKLOAD_MODEL_CONFIG["vocab_size"])
    five = hbm_pages_for(spec, workload)
    spec.hbm_sessions = 7.0
    assert abs(hbm_pages_for(spec, workload) - five * 7 / 5) <= 1  # whole pages, rounded up once


def test_hold_fraction_flag_takes_a_share_of_hbm_and_reaches_every_worker(tmp_path) -> None:
    assert parse_hold_fraction("1") == 1.0 and parse_hold_fraction("0.85") == 0.85
    for bad in ("0", "-0.5", "1.2", "nan", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--hold-fraction"):
            parse_hold_fraction(bad)
    spec = WorkloadSpec.quick()
    workload = make_workload(spec, WORKLOAD_MODEL_CONFIG["vocab_size"])
    default, _ = _policy_options("kvtier", spec, workload, tmp_path / "model", tmp_path)
    assert default.session_hold_fraction is None  # the worker's own default
    spec.hold_fraction = 0.85
    for policy in ("reactive", "kvtier", "infinite-hbm"):
        options, _ = _policy_options(policy, spec, workload, tmp_path / "model", tmp_path)
        assert options.session_hold_fraction == 0.85


def test_pauses_join_the_turns_they_preceded() -> None:
    """The k-th closed pause of a session precedes its turn k + 1; a prefetch acknowledged
    before the turn that still promoted pages is the client's evidence of waste."""

    def pause(session: str, outcome: str, lead_ms: float | None) -> PauseOutcome:
        return PauseOutcome(session, "search", Tier.NVME, 4, 4 << 20, outcome, 0, 500.0, 520.0, None, lead_ms)

    records = [
        _rec(0, 300.0, 0, 0, session="a/s0"), _rec(1, 40.0, 64, 64, session="a/s0"),
        _rec(2, 90.0, 80, 80, promoted=32, session="a/s0"),
        _rec(0, 310.0, 0, 0, session="a/s1"), _rec(1, 95.0, 64, 64, promoted=64, session="a/s1"),
    ]
    outcomes = [pause("a/s0", Outcome.ON_TIME, 200.0), pause("a/s1", Outcome.LATE, None),
                pause("a/s0", Outcome.ON_TIME, 150.0)]
    joined = join_outcomes(records, outcomes, page_size=16, page_bytes=1 << 20)
    by = joined["resume_ttft_ms_by_prefetch"]
    assert by["on_time"]["n"] == 2 and by["on_time"]["promoting"] == 1
    assert by["late"] == {"n": 1, "p50": 95.0, "p99": 95.0, "promoting": 1}
    assert joined["client_resumes_promoting_after_prefetch"] == 1  # a/s0's turn 2
    assert joined["client_promoted_bytes_after_prefetch"] == 2 << 20
    assert joined["wasted_bytes_unseen_by_controller"] == 2 << 20  # the controller counted none of it
    assert joined["prefetch_lead_ms"]["p50"] in (150.0, 200.0)


def test_hold_demand_counts_what_hbm_had_to_keep_for_the_sessions_due_back() -> None:
    """A session kept in HBM needs its pages there for its whole pause; one prefetched, from
    the moment they were back to its turn; one whose prefetch was late, not at all. A tenant's
    shared system prompt counts once however many of its sessions are due back."""

    def turn(session: str, sent_at_s: float, pages: int) -> TurnRecord:
        return TurnRecord("kvtier", session, 1, pages * 16 + 16, pages * 16, pages * 16, 0, 0, 30.0,
                          sent_at_s=sent_at_s)

    def pause(session: str, tier: Tier, outcome: str, actual_ms: float, lead_ms: float | None) -> PauseOutcome:
        return PauseOutcome(session, "t", tier, 0, 0, outcome, 0, actual_ms, actual_ms, None, lead_ms)

    records = [turn("a/s0", 1.0, 6), turn("a/s1", 1.1, 5), turn("b/s0", 1.05, 9)]
    outcomes = [
        pause("a/s0", Tier.HBM, Outcome.KEPT, 500.0, None),  # 2 shared + 4 private, 0.5-1.0 s
        pause("a/s1", Tier.NVME, Outcome.ON_TIME, 800.0, 200.0),  # 2 shared + 3 private, 0.9-1.1 s
        pause("b/s0", Tier.NVME, Outcome.LATE, 700.0, None),  # promoted on arrival: nothing held
    ]
    tenants = {"a/s0": "a", "a/s1": "a", "b/s0": "b"}
    demand = hold_demand(records, outcomes, tenant_of=tenants, shared_pages=2, page_size=16,
                         cap_pages=6.0, hbm_pages=8)
    assert demand is not None
    # 0.5-0.9 s: 6 pages; 0.9-1.0 s: 2 + 4 + 3 = 9 (over the cap and HBM; 11 if the shared
    # prompt counted per session); 1.0-1.1 s: 5.
    assert demand["max_pages"] == 9 and demand["p50_pages"] == 6
    assert demand["over_cap_share"] == pytest.approx(1 / 6, abs=0.02)
    assert demand["cap_pages"] == 6 and demand["hbm_pages"] == 8
    # With the turns in flight (prompt pages to first token, 30 ms each): a/s0's turn at
    # 1.0-1.03 s adds its 7 pages (5 private) to a/s1's held 5 (a's prompt once): 10 > HBM;
    # b/s0's at 1.05-1.08 s its 10 (2 shared of its own): 5 + 10 = 15.
    assert demand["with_running_max_pages"] == 15
    assert demand["with_running_over_hbm_share"] == pytest.approx((10 + 3 + 3) / 60, abs=0.03)
    # Only late prefetches: nothing was held.
    assert hold_demand(records, outcomes[2:], tenant_of=tenants, shared_pages=2, page_size=16,
                       cap_pages=6.0, hbm_pages=8) is None


def test_link_emulation_keeps_the_gpu_ratio_and_reaches_every_policy(tmp_path) -> None:
    """--emulate-link: PCIe and NVMe at a GPU's ratio to the memory attention reads (3 TB/s :
    25 GB/s : 7 GB/s), every policy's workers get it, the planner uses it, the result says so."""
    rates = EMULATED_LINK_BYTES_PER_S
    assert rates["dram"] / rates["nvme"] == pytest.approx(25 / 7)
    assert 100 < 28e9 / rates["dram"] < 400 and 100 < 28e9 / rates["nvme"] < 500
    plain = WorkloadSpec.quick()
    assert emulated_link_summary(plain) is None
    emulated = WorkloadSpec.quick()
    emulated.emulated_link_bytes_per_s = dict(rates)
    assert emulated_link_summary(emulated)["bytes_per_s"] == rates
    workload = make_workload(emulated, WORKLOAD_MODEL_CONFIG["vocab_size"])
    for policy in ("recompute", "hbm-lru", "reactive", "hints-only", "kvtier", "infinite-hbm"):
        options, _ = _policy_options(policy, emulated, workload, tmp_path / "model", tmp_path)
        assert options.emulated_dram_link_bytes_per_s == rates["dram"]
        assert options.emulated_nvme_link_bytes_per_s == rates["nvme"]
        bandwidth = options.orchestrator_params.bandwidth_bytes_per_s
        assert bandwidth[(Tier.NVME, Tier.HBM)] == bandwidth[(Tier.HBM, Tier.NVME)] == rates["nvme"]
        unemulated, _ = _policy_options(policy, plain, workload, tmp_path / "model", tmp_path)
        assert unemulated.emulated_dram_link_bytes_per_s is None is unemulated.emulated_nvme_link_bytes_per_s
        assert unemulated.orchestrator_params.bandwidth_bytes_per_s[(Tier.NVME, Tier.HBM)] == CPU_LINK_BYTES_PER_S["nvme"]
    assert parse_link_gbps("0.25,0.07") == {"dram": 0.25e9, "nvme": 0.07e9}
    for bad in ("0.25", "0,1", "a,b", "1,-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_link_gbps(bad)


def test_slow_down_plays_the_same_workload_slower(tmp_path) -> None:
    """--slow-down F: the same draws with every duration times F and every rate divided by F,
    so pauses, transfers, recompute and the worker's fixed waits keep their ratios to an engine F
    times slower."""
    assert parse_slow_down("4") == 4.0 and parse_slow_down("0.5") == 0.5
    for bad in ("0", "-2", "nan", "inf", "x", "", "101"):
        with pytest.raises(argparse.ArgumentTypeError, match="--slow-down"):
            parse_slow_down(bad)
    base, slow = WorkloadSpec(), WorkloadSpec(slow_down=4.0)
    for spec in (base, slow):
        spec.emulated_link_bytes_per_s = dict(EMULATED_LINK_BYTES_PER_S)
    vocab = WORKLOAD_MODEL_CONFIG["vocab_size"]
    a, b = make_workload(base, vocab), make_workload(slow, vocab)
    assert [(p.session_id, p.tenant) for p in a.sessions] == [(p.session_id, p.tenant) for p in b.sessions]
    for p, q in zip(a.sessions, b.sessions, strict=True):
        assert q.start_s == pytest.approx(4 * p.start_s)
        assert [t.user_tokens for t in p.turns] == [t.user_tokens for t in q.turns]  # the same prompts
        assert [t.tool for t in p.turns] == [t.tool for t in q.turns]
        assert [t.tool_ms for t in q.turns] == pytest.approx([4 * t.tool_ms for t in p.turns])
    tenants = sorted({p.tenant for p in a.sessions})
    assert [h[2] for h in warm_history(slow, tenants)] == pytest.approx([4 * h[2] for h in warm_history(base, tenants)])
    assert a.working_set_pages() == b.working_set_pages() and hbm_pages_for(base, a) == hbm_pages_for(slow, b)
    fast_options, _ = _policy_options("kvtier", base, a, tmp_path / "model", tmp_path)
    slow_options, _ = _policy_options("kvtier", slow, b, tmp_path / "model", tmp_path)
    assert slow_options.emulated_dram_link_bytes_per_s == pytest.approx(EMULATED_LINK_BYTES_PER_S["dram"] / 4)
    assert slow_options.emulated_nvme_link_bytes_per_s == pytest.approx(EMULATED_LINK_BYTES_PER_S["nvme"] / 4)
    assert (fast_options.wait_scale, slow_options.wait_scale) == (1.0, 4.0)  # the worker's fixed waits x F
    fast_plan, slow_plan = fast_options.orchestrator_params, slow_options.orchestrator_params
    assert slow_plan.margin_ms == 4 * fast_plan.margin_ms
    assert slow_plan.max_hold_ms == 4 * fast_plan.max_hold_ms  # a hold covers the same share of a pause
    assert slow_plan.topup_delay_ms == 4 * fast_plan.topup_delay_ms  # top-ups at the same shares of a pause
    assert slow_plan.bandwidth_bytes_per_s[(Tier.HBM, Tier.NVME)] == pytest.approx(
        fast_plan.bandwidth_bytes_per_s[(Tier.HBM, Tier.NVME)] / 4)
    assert slow_plan.cost_model.flops_per_s == pytest.approx(fast_plan.cost_model.flops_per_s / 4)
    assert emulated_link_summary(slow)["bytes_per_s"] == pytest.approx(
        {t: r / 4 for t, r in EMULATED_LINK_BYTES_PER_S.items()})
    assert emulated_link_summary(slow)["slow_down"] == 4.0
    # Unemulated, the link is the machine's own: not slowed.
    plain = WorkloadSpec(slow_down=4.0)
    assert plain.link_rate() == CPU_LINK_BYTES_PER_S[plain.lower_tier] and plain.emulated_links() is None


def test_a_run_whose_first_turns_queue_past_half_the_start_window_is_flagged_saturated() -> None:
    def policy(first_p50: float | None) -> dict:
        return {"first_turn_ttft_ms": {"p50": first_p50, "p99": first_p50}}

    policies = {"reactive": policy(210.0), "kvtier": policy(12_500.0), "infinite-hbm": policy(None)}
    spec = WorkloadSpec()  # sessions start over 6 s: the bound is 3 s
    assert saturation(policies, spec) == {"reactive": False, "kvtier": True, "infinite-hbm": False}
    assert saturation({"kvtier": policy(2_999.0)}, spec) == {"kvtier": False}
    spec.slow_down = 5.0  # the same workload played 5x slower: its starts spread over 30 s
    assert saturation(policies, spec)["kvtier"] is False

    def run(saturated: dict) -> dict:
        head = {"kvtier_over_infinite_hbm": 1.0, "kvtier_over_reactive": 0.4, "prefetch_on_time": 1.0,
                "wasted_prefetch_fraction": 0.05, "infinite_hbm_over_reactive": 0.4}
        return {**head, "targets_met": targets(head), "saturated": saturated}

    summary = across_seeds({0: run({"kvtier": False}), 1: run({"kvtier": True, "reactive": False})})
    assert summary["saturated_seeds"] == [1]
    assert "ENGINE SATURATED" in seeds_table(summary) and "in seeds 1" in seeds_table(summary)
    assert "ENGINE SATURATED" not in seeds_table(across_seeds({0: run({"kvtier": False})}))


def test_the_default_command_line_plays_the_workload_calibrated_to_this_machine() -> None:
    """No flags: the slow-down and the emulated links come from the calibration of what the
    engine measured; --slow-down and --emulate-link / --link-gbps override their part, and the
    machine is measured only when some part is left to the calibration."""
    slow = MachineSpeed(first_turn_ms=1200.0, resume_ms=90.0)
    derived = calibrate(slow)
    probes: list[int] = []

    def measure(spec: WorkloadSpec) -> MachineSpeed:
        probes.append(spec.user_tokens)  # the workload's own geometry is what gets measured
        return slow

    def never(spec: WorkloadSpec) -> MachineSpeed:
        raise AssertionError("nothing was left to measure")

    spec, calibration = spec_from_args(build_parser().parse_args([]), measure)
    assert probes == [WorkloadSpec().user_tokens]
    assert spec.slow_down == derived.slow_down == 6.0
    assert spec.emulated_link_bytes_per_s == derived.emulated_link_bytes_per_s
    assert spec.emulated_links() == pytest.approx({t: r / 6.0 for t, r in derived.emulated_link_bytes_per_s.items()})
    assert calibration["measured"] == slow._asdict() and calibration["overridden"] == []
    quick, _ = spec_from_args(build_parser().parse_args(["--quick"]), measure)
    assert probes[-1] == WorkloadSpec.quick().user_tokens and quick.slow_down == 6.0

    spec, calibration = spec_from_args(build_parser().parse_args(["--slow-down", "2"]), measure)
    assert spec.slow_down == 2.0 and spec.emulated_link_bytes_per_s == derived.emulated_link_bytes_per_s
    assert calibration["overridden"] == ["--slow-down"]
    spec, calibration = spec_from_args(build_parser().parse_args(["--emulate-link"]), measure)
    assert spec.slow_down == 6.0 and spec.emulated_link_bytes_per_s == EMULATED_LINK_BYTES_PER_S
    assert calibration["overridden"] == ["links"]
    spec, calibration = spec_from_args(build_parser().parse_args(["--link-gbps", "1,0.5", "--slow-down", "3"]), never)
    assert (spec.slow_down, spec.emulated_link_bytes_per_s, calibration) == (3.0, {"dram": 1e9, "nvme": 0.5e9}, None)
    spec, calibration = spec_from_args(build_parser().parse_args(["--no-calibrate"]), never)
    assert (spec.slow_down, spec.emulated_link_bytes_per_s, calibration) == (1.0, None, None)

    # ... pooled over several seeds unless one is named.
    assert seeds_of(build_parser().parse_args([])) == list(DEFAULT_SEEDS) and len(DEFAULT_SEEDS) >= 3
    assert seeds_of(build_parser().parse_args(["--seeds", "5,6"])) == [5, 6]
    assert seeds_of(build_parser().parse_args(["--seed", "4"])) is None
