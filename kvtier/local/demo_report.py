"""The demo's report: one conversation's transcript, the two modes' numbers side by side,
and a chart (``demo.png`` when matplotlib is installed; ``demo.txt``, an ASCII chart, always).

Per mode (``summarize``): time to first token of first turns and of resumed turns (a turn
that carries a tool's result), p50 and p99; cached prompt tokens of resumed turns by the tier
they were found in at the request (HBM: there already or prefetched back in time; DRAM /
NVMe: promoted on the request path); the controller's prefetch outcomes; wall time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvtier.local.demo import DemoOptions, ModeResult

TIERS = ("hbm", "dram", "nvme")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(result: ModeResult) -> dict[str, Any]:
    first = [r for r in result.records if not r.is_resume]
    resumed = [r for r in result.records if r.is_resume]
    after_fetch = [r for r in resumed if r.after_tool == "web_fetch"]
    prompt = sum(r.prompt_tokens for r in resumed)
    cached = sum(r.cached_tokens for r in resumed)
    return {
        "mode": result.mode,
        "requests": len(result.records),
        "wall_s": round(result.wall_s, 1),
        "pages": {"hbm": result.hbm_pages, "dram": result.dram_pages, "nvme": result.nvme_pages},
        "first_turn_ttft_ms": {"p50": pct([r.ttft_ms for r in first], 0.5),
                               "p99": pct([r.ttft_ms for r in first], 0.99)},
        "resumed_turn_ttft_ms": {"p50": pct([r.ttft_ms for r in resumed], 0.5),
                                 "p99": pct([r.ttft_ms for r in resumed], 0.99)},
        "after_web_fetch_ttft_ms": {"p50": pct([r.ttft_ms for r in after_fetch], 0.5)},
        "prompt_tokens": sum(r.prompt_tokens for r in result.records),
        "resumed_prompt_tokens": prompt,
        "resumed_cached_tokens": cached,
        "resumed_cached_fraction": cached / prompt if prompt else 0.0,
        "cached_tokens_by_tier": {t: sum(r.cached_by_tier.get(t, 0) for r in result.records) for t in TIERS},
        "promoted_tokens": sum(r.promoted_tokens for r in result.records),
        "prefetch": result.prefetch,
    }


def report(results: list[ModeResult], opts: DemoOptions) -> dict[str, Any]:
    modes = {r.mode: summarize(r) for r in results}
    out: dict[str, Any] = {"modes": modes, "workload": workload_line(opts)}
    if "tiered" in modes and "hbm_only" in modes:
        a, b = modes["tiered"]["resumed_turn_ttft_ms"], modes["hbm_only"]["resumed_turn_ttft_ms"]
        out["resume_ttft_tiered_over_hbm_only"] = {q: a[q] / b[q] if b[q] else None for q in ("p50", "p99")}
    return out


def workload_line(opts: DemoOptions) -> str:
    low, high = opts.fetch_range_s
    notes = f" and {opts.notes_chars:,} characters of notes" if opts.notes_chars else ""
    return (f"{opts.num_sessions} agent sessions in 2 tenants, each with its task{notes}, {opts.tool_calls} forced "
            f"tool calls each then an answer; web_fetch sleeps lognormal(median {opts.fetch_median_s:g} s, "
            f"sigma {opts.fetch_sigma:g}) clipped to [{low:g}, {high:g}] s; calculator and search_docs run for real")


def transcript_lines(messages: list[dict[str, Any]], width: int = 160) -> list[str]:
    """The conversation as text, long messages cut to ``width`` characters."""
    def cut(text: str) -> str:
        text = " ".join(str(text).split())
        return text if len(text) <= width else text[:width - 1] + "…"

    lines = []
    for m in messages:
        role = m["role"]
        if m.get("tool_calls"):
            for c in m["tool_calls"]:
                lines.append(f"assistant  → {c['function']['name']}({c['function']['arguments']})")
        elif role == "tool":
            lines.append(f"tool       ← {cut(m['content'])}")
        else:
            lines.append(f"{role:<10} {cut(m.get('content') or '')}")
    return lines


def text_report(out: dict[str, Any], transcript: list[dict[str, Any]]) -> str:
    modes = out["modes"]
    names = [m for m in ("tiered", "hbm_only") if m in modes]
    rows: list[tuple[str, ...]] = [("", *names)]

    def row(label: str, fmt: Any) -> None:
        rows.append((label, *(fmt(modes[m]) for m in names)))

    row("HBM / DRAM / NVMe pages", lambda s: "{hbm} / {dram} / {nvme}".format(**s["pages"]))
    row("requests", lambda s: str(s["requests"]))
    row("TTFT first turns p50 / p99 (ms)",
        lambda s: f"{s['first_turn_ttft_ms']['p50']:.0f} / {s['first_turn_ttft_ms']['p99']:.0f}")
    row("TTFT resumed turns p50 / p99 (ms)",
        lambda s: f"{s['resumed_turn_ttft_ms']['p50']:.0f} / {s['resumed_turn_ttft_ms']['p99']:.0f}")
    row("TTFT after web_fetch p50 (ms)", lambda s: f"{s['after_web_fetch_ttft_ms']['p50']:.0f}")
    row("resumed prompts served from cache",
        lambda s: f"{s['resumed_cached_tokens']:,} of {s['resumed_prompt_tokens']:,} "
                  f"({100 * s['resumed_cached_fraction']:.0f} %)")
    row("cached tokens HBM / DRAM / NVMe",
        lambda s: " / ".join(f"{s['cached_tokens_by_tier'][t]:,}" for t in TIERS))
    row("prefetch on time / late",
        lambda s: f"{s['prefetch'].get('on_time', 0)} / {s['prefetch'].get('late', 0)}" if s["prefetch"] else "-")
    row("wall time (s)", lambda s: f"{s['wall_s']:.1f}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines = ["kvtier demo: " + out["workload"], "", "One conversation (tenant-a's first session), as the agent sent it:"]
    lines += ["  " + line for line in transcript_lines(transcript)]
    lines += ["", *table]
    ratio = out.get("resume_ttft_tiered_over_hbm_only")
    if ratio and ratio["p50"] is not None:
        lines.append(f"resumed-turn TTFT, tiered / HBM only: p50 {ratio['p50']:.2f}, p99 {ratio['p99']:.2f}")
    return "\n".join(lines)


def ascii_chart(out: dict[str, Any], width: int = 50) -> str:
    """Bars of resumed-turn TTFT per mode, and of resumed turns' cached tokens by tier."""
    modes = out["modes"]
    lines = ["resumed-turn TTFT p50 (ms)"]
    top = max((s["resumed_turn_ttft_ms"]["p50"] for s in modes.values()), default=0.0) or 1.0
    for name, s in modes.items():
        v = s["resumed_turn_ttft_ms"]["p50"]
        n = 0 if math.isnan(v) else round(width * v / top)
        lines.append(f"  {name:<9} {'#' * n} {v:.0f}")
    lines += ["", "prompt tokens of all turns: cached by tier (H: HBM, D: DRAM, N: NVMe) or computed (.)"]
    total = max((s["prompt_tokens"] for s in modes.values()), default=0) or 1
    for name, s in modes.items():
        tiers = s["cached_tokens_by_tier"]
        bar = "".join(mark * round(width * tiers[t] / total) for mark, t in zip("HDN", TIERS, strict=True))
        bar += "." * max(0, width - len(bar))
        lines.append(f"  {name:<9} {bar} " + " / ".join(f"{tiers[t]:,}" for t in TIERS))
    return "\n".join(lines) + "\n"


