"""Fast checks of the agent-workload benchmark's generator and metrics (no stack)."""

from __future__ import annotations

from types import SimpleNamespace

from loadtests.agent_workload import (
    TurnRecord,
    WorkloadSpec,
    headline,
    make_workload,
    prefetch_summary,
    summarize,
    targets,
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


def _rec(turn: int, ttft: float, cacheable: int, cached: int, recomputed: int = 0) -> TurnRecord:
    return TurnRecord("p", "t/s0", turn, 100, cacheable, cached, 0, recomputed, ttft)


def test_summarize_and_headline() -> None:
    records = [_rec(0, 500.0, 0, 0), _rec(1, 100.0, 96, 96), _rec(2, 300.0, 160, 128, recomputed=5)]
    s = summarize(records)
    assert s["resume_ttft_ms"]["p50"] in (100.0, 300.0)
    assert s["recomputed_tokens"] == 32 + 5
    stats = SimpleNamespace(on_time_bytes=30, late_bytes=10, wasted_bytes=0, num_on_time=3, num_late=1,
                            num_demoted=4, demoted_bytes=40, num_kept_in_hbm=0, num_throttled=0,
                            num_wasted=0, abs_error_ms_sum=40.0, num_errors=4)
    pf = prefetch_summary(stats)
    assert pf["on_time_fraction"] == 0.75 and pf["wasted_fraction"] == 0.0
    policies = {"kvtier": {"resume_ttft_ms": {"p50": 110.0}, "prefetch": pf},
                "infinite-hbm": {"resume_ttft_ms": {"p50": 100.0}},
                "reactive": {"resume_ttft_ms": {"p50": 200.0}}}
    head = headline(policies)
    assert abs(head["kvtier_over_infinite_hbm"] - 1.1) < 1e-9 and head["kvtier_over_reactive"] == 0.55
    met = targets(head)
    assert met["kvtier_over_infinite_hbm<=1.1"] and not met["kvtier_over_reactive<=0.5"]
    assert met["prefetch_on_time>=0.95"] is False
