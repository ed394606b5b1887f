"""The soak (loadtests/soak.py) on the real local stack, briefly: 32 sessions with tool
pauses for ~6 s, then the report's numbers must hold together and show a healthy stack."""

from __future__ import annotations

import json

from loadtests import soak


def test_a_short_soak_reports_no_errors_no_leaked_pages_and_rss_per_process(local_ray, tmp_path, capsys):
    plot = tmp_path / "soak.png"
    code = soak.main(["--duration-s", "6", "--json", "--plot", str(plot)])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result["error_samples"]
    assert result["errors"] == 0 and result["error_samples"] == []
    assert result["leaked_pages"] == 0 and result["integrity_problems"] == []
    assert result["sessions"] == 32 and result["sessions_run"] >= 32
    assert result["requests"] >= 32 and result["session_hints"] > 0, "every session ran turns and tool calls"
    rss = result["rss_mib"]
    assert {"controller", "worker-0", "valkey"} <= set(rss) - {"times_s"}
    assert len(rss["times_s"]) >= 5
    for name in ("controller", "worker-0", "valkey"):
        assert len(rss[name]) == len(rss["times_s"]) and all(v is not None and v > 0 for v in rss[name])
    assert set(result["rss_growth_by_process"]) == {"controller", "worker-0", "valkey"}
    assert result["rss_growth"] == max(result["rss_growth_by_process"].values())
    for latency in ("ttft_ms", "tpot_ms"):
        assert 0 < result[latency]["p50"] <= result[latency]["p99"]
    assert plot.stat().st_size > 0
