"""Agent workload: one seeded multi-tenant, multi-turn, tool-calling workload under six policies.

    python -m loadtests.agent_workload [--json] [--plot PATH] [--quick]

Workload (``make_workload``, deterministic in ``seed``): ``num_tenants`` tenants, each with a
shared system prompt; ``sessions_per_tenant`` sessions per tenant, staggered starts; each
session runs ``turns`` turns with a growing context (previous context + model output + a
tool result), and between turns calls a tool whose duration is lognormal per tool type
(time-compressed by ``time_scale``). The caller's ``expected_ms`` for a tool is a fixed
per-tool guess that is biased (fast tools over-estimated, slow ones under-estimated), as
agent frameworks' static estimates are; the predictor learns the real distribution.

Policies, each on a fresh local stack (1 worker, same checkpoint, same HBM size):

  recompute     every request in a fresh tenant namespace: nothing ever hits
  hbm-lru       no lower tier (DRAM 0): pages evicted from HBM are gone; no hints
                (the worker's eviction policy is its default, not configurable from the stack)
  reactive      DRAM tier, no hints: watermark demotion under pressure, promotion on hit
  hints-only    DRAM + Pause(tool, caller's expected_ms) + orchestrator; predictor never trusted
  kvtier        DRAM + Pause(tool) + predictor (warm: >= ``warm_observations`` per tenant/tool,
                drawn from the same distributions with another seed) + scheduled prefetch
  infinite-hbm  HBM holds everything (reference)

Resume TTFT is measured client-side (request sent -> first token) for turns >= 2.
Recomputed tokens = prompt tokens a cache could have served (same-tenant prefix already
sent, whole pages) but were computed + ``usage.recomputed_tokens``. Bytes per tier pair
come from the worker's ``TierManager.counters`` (read through Ray); prefetch outcomes from
the controller's ``Orchestrator.stats``. Bounded: fixed session/turn counts, loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.bench_engine import BENCH_CONFIG

POLICIES = ("recompute", "hbm-lru", "reactive", "hints-only", "kvtier", "infinite-hbm")
HINT_POLICIES = ("hints-only", "kvtier")

# The engine benchmark's model with half the layers: recompute still costs far more than a
# DRAM -> HBM copy on this CPU, and the run stays bounded.
WORKLOAD_MODEL_CONFIG = {**BENCH_CONFIG, "vocab_size": 4096, "num_hidden_layers": 4}


@dataclass(frozen=True, slots=True)
class ToolType:
    name: str
    median_ms: float  # of the real (uncompressed) duration
    sigma: float  # of ln(duration)
    caller_guess_ms: float  # what the caller passes as expected_ms (biased)


TOOLS = (
    ToolType("search", 400.0, 0.4, 800.0),
    ToolType("code_exec", 1200.0, 0.5, 1200.0),
    ToolType("browse", 2500.0, 0.4, 1500.0),
)


@dataclass(slots=True)
class WorkloadSpec:
    num_tenants: int = 3
    sessions_per_tenant: int = 4
    turns: int = 4
    system_prompt_tokens: int = 256
    user_tokens: int = 48
    tool_result_tokens: int = 48
    max_tokens: int = 8
    time_scale: float = 1.0  # tool durations are multiplied by this
    stagger_s: float = 3.0  # session starts spread uniformly over this
    page_size: int = 16
    hbm_fraction: float = 0.5  # HBM pages / working-set pages (at least 3 sessions' worth)
    warm_observations: int = 20  # kvtier's predictor history per (tenant, tool) before the run
    margin_ms: float = 100.0  # orchestrator: prefetch this long before the predicted return
    seed: int = 0

    @classmethod
    def quick(cls) -> WorkloadSpec:
        return cls(num_tenants=2, sessions_per_tenant=2, turns=3, system_prompt_tokens=128,
                   time_scale=0.5, stagger_s=2.0)


@dataclass(frozen=True, slots=True)
class TurnPlan:
    user_tokens: tuple[int, ...]  # appended before this turn (user message or tool result)
    tool: str | None  # tool called after this turn (None: last turn)
    tool_ms: float  # actual duration of that tool call (compressed)


@dataclass(frozen=True, slots=True)
class SessionPlan:
    tenant: str
    session_id: str
    start_s: float
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    system_prompts: dict[str, tuple[int, ...]]
    sessions: tuple[SessionPlan, ...]

    def max_context_tokens(self) -> int:
        s = self.spec
        return max(
            len(self.system_prompts[p.tenant]) + sum(len(t.user_tokens) for t in p.turns) + s.turns * s.max_tokens
            for p in self.sessions
        )

    def working_set_pages(self) -> int:
        """Pages every session's final context needs, system prompts counted once per tenant."""
        ps = self.spec.page_size
        shared = sum(len(p) // ps for p in self.system_prompts.values())
        private = sum(
            math.ceil(self.max_context_tokens() / ps) - len(self.system_prompts[p.tenant]) // ps
            for p in self.sessions
        )
        return shared + private


def make_workload(spec: WorkloadSpec, vocab: int) -> Workload:
    """The seeded workload: the same spec and vocab always give the same plan."""
    rng = random.Random(spec.seed)
    tenants = [f"tenant-{chr(ord('a') + t)}" for t in range(spec.num_tenants)]
    system_prompts = {t: tuple(rng.randrange(vocab) for _ in range(spec.system_prompt_tokens)) for t in tenants}
    sessions = []
    for t, tenant in enumerate(tenants):
        tools = TOOLS[: 2 + (t % 2)]  # 2 or 3 tool types per tenant
        for s in range(spec.sessions_per_tenant):
            turns = []
            for k in range(spec.turns):
                n = spec.user_tokens if k == 0 else spec.tool_result_tokens
                tokens = tuple(rng.randrange(vocab) for _ in range(n))
                if k + 1 < spec.turns:
                    tool = rng.choice(tools)
                    ms = rng.lognormvariate(math.log(tool.median_ms), tool.sigma) * spec.time_scale
                    turns.append(TurnPlan(tokens, tool.name, ms))
                else:
                    turns.append(TurnPlan(tokens, None, 0.0))
            sessions.append(SessionPlan(tenant, f"{tenant}/s{s}", rng.uniform(0, spec.stagger_s), tuple(turns)))
    return Workload(spec, system_prompts, tuple(sorted(sessions, key=lambda p: p.start_s)))


def warm_history(spec: WorkloadSpec, tenants: list[str]) -> list[tuple[str, str, float]]:
    """Past durations for the kvtier predictor: same distributions, another seed."""
    rng = random.Random(spec.seed + 10_000)
    return [
        (tenant, tool.name, rng.lognormvariate(math.log(tool.median_ms), tool.sigma) * spec.time_scale)
        for tenant in tenants for tool in TOOLS for _ in range(spec.warm_observations)
    ]


# --------------------------------------------------------------------------- records + metrics


@dataclass(slots=True)
class TurnRecord:
    policy: str
    session: str
    turn: int
    prompt_tokens: int
    cacheable_tokens: int  # same-tenant prefix already sent (whole pages)
    cached_tokens: int
    promoted_tokens: int
    recomputed_tokens: int  # usage.recomputed_tokens
    ttft_ms: float

    @property
    def is_resume(self) -> bool:
        return self.turn > 0

    @property
    def missed_tokens(self) -> int:
        return max(0, self.cacheable_tokens - self.cached_tokens)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(records: list[TurnRecord]) -> dict[str, Any]:
    resume = [r.ttft_ms for r in records if r.is_resume]
    first = [r.ttft_ms for r in records if not r.is_resume]
    missed = sum(r.missed_tokens for r in records)
    usage_recomputed = sum(r.recomputed_tokens for r in records)
    return {
        "requests": len(records),
        "resume_requests": len(resume),
        "resume_ttft_ms": {"p50": pct(resume, 0.5), "p99": pct(resume, 0.99)},
        "first_turn_ttft_ms": {"p50": pct(first, 0.5), "p99": pct(first, 0.99)},
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cacheable_tokens": sum(r.cacheable_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "promoted_tokens": sum(r.promoted_tokens for r in records),
        "recomputed_tokens": missed + usage_recomputed,
        "missed_cacheable_tokens": missed,
        "usage_recomputed_tokens": usage_recomputed,
    }


def prefetch_summary(stats: Any) -> dict[str, Any]:
    """``Orchestrator.stats`` (a ``PrefetchStats``) as plain numbers."""
    if stats is None:
        return {}
    prefetched = stats.on_time_bytes + stats.late_bytes + stats.wasted_bytes
    scored = stats.num_on_time + stats.num_late
    return {
        "num_demoted": stats.num_demoted,
        "demoted_bytes": stats.demoted_bytes,
        "num_kept_in_hbm": stats.num_kept_in_hbm,
        "num_throttled": stats.num_throttled,
        "num_on_time": stats.num_on_time,
        "num_late": stats.num_late,
        "num_wasted": stats.num_wasted,
        "on_time_fraction": stats.num_on_time / scored if scored else None,
        "wasted_bytes": stats.wasted_bytes,
        "wasted_fraction": stats.wasted_bytes / prefetched if prefetched else None,
        "mean_abs_error_ms": stats.abs_error_ms_sum / stats.num_errors if stats.num_errors else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def headline(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def p50(name: str) -> float | None:
        return policies.get(name, {}).get("resume_ttft_ms", {}).get("p50")

    kv = policies.get("kvtier", {})
    return {
        "kvtier_over_infinite_hbm": ratio(p50("kvtier"), p50("infinite-hbm")),
        "kvtier_over_reactive": ratio(p50("kvtier"), p50("reactive")),
        "prefetch_on_time": kv.get("prefetch", {}).get("on_time_fraction"),
        "wasted_prefetch_fraction": kv.get("prefetch", {}).get("wasted_fraction"),
    }


def targets(head: dict[str, Any]) -> dict[str, bool | None]:
    def le(v: float | None, bound: float) -> bool | None:
        return None if v is None else v <= bound

    on_time = head["prefetch_on_time"]
    return {
        "kvtier_over_infinite_hbm<=1.1": le(head["kvtier_over_infinite_hbm"], 1.1),
        "kvtier_over_reactive<=0.5": le(head["kvtier_over_reactive"], 0.5),
        "prefetch_on_time>=0.95": None if on_time is None else on_time >= 0.95,
        "wasted_prefetch<=0.10": le(head["wasted_prefetch_fraction"], 0.10) if head["wasted_prefetch_fraction"]
        is not None else True,
    }


# --------------------------------------------------------------------------- running


@dataclass(slots=True)
class PolicyRun:
    records: list[TurnRecord] = field(default_factory=list)
    bytes_moved: dict[str, int] = field(default_factory=dict)
    prefetch: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def _page_bytes(config: dict[str, Any], page_size: int) -> int:
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * page_size * 4


def _tier_counters(actor: Any) -> dict[str, int]:
    """Bytes per tier pair from the worker's TierManager (empty without lower tiers)."""
    import ray

    def read(worker: Any) -> dict[str, int]:
        tiers = getattr(getattr(worker, "_engine", None), "tiers", None)
        if tiers is None:
            return {}
        for _ in range(5):
            try:
                return {f"{a.label}->{b.label}": n for (a, b), n in dict(tiers.counters.bytes_moved).items()}
            except RuntimeError:  # the engine thread changed the dict meanwhile
                time.sleep(0.01)
        return {}

    try:
        return ray.get(actor.__ray_call__.remote(read), timeout=30)
    except Exception as exc:  # an older Ray without __ray_call__: report none
        return {"unavailable": 0, "error": str(type(exc).__name__)}  # type: ignore[dict-item]


async def _session(
    client: Any, namespace: Any, workload: Workload, plan: SessionPlan, policy: str,
    errors: list[str], out: list[TurnRecord], t0: float,
) -> None:
    from kvtier.engine.params import SamplingParams
    from kvtier.errors import KvtierError
    from kvtier.records import GenerateFinal, TokenChunk

    spec = workload.spec
    ps = spec.page_size
    tools = {t.name: t for t in TOOLS}
    hints = policy in HINT_POLICIES
    await asyncio.sleep(max(0.0, t0 + plan.start_s - time.perf_counter()))
    system = list(workload.system_prompts[plan.tenant])
    context = system[:]
    sent_before = 0  # same-session prefix already sent (tokens whose KV exists)
    params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    for k, turn in enumerate(plan.turns):
        context = context + list(turn.user_tokens)
        tenant = plan.tenant if policy != "recompute" else f"{plan.tenant}-{uuid.uuid4().hex[:8]}"
        ns = dataclasses.replace(namespace, tenant=tenant)
        shared = len(system) if k == 0 and _tenant_seen(out, plan, policy) else sent_before
        cacheable = (shared // ps) * ps
        start = time.perf_counter()
        first: float | None = None
        output: list[int] = []
        final = None
        for _attempt in range(2):  # one retry: a worker-side INTERNAL error (counted) is not fatal
            try:
                async for event in client.generate(
                    ns, context, params, session_id=plan.session_id if hints else None
                ):
                    if isinstance(event, TokenChunk):
                        if first is None:
                            first = time.perf_counter()
                        output.extend(event.token_ids)
                    elif isinstance(event, GenerateFinal):
                        final = event
                break
            except KvtierError:
                errors.append(plan.session_id)
                first, output, final = None, [], None
        if final is None or first is None:
            return  # failed twice: the session stops here (counted in request_errors)
        u = final.usage
        out.append(TurnRecord(policy, plan.session_id, k, u.prompt_tokens, min(cacheable, u.prompt_tokens),
                              u.cached_tokens, u.promoted_tokens, u.recomputed_tokens, (first - start) * 1e3))
        sent_before = len(context) + len(output) - 1  # the last output token's KV is never computed
        context = context + output
        if turn.tool is None:
            break
        if hints:
            expected = None
            if policy == "hints-only":
                expected = int(tools[turn.tool].caller_guess_ms * spec.time_scale)
            await client.pause(plan.session_id, tool=turn.tool, expected_ms=expected)
        await asyncio.sleep(turn.tool_ms / 1000.0)
    if hints:
        await client.end(plan.session_id)


def _tenant_seen(out: list[TurnRecord], plan: SessionPlan, policy: str) -> bool:
    """Whether an earlier request of this tenant already sent its system prompt."""
    return any(r.session.split("/")[0] == plan.tenant for r in out if r.policy == policy)


def _policy_options(policy: str, spec: WorkloadSpec, workload: Workload, model: Path, state_dir: Path) -> Any:
    from kvtier.controller.orchestrator import OrchestratorParams
    from kvtier.controller.predictor import PredictorParams
    from kvtier.stack import StackOptions

    page_bytes = _page_bytes(WORKLOAD_MODEL_CONFIG, spec.page_size)
    ws = workload.working_set_pages()
    session_pages = math.ceil(workload.max_context_tokens() / spec.page_size) + 1
    # Room for every running sequence: a preempted request currently fails (negative usage by tier).
    hbm_pages = max(round(ws * spec.hbm_fraction), min(len(workload.sessions), 6) * session_pages)
    # recompute's private namespaces and hbm-lru's misses need room too; infinite holds all of it 4x over.
    if policy == "infinite-hbm":
        hbm_pages = 4 * (ws + len(workload.sessions) * spec.turns * session_pages)
    dram_bytes = 0 if policy in ("hbm-lru", "infinite-hbm") else 4 * ws * page_bytes
    predictor = PredictorParams(min_samples=1e9) if policy == "hints-only" else PredictorParams()
    return StackOptions(
        state_dir=state_dir / policy, model=model, page_size=spec.page_size,
        hbm_bytes=hbm_pages * page_bytes, dram_bytes=dram_bytes, nvme_bytes=0,
        orchestrator_params=OrchestratorParams(margin_ms=spec.margin_ms), predictor_params=predictor,
    ), hbm_pages


async def run_policy(policy: str, workload: Workload, model: Path, state_dir: Path) -> tuple[PolicyRun, int]:
    from kvtier.client import AsyncClient
    from kvtier.stack import start_local_stack

    options, hbm_pages = _policy_options(policy, workload.spec, workload, model, state_dir)
    stack = await start_local_stack(options)
    run = PolicyRun()
    try:
        orchestrator = stack.controller.orchestrator
        if policy == "kvtier" and orchestrator is not None:
            for tenant, tool, ms in warm_history(workload.spec, sorted(workload.system_prompts)):
                await orchestrator.predictor.observe(tenant, tool, ms)
        async with AsyncClient(stack.controller_address, timeout_s=120.0) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(
                _session(client, stack.namespace, workload, plan, policy, run.errors, run.records, t0)
                for plan in workload.sessions
            ))
            run.wall_s = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # let the last commands' acks land
        run.bytes_moved = await asyncio.get_running_loop().run_in_executor(
            None, _tier_counters, stack.workers[0].actor)
        if policy in HINT_POLICIES and orchestrator is not None:
            run.prefetch = prefetch_summary(orchestrator.stats)
    finally:
        await stack.stop()
    return run, hbm_pages


async def run_all(spec: WorkloadSpec, policies: tuple[str, ...] = POLICIES, log: Any = None) -> dict[str, Any]:
    import ray

    from kvtier.model.loader import write_random_checkpoint

    workload = make_workload(spec, WORKLOAD_MODEL_CONFIG["vocab_size"])
    result: dict[str, Any] = {"policies": {}}
    with tempfile.TemporaryDirectory(prefix="kvtier-agent-") as tmp:
        root = Path(tmp)
        model = write_random_checkpoint(root / "model", WORKLOAD_MODEL_CONFIG, seed=0)
        # One Ray instance for all stacks (each stack kills its own worker actor).
        ray.init(address="local", num_cpus=2, object_store_memory=200 << 20,
                 include_dashboard=False, log_to_driver=False)
        try:
            for policy in policies:
                run, hbm_pages = await run_policy(policy, workload, model, root)
                summary = summarize(run.records)
                summary.update(bytes_moved=run.bytes_moved, wall_s=round(run.wall_s, 2), hbm_pages=hbm_pages,
                               request_errors=len(run.errors))
                if run.prefetch:
                    summary["prefetch"] = run.prefetch
                result["policies"][policy] = summary
                if log is not None:
                    log(f"{policy:>13}: resume TTFT p50 {summary['resume_ttft_ms']['p50']:.1f} ms, "
                        f"p99 {summary['resume_ttft_ms']['p99']:.1f} ms, wall {run.wall_s:.1f} s")
        finally:
            ray.shutdown()
    result.update(headline(result["policies"]))
    result["targets_met"] = targets(headline(result["policies"]))
    result["workload"] = {
        **dataclasses.asdict(spec), "num_sessions": len(workload.sessions),
        "num_pauses": sum(1 for p in workload.sessions for t in p.turns if t.tool),
        "working_set_pages": workload.working_set_pages(),
        "page_bytes": _page_bytes(WORKLOAD_MODEL_CONFIG, spec.page_size),
        "tools": [dataclasses.asdict(t) for t in TOOLS],
    }
    return result


# --------------------------------------------------------------------------- output


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(result: dict[str, Any]) -> str:
    lines = [f"{'policy':>13} {'resume p50':>10} {'p99':>8} {'turn1 p50':>9} {'recomp tok':>10} "
             f"{'cached':>7} {'hbm->dram MB':>12} {'dram->hbm MB':>12} {'on-time':>7} {'wasted B':>8}"]
    for name, s in result["policies"].items():
        moved = s.get("bytes_moved", {})
        pf = s.get("prefetch", {})
        lines.append(
            f"{name:>13} {_fmt(s['resume_ttft_ms']['p50']):>10} {_fmt(s['resume_ttft_ms']['p99']):>8} "
            f"{_fmt(s['first_turn_ttft_ms']['p50']):>9} {s['recomputed_tokens']:>10} {s['cached_tokens']:>7} "
            f"{moved.get('hbm->dram', 0) / 2**20:>12.1f} {moved.get('dram->hbm', 0) / 2**20:>12.1f} "
            f"{_fmt(pf.get('on_time_fraction'), '.2f'):>7} {_fmt(pf.get('wasted_bytes'), 'd'):>8}"
        )
    lines.append(f"kvtier/infinite-hbm p50: {_fmt(result['kvtier_over_infinite_hbm'], '.2f')}   "
                 f"kvtier/reactive p50: {_fmt(result['kvtier_over_reactive'], '.2f')}   "
                 f"prefetch on time: {_fmt(result['prefetch_on_time'], '.2f')}")
    lines.append("targets: " + ", ".join(f"{k}: {v}" for k, v in result["targets_met"].items()))
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["policies"])
    p50 = [result["policies"][n]["resume_ttft_ms"]["p50"] for n in names]
    p99 = [result["policies"][n]["resume_ttft_ms"]["p99"] for n in names]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("resume TTFT (ms)")
    ax.set_title("Agent workload: resume time to first token per policy")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plot", type=Path, help="write resume TTFT bars per policy to this PNG")
    parser.add_argument("--quick", action="store_true", help="a smaller workload (2 tenants, 2 sessions each)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset")
    parser.add_argument("--margin-ms", type=float, help="orchestrator prefetch margin")
    args = parser.parse_args(argv)
    spec = WorkloadSpec.quick() if args.quick else WorkloadSpec()
    if args.margin_ms is not None:
        spec.margin_ms = args.margin_ms
    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    import sys

    result = asyncio.run(run_all(spec, policies, log=lambda m: print(m, file=sys.stderr, flush=True)))
    if args.plot:
        write_plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
