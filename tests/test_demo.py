"""The demo's parts that need no stack: its tools, its workload plan, and its report."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtier.local.demo import (
    DemoOptions,
    DocSearch,
    ModeResult,
    TurnRecord,
    calculate,
    fetch_seconds,
    make_plans,
)
from kvtier.local.demo_report import ascii_chart, report, text_report, write_outputs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("expression", "expected"), [
    ("17 * 23", "17 * 23 = 391"),
    ("1200 * 0.25 + 1200 * 0.75 * 0.5", "1200 * 0.25 + 1200 * 0.75 * 0.5 = 750"),
    ("-(2 ** 10) % 7", "-(2 ** 10) % 7 = 5"),
])
def test_calculator_evaluates_arithmetic(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 1000", "1 / 0", "x + 1", "", "(" * 50])
def test_calculator_refuses_anything_else_with_a_message(expression):
    assert calculate(expression).startswith("error: ")


def test_doc_search_finds_the_passage_about_the_query():
    docs = DocSearch(ROOT)
    assert len(docs.passages) > 50
    hit = docs.search("prefetch timing predicted return")
    assert hit.startswith("[") and "prefetch" in hit.lower()


def test_fetch_times_follow_the_stated_distribution():
    opts = DemoOptions()
    rng = random.Random(0)
    samples = sorted(fetch_seconds(opts, rng) for _ in range(2001))
    low, high = opts.fetch_range_s
    assert low <= samples[0] and samples[-1] <= high
    assert abs(samples[1000] - opts.fetch_median_s) < 0.15 * opts.fetch_median_s  # the median


def test_plans_are_deterministic_and_force_a_web_fetch_first():
    opts = DemoOptions()
    plans = make_plans(opts)
    assert plans == make_plans(opts)
    assert len(plans) == opts.num_sessions and {p.tenant for p in plans} == {"tenant-a", "tenant-b"}
    for plan in plans:
        assert len(plan.tools) == opts.tool_calls and plan.tools[0] == "web_fetch"
        assert len(plan.fetch_s) == plan.tools.count("web_fetch")
    assert {t for p in plans for t in p.tools} == {"calculator", "search_docs", "web_fetch"}


def test_a_tool_cycle_of_web_fetch_makes_every_call_a_fetch():
    plans = make_plans(DemoOptions(tool_calls=3, tool_cycle=("web_fetch",)))
    assert all(p.tools == ("web_fetch",) * 3 and len(p.fetch_s) == 3 for p in plans)


def test_notes_are_the_asked_length_and_differ_between_sessions():
    docs = DocSearch(ROOT)
    notes = [docs.notes(n, 1600) for n in range(6)]
    assert all(len(n) == 1600 for n in notes)
    assert len(set(notes)) == 6
    assert notes[2] == docs.notes(2, 1600)


def _records(mode: str, resumed_ttft: float, tiers: dict[str, int]) -> list[TurnRecord]:
    return [
        TurnRecord(mode, "tenant-a", 0, 0, "web_fetch", None, 900.0, 380, 0, {"hbm": 0, "dram": 0, "nvme": 0}, 0),
        TurnRecord(mode, "tenant-a", 0, 1, "calculator", "web_fetch", resumed_ttft, 540, sum(tiers.values()),
                   tiers, tiers.get("dram", 0) + tiers.get("nvme", 0)),
    ]


def test_report_compares_the_modes_and_writes_its_charts(tmp_path):
    transcript = [{"role": "system", "content": "You are Ada."}, {"role": "user", "content": "How fast?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "web_fetch", "arguments": '{"url": "https://x"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Fetched https://x in 2.0 s: text"},
                  {"role": "assistant", "content": "It is fast."}]
    results = [
        ModeResult("tiered", _records("tiered", 100.0, {"hbm": 256, "dram": 96, "nvme": 160}), transcript,
                   {"on_time": 3, "late": 1}, 12.0),
        ModeResult("hbm_only", _records("hbm_only", 400.0, {"hbm": 128, "dram": 0, "nvme": 0}), transcript, {}, 20.0),
    ]
    out = report(results, DemoOptions.quick())
    assert out["resume_ttft_tiered_over_hbm_only"] == {"p50": 0.25, "p99": 0.25}
    assert out["modes"]["tiered"]["cached_tokens_by_tier"] == {"hbm": 256, "dram": 96, "nvme": 160}
    text = text_report(out, transcript)
    assert "assistant  → web_fetch({\"url\": \"https://x\"})" in text
    assert "tool       ← Fetched https://x" in text and "It is fast." in text
    assert "3 / 1" in text  # prefetch on time / late
    chart = ascii_chart(out)
    tiered_bar = next(line for line in chart.splitlines() if line.strip().startswith("tiered") and "H" in line)
    assert "D" in tiered_bar and "N" in tiered_bar
    paths = write_outputs(out, results, tmp_path)
    assert json.loads((tmp_path / "demo.json").read_text())["modes"]["hbm_only"]["requests"] == 2
    assert (tmp_path / "demo.txt").read_text() == chart
    assert tmp_path / "demo.png" in paths  # matplotlib is a dev dependency