def write_outputs(out: dict[str, Any], results: list[ModeResult], out_dir: Path) -> list[Path]:
    """``demo.json`` (the summary), ``demo.txt`` (the ASCII chart) and ``demo.png`` when
    matplotlib is installed; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "demo.json", out_dir / "demo.txt"]
    paths[0].write_text(json.dumps(out, indent=2) + "\n")
    paths[1].write_text(ascii_chart(out))
    png = _png(out, results, out_dir / "demo.png")
    return paths + ([png] if png else [])


def _png(out: dict[str, Any], results: list[ModeResult], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for result in results:
        for resume, style in ((False, "--"), (True, "-")):
            values = sorted(r.ttft_ms for r in result.records if r.is_resume == resume)
            if values:
                label = f"{result.mode}, {'resumed' if resume else 'first'} turns"
                ax1.plot(values, [(i + 1) / len(values) for i in range(len(values))], style, marker="o", label=label)
    ax1.set_xlabel("time to first token (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT through the gateway")
    ax1.legend(fontsize=8)
    names = list(out["modes"])
    bottom = [0.0] * len(names)
    for tier in TIERS:
        values = [out["modes"][n]["cached_tokens_by_tier"][tier] for n in names]
        ax2.bar(names, values, bottom=bottom, label=f"cached in {tier.upper()}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    computed = [sum(r.prompt_tokens - r.cached_tokens for r in res.records) for res in results]
    ax2.bar(names, computed, bottom=bottom, label="computed")
    ax2.set_ylabel("prompt tokens")
    ax2.set_title("Prompt tokens by where they came from")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
