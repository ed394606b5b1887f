"""``kvtier demo``: real agents on the bundled model through the OpenAI-compatible gateway.

Setup: a local stack serving SmolLM2-135M-Instruct (``kvtier.local.real_model``) with the
gateway in front (``kvtier.local.frontend``); two tenants, each with its own API key (a
frontend token bound to the tenant) and its own system prompt; ``sessions_per_tenant``
agent sessions per tenant, each an OpenAI-SDK loop (``AsyncOpenAI``, streaming) with three
tools:

  calculator   evaluates an arithmetic expression (real, instantaneous)
  search_docs  searches the repository's README and docs/ for the query's words (real)
  web_fetch    a simulated fetch: sleeps a lognormal time (median ``fetch_median_s``,
               sigma ``fetch_sigma``, clipped to ``fetch_range_s``), then returns a page

Each session calls ``tool_calls`` tools, forced with a named ``tool_choice`` (a 135M model
cannot be trusted to call them by itself), then answers in text (``tool_choice: none``).
Nothing tells kvtier about sessions: the gateway infers them, and each tool call's pause, from
the conversation; a web_fetch turn adds ``X-Tool-Expected-Ms`` (the stated median), as an
agent that knows its tools may.

HBM holds about ``hbm_sessions`` sessions' final contexts, fewer than the sessions that run,
so paused sessions' pages leave HBM while others run: to DRAM, and from there to NVMe,
which is sized to hold everything. The same workload (same seed, so the same tool plans and
fetch times) then runs with tiering off (HBM only, no DRAM or NVMe): pages that leave HBM are
dropped and a resumed turn recomputes them.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import random
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.domain.errors import FailedPrecondition
from kvtier.local import real_model
from kvtier.local.stack import AUTH_DIR, TOKEN_TABLE_FILE, LocalStack, StackOptions, start_local_stack

TENANTS = ("tenant-a", "tenant-b")
PAGE_SIZE = 16
RESULT_CHARS = 280  # of a search or fetch result: about 60 tokens
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate arithmetic.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the kvtier docs.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "web_fetch", "description": "Fetch a web page.",
        "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}}},
]
SYSTEM_PROMPTS = {
    "tenant-a": ("You are Ada, a research assistant for a team that serves language models. Look things up "
                 "with search_docs, fetch sources with web_fetch, check numbers with calculator. Be brief."),
    "tenant-b": ("You are Brook, a support agent for a hosted chat product. Use search_docs for product docs, "
                 "web_fetch for status pages, calculator for bills and token counts. Be brief."),
}
TASKS = (
    "How much faster is a resumed turn when its pages come back from DRAM?",
    "Where do an agent's KV pages wait during a web fetch?",
    "A prompt has 1200 tokens, 75 percent cached at half price. What is billed?",
    "What does the NVMe tier add for long agent contexts?",
    "Why do two tenants with the same system prompt not share cached pages?",
    "What does prefetch on time mean?",
)
QUERIES = ("prefetch timing", "DRAM shadows", "NVMe file io", "page checksum", "eviction by value",
           "tenant quotas", "session pause tool", "radix index")
EXPRESSIONS = ("1200 * 0.25 + 1200 * 0.75 * 0.5", "64 * 16 * 30", "2.5 * 1000 / 16", "(737280 * 96) / 1048576")


@dataclass(slots=True)
class DemoOptions:
    sessions_per_tenant: int = 3
    # Forced tool calls per session, then one text answer. Two keep every tool in the run (the
    # second call cycles through them) and a paused context of about 40 pages; the engine's
    # CPU time grows with the turns and their contexts, and the HBM-only run recomputes them.
    tool_calls: int = 2
    # The tools the calls cycle through after the first web_fetch.
    tool_cycle: tuple[str, ...] = ("web_fetch", "search_docs", "calculator")
    # Characters of the user's own notes (passages of the repo's docs, different per session)
    # sent with the task: the private context an agent carries into its pauses.
    notes_chars: int = 0
    answer_tokens: int = 16
    fetch_median_s: float = 1.5
    fetch_sigma: float = 0.5
    fetch_range_s: tuple[float, float] = (0.5, 4.0)
    stagger_s: float = 0.4  # between the starts of a tenant's sessions
    # HBM holds this many sessions' final contexts: 2.5 of 6 (2 of 4 in --quick), fewer than
    # run, so paused sessions' pages go down to DRAM and NVMe.
    hbm_sessions: float = 2.5
    dram_sessions: float = 1.5  # and DRAM this many; NVMe holds the rest
    seed: int = 0
    verbose: bool = False  # a line per turn as it completes

    @classmethod
    def quick(cls) -> DemoOptions:
        return cls(sessions_per_tenant=2, tool_calls=2, fetch_median_s=1.2, fetch_range_s=(0.4, 3.0),
                   hbm_sessions=2.0, dram_sessions=1.0)

    @property
    def num_sessions(self) -> int:
        return self.sessions_per_tenant * len(TENANTS)


@dataclass(slots=True)
class TurnRecord:
    """One request of one agent session, as the OpenAI client saw it."""

    mode: str  # "tiered" or "hbm_only"
    tenant: str
    session: int
    turn: int  # 0: the first request; later ones resume after a tool call
    tool: str | None  # the tool this turn was forced to call; None for the final answer
    after_tool: str | None  # the tool whose result this turn carries
    ttft_ms: float  # request sent -> first chunk received
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]
    promoted_tokens: int

    @property
    def is_resume(self) -> bool:
        return self.turn > 0


@dataclass(slots=True)
class ModeResult:
    mode: str
    records: list[TurnRecord]
    transcript: list[dict[str, Any]]  # the messages of tenant-a's first session, as sent
    prefetch: dict[str, Any]
    wall_s: float
    fetch_s: list[float] = field(default_factory=list)
    hbm_pages: int = 0
    dram_pages: int = 0
    nvme_pages: int = 0


# ---------------------------------------------------------------------------- tools


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / % **, parentheses), or why not."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        raise ValueError("not arithmetic")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: cannot evaluate {expression[:60]!r} ({type(exc).__name__})"
    return f"{expression.strip()} = {result:.6g}"


class DocSearch:
    """Paragraphs of the repository's README and docs/, ranked by the query's word overlap."""

    def __init__(self, root: Path) -> None:
        self.passages: list[tuple[str, str, set[str]]] = []
        for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError:
                continue
            for para in re.split(r"\n\s*\n", text):
                para = " ".join(para.split())
                if len(para) > 120 and not para.startswith(("|", "```")):
                    self.passages.append((str(path.relative_to(root)), para, _words(para)))

    def search(self, query: str) -> str:
        words = _words(query)
        if not self.passages:
            return "no documentation found"
        source, para, _ = max(self.passages, key=lambda p: len(words & p[2]))
        lower = para.lower()
        hits = [i for i in (lower.find(w) for w in words) if i >= 0]
        start = max(0, min(hits, default=0) - 40)  # the excerpt around the first word found
        return f"[{source}] {para[start:start + RESULT_CHARS]}"

    def notes(self, n: int, chars: int) -> str:
        """``chars`` characters of passages, starting at a place that differs for each ``n``."""
        if not self.passages:
            return ""
        out: list[str] = []
        i = (n * 7919) % len(self.passages)
        while sum(map(len, out)) < chars:
            out.append(self.passages[i % len(self.passages)][1])
            i += 1
        return "\n".join(out)[:chars]


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2}


def fetch_seconds(opts: DemoOptions, rng: random.Random) -> float:
    low, high = opts.fetch_range_s
    return min(high, max(low, opts.fetch_median_s * math.exp(rng.gauss(0.0, opts.fetch_sigma))))


# ---------------------------------------------------------------------------- agents


@dataclass(slots=True)
class Reply:
    ttft_ms: float
    content: str
    tool_calls: list[dict[str, Any]]
    usage: Any


async def chat_turn(client: Any, model: str, messages: list[dict[str, Any]], tool_choice: Any,
                    max_tokens: int, expected_ms: int | None = None) -> Reply:
    """One streamed chat completion: time to first chunk, the text, the tool calls (joined from
    their deltas) and the usage chunk. ``expected_ms``: how long the tool this turn calls
    usually takes, sent as ``X-Tool-Expected-Ms``, as an agent that knows its tools may."""
    headers = {"X-Tool-Expected-Ms": str(expected_ms)} if expected_ms is not None else None
    started = time.perf_counter()
    ttft: float | None = None
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage = None
    stream = await client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_headers=headers)
    async for chunk in stream:
        if ttft is None:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
    assert ttft is not None and usage is not None, "a streamed completion ends with a usage chunk"
    return Reply(ttft * 1e3, "".join(content), [calls[i] for i in sorted(calls)], usage)


async def run_tool(name: str, arguments: str, opts: DemoOptions, fetch_s: float, docs: DocSearch) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    value = str(next(iter(args.values()), "")) if isinstance(args, dict) and args else ""
    if name == "calculator":
        return calculate(value)
    if name == "search_docs":
        return docs.search(value)
    await asyncio.sleep(fetch_s)  # web_fetch: the simulated network
    para = docs.passages[zlib.crc32(value.encode()) % len(docs.passages)][1] if docs.passages else ""
    return f"Fetched {value[:60] or 'the page'} in {fetch_s:.1f} s: {para[:RESULT_CHARS]}"


@dataclass(frozen=True, slots=True)
class SessionPlan:
    tenant: str
    index: int
    task: str
    tools: tuple[str, ...]
    fetch_s: tuple[float, ...]  # one per web_fetch in ``tools``
    start_s: float


def make_plans(opts: DemoOptions) -> list[SessionPlan]:
    """The workload, deterministic in ``opts.seed``: every mode runs the same plans."""
    rng = random.Random(opts.seed)
    plans: list[SessionPlan] = []
    for s in range(opts.sessions_per_tenant):
        for t, tenant in enumerate(TENANTS):
            n = len(plans)
            # web_fetch first, so the longest pause comes while the context is already sizeable,
            # then the others in turn.
            cycle = opts.tool_cycle
            tools = tuple(cycle[(i + n) % len(cycle)] if i else "web_fetch" for i in range(opts.tool_calls))
            fetches = tuple(fetch_seconds(opts, rng) for t_ in tools if t_ == "web_fetch")
            plans.append(SessionPlan(tenant, s, TASKS[(s * len(TENANTS) + t) % len(TASKS)], tools, fetches,
                                     s * opts.stagger_s))
    return plans


def _argument_hint(tool: str, n: int) -> str:
    """A user nudge naming what to pass, so a small model's forced arguments are on topic."""
    if tool == "calculator":
        return f"Compute {EXPRESSIONS[n % len(EXPRESSIONS)]} with the calculator."
    if tool == "search_docs":
        return f"Search the docs for '{QUERIES[n % len(QUERIES)]}'."
    return f"Fetch https://docs.example.com/kvtier/{QUERIES[n % len(QUERIES)].replace(' ', '-')}."


