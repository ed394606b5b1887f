"""``kvtier demo``: a short multi-tenant agent workload against a local stack.

Two tenants, each with a shared system prompt; several multi-turn sessions per tenant,
each pausing for a (simulated) tool call between turns. Every request goes through the
frontend client: Route on the controller, then Generate on the chosen worker. The report
shows how much of each prompt came from the cache and how fast first tokens arrived,
first turns against resumed turns; a PNG plot shows the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.client import AsyncClient
from kvtier.domain.errors import KvtierError
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import GenerateFinal, TokenChunk


@dataclass(slots=True)
class DemoOptions:
    num_tenants: int = 2
    sessions_per_tenant: int = 3
    turns: int = 3
    system_prompt_tokens: int = 96
    user_tokens: int = 24
    tool_result_tokens: int = 16
    max_tokens: int = 16
    tool_pause_s: tuple[float, float] = (0.2, 0.6)
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoOptions:
        return cls(sessions_per_tenant=2, turns=2, tool_pause_s=(0.05, 0.15))


@dataclass(slots=True)
class TurnRecord:
    tenant: str
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    promoted_tokens: int
    recomputed_tokens: int
    generated_tokens: int
    cached_by_tier: dict[str, int]
    ttft_ms: float  # measured by the client: request sent -> first token received

    @property
    def is_resume(self) -> bool:
        return self.turn > 0


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


async def _session(
    client: AsyncClient,
    namespace: NamespaceIdentity,
    system_prompt: list[int],
    session_id: str,
    opts: DemoOptions,
    vocab: int,
    rng: random.Random,
    hints: dict[str, bool],
) -> list[TurnRecord]:
    records: list[TurnRecord] = []
    context = system_prompt + _tokens(rng, opts.user_tokens, vocab)
    params = SamplingParams(max_tokens=opts.max_tokens, ignore_eos=True)
    for turn in range(opts.turns):
        start = time.perf_counter()
        first: float | None = None
        output: list[int] = []
        final: GenerateFinal | None = None
        async for event in client.generate(namespace, context, params, session_id=session_id):
            if isinstance(event, TokenChunk):
                if first is None:
                    first = time.perf_counter()
                output.extend(event.token_ids)
            else:
                final = event
        assert final is not None and first is not None
        u = final.usage
        records.append(
            TurnRecord(
                tenant=namespace.tenant,
                session=session_id,
                turn=turn,
                prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens,
                promoted_tokens=u.promoted_tokens,
                recomputed_tokens=u.recomputed_tokens,
                generated_tokens=u.generated_tokens,
                cached_by_tier={
                    "hbm": u.cached_tokens_by_tier.hbm_tokens,
                    "dram": u.cached_tokens_by_tier.dram_tokens,
                    "nvme": u.cached_tokens_by_tier.nvme_tokens,
                },
                ttft_ms=(first - start) * 1e3,
            )
        )
        if turn + 1 == opts.turns:
            break
        # The agent calls a tool: tell the controller (when it knows sessions), wait, resume.
        pause_s = rng.uniform(*opts.tool_pause_s)
        if hints.get("enabled", True):
            try:
                await client.pause(session_id, tool="search", expected_ms=int(pause_s * 1000))
            except KvtierError:
                hints["enabled"] = False  # a controller without the Sessions service
        await asyncio.sleep(pause_s)
        context = context + output + _tokens(rng, opts.tool_result_tokens, vocab)
    if hints.get("enabled", True):
        try:
            await client.end(session_id)
        except KvtierError:
            hints["enabled"] = False
    return records


async def run_workload(
    controller: str, namespace: NamespaceIdentity, vocab: int, opts: DemoOptions, *, token: str | None = None
) -> list[TurnRecord]:
    """Run the workload through a client of ``controller`` (``token``: its bearer token, which
    must act for every tenant: the local stack's admin token)."""
    rng = random.Random(opts.seed)
    hints: dict[str, bool] = {}
    async with AsyncClient(controller, token=token) as client:
        tasks = []
        for t in range(opts.num_tenants):
            tenant = f"tenant-{chr(ord('a') + t)}"
            ns = dataclasses.replace(namespace, tenant=tenant)
            system_prompt = _tokens(rng, opts.system_prompt_tokens, vocab)
            for s in range(opts.sessions_per_tenant):
                session_rng = random.Random(rng.random())
                tasks.append(_session(client, ns, system_prompt, f"{tenant}/s{s}", opts, vocab, session_rng, hints))
        results = await asyncio.gather(*tasks)
    return [r for session in results for r in session]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(records: list[TurnRecord]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    first = [r.ttft_ms for r in records if not r.is_resume]
    resume = [r.ttft_ms for r in records if r.is_resume]
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt if prompt else 0.0,
        "computed_prompt_tokens": prompt - cached,
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "promoted_tokens": sum(r.promoted_tokens for r in records),
        "cached_by_tier": {t: sum(r.cached_by_tier[t] for r in records) for t in ("hbm", "dram", "nvme")},
        "ttft_ms": {"p50": _pct(first, 0.5), "p99": _pct(first, 0.99)},
        "resume_ttft_ms": {"p50": _pct(resume, 0.5), "p99": _pct(resume, 0.99)},
        "first_turn_cached_fraction": statistics.fmean(
            [r.cached_tokens / r.prompt_tokens for r in records if not r.is_resume] or [0.0]
        ),
        "resume_cached_fraction": statistics.fmean(
            [r.cached_tokens / r.prompt_tokens for r in records if r.is_resume] or [0.0]
        ),
    }


def write_plot(records: list[TurnRecord], path: Path) -> Path | None:
    """Cached vs computed prompt tokens per turn, and TTFT of first vs resumed turns."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    turns = sorted({r.turn for r in records})
    cached = [sum(r.cached_tokens for r in records if r.turn == t) for t in turns]
    computed = [sum(r.prompt_tokens - r.cached_tokens for r in records if r.turn == t) for t in turns]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar([f"turn {t + 1}" for t in turns], cached, label="from cache")
    ax1.bar([f"turn {t + 1}" for t in turns], computed, bottom=cached, label="computed")
    ax1.set_ylabel("prompt tokens")
    ax1.set_title("Prompt tokens per turn")
    ax1.legend()
    for label, resume in (("first turn", False), ("resumed turn", True)):
        values = sorted(r.ttft_ms for r in records if r.is_resume == resume)
        if values:
            ax2.plot(values, [(i + 1) / len(values) for i in range(len(values))], marker="o", label=label)
    ax2.set_xlabel("time to first token (ms)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT")
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