async def agent_session(client: Any, model: str, plan: SessionPlan, mode: str, opts: DemoOptions,
                        docs: DocSearch, opened: asyncio.Event) -> tuple[list[TurnRecord], list[dict[str, Any]]]:
    """One agent. A tenant's first session opens the way (``opened``, set after its first turn):
    the others start after it, as later conversations of a deployed agent find its system
    prompt and tools already cached."""
    if plan.index > 0:
        await opened.wait()
    await asyncio.sleep(plan.start_s)
    task = plan.task
    if opts.notes_chars:
        task += "\n\nMy notes so far:\n" + docs.notes(plan.index * len(TENANTS) + TENANTS.index(plan.tenant),
                                                       opts.notes_chars)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPTS[plan.tenant]},
                                      {"role": "user", "content": task}]
    records: list[TurnRecord] = []
    fetches = iter(plan.fetch_s)
    after: str | None = None
    for turn in range(len(plan.tools) + 1):
        tool = plan.tools[turn] if turn < len(plan.tools) else None
        if tool is not None:
            messages.append({"role": "user", "content": _argument_hint(tool, plan.index + turn)})
            choice: Any = {"type": "function", "function": {"name": tool}}
            expected = round(opts.fetch_median_s * 1000) if tool == "web_fetch" else None
            reply = await chat_turn(client, model, messages, choice, 32, expected)
        else:
            messages.append({"role": "user", "content": "Now answer my question in one sentence, in plain words."})
            reply = await chat_turn(client, model, messages, "none", opts.answer_tokens)
        records.append(_record(mode, plan, turn, tool, after, reply))
        opened.set()
        if opts.verbose:
            r = records[-1]
            print(f"  {mode} {plan.tenant}/{plan.index} turn {turn} {tool or 'answer'}: ttft {r.ttft_ms:.0f} ms, "
                  f"cached {r.cached_tokens}/{r.prompt_tokens} {r.cached_by_tier}", flush=True)
        if tool is None:
            messages.append({"role": "assistant", "content": reply.content})
            break
        messages.append({"role": "assistant", "content": reply.content or None, "tool_calls": reply.tool_calls})
        for call in reply.tool_calls:
            fetch = next(fetches) if call["function"]["name"] == "web_fetch" else 0.0
            result = await run_tool(call["function"]["name"], call["function"]["arguments"], opts, fetch, docs)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        after = tool
    return records, messages


def _record(mode: str, plan: SessionPlan, turn: int, tool: str | None, after: str | None, reply: Reply) -> TurnRecord:
    usage = reply.usage
    extra = (usage.model_extra or {}).get("kvtier") or {}
    tiers = extra.get("cached_tokens_by_tier") or {"hbm": 0, "dram": 0, "nvme": 0}
    details = usage.prompt_tokens_details
    return TurnRecord(mode, plan.tenant, plan.index, turn, tool, after, reply.ttft_ms, usage.prompt_tokens,
                      details.cached_tokens if details is not None else 0, dict(tiers),
                      int(extra.get("promoted_tokens") or 0))


# ---------------------------------------------------------------------------- one mode


def page_bytes(checkpoint: Path, page_size: int = PAGE_SIZE) -> int:
    """Bytes of one KV page of ``checkpoint`` in fp32 (the CPU KV element type)."""
    config = json.loads((checkpoint / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * 4 * page_size


def session_pages(opts: DemoOptions) -> int:
    """About how many pages a session's final context fills: the system prompt and task, then
    per tool call the nudge, the call and its result (a fetched page is the largest)."""
    return math.ceil((340 + opts.notes_chars / 4 + opts.tool_calls * 155 + opts.answer_tokens) / PAGE_SIZE)


def stack_options(mode: str, opts: DemoOptions, checkpoint: Path, state_dir: Path) -> StackOptions:
    pages = session_pages(opts)
    hbm = math.ceil(opts.hbm_sessions * pages)
    dram = math.ceil(opts.dram_sessions * pages) if mode == "tiered" else 0
    nvme = 2 * opts.num_sessions * pages if mode == "tiered" else 0
    size = page_bytes(checkpoint)
    return StackOptions(state_dir=state_dir, model=checkpoint, page_size=PAGE_SIZE, hbm_bytes=hbm * size,
                        dram_bytes=dram * size, nvme_bytes=nvme * size, auth=True, max_restarts=0)


async def add_tenant_keys(stack: LocalStack) -> dict[str, str]:
    """A fresh frontend key per tenant in the stack's token table; waits until servers re-read it."""
    from kvtier.rpc.auth import Role, TokenEntry, append_entry, hash_token, new_token

    table = stack.options.state_dir / AUTH_DIR / TOKEN_TABLE_FILE
    keys = {tenant: new_token() for tenant in TENANTS}
    for tenant, key in keys.items():
        append_entry(table, TokenEntry(f"demo-{tenant}", Role.FRONTEND, frozenset({tenant}), hash_token(key)))
    await asyncio.sleep(2.0)  # servers re-read a changed token table within a second
    return keys


async def run_mode(mode: str, opts: DemoOptions, checkpoint: Path, state_dir: Path, docs: DocSearch,
                   log: Any = print) -> ModeResult:
    """Start a stack and its gateway for ``mode``, run every agent session, stop it."""
    try:
        import openai
    except ImportError:
        raise FailedPrecondition("the demo's agents use the openai SDK: python -m pip install 'openai==3.51.0' "
                                 "(make setup installs it)") from None

    from kvtier.local.frontend import start_gateway

    options = stack_options(mode, opts, checkpoint, state_dir)
    size = page_bytes(checkpoint)
    hbm_pages = (options.hbm_bytes or 0) // size
    stack = await start_local_stack(options)
    try:
        gateway = await start_gateway(stack, checkpoint, port=0)
        try:
            keys = await add_tenant_keys(stack)
            # The SDK's own retries (2), as any OpenAI client has them: a 503 or 429 is retried.
            clients = {t: openai.AsyncOpenAI(base_url=gateway.base_url, api_key=k, max_retries=2, timeout=600)
                       for t, k in keys.items()}
            plans = make_plans(opts)
            log(f"{mode}: {len(plans)} agent sessions in {len(TENANTS)} tenants via {gateway.base_url}; HBM "
                f"{hbm_pages} pages, DRAM {options.dram_bytes // size}, "
                f"NVMe {options.nvme_bytes // size}")
            started = time.perf_counter()
            opened = {t: asyncio.Event() for t in TENANTS}
            results = await asyncio.gather(*(agent_session(clients[p.tenant], gateway.model.name, p, mode, opts, docs,
                                                           opened[p.tenant]) for p in plans))
            wall_s = time.perf_counter() - started
            for client in clients.values():
                await client.close()
            orchestrator = stack.controller.orchestrator
            prefetch = _prefetch(orchestrator.stats if orchestrator is not None else None)
        finally:
            await gateway.stop()
    finally:
        await stack.stop()
    records = [r for session, _ in results for r in session]
    transcript = next(msgs for (_, msgs), p in zip(results, plans, strict=True)
                      if p.tenant == TENANTS[0] and p.index == 0)
    return ModeResult(mode, records, transcript, prefetch, wall_s,
                      [f for p in plans for f in p.fetch_s], hbm_pages,
                      options.dram_bytes // size, options.nvme_bytes // size)


def _prefetch(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    scored = stats.num_on_time + stats.num_late
    return {"parked": stats.num_demoted, "kept_in_hbm": stats.num_kept_in_hbm, "prefetched": stats.num_prefetched,
            "on_time": stats.num_on_time, "late": stats.num_late,
            "on_time_fraction": stats.num_on_time / scored if scored else None}


async def run_demo(opts: DemoOptions, state_dir: Path, checkpoint: Path | None = None, *,
                   log: Any = print) -> list[ModeResult]:
    """The workload tiered, then with tiering off; one Ray instance for both."""
    import ray

    checkpoint = checkpoint or real_model.ensure_checkpoint(real_model.default_cache_dir())
    docs = DocSearch(Path(__file__).resolve().parents[2])
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False,
                 log_to_driver=False)
    try:
        results = []
        for mode in ("tiered", "hbm_only"):
            results.append(await run_mode(mode, opts, checkpoint, state_dir / mode, docs, log))
        return results
    finally:
        if started_ray:
            ray.shutdown()
