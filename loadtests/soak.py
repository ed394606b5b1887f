"""Bounded soak of the local stack: 32 agent sessions with tool pauses, memory and integrity watched.

    python -m loadtests.soak [--duration-s 300] [--sessions 32] [--json] [--plot PATH]

Starts the local stack (``kvtier up``'s code: Valkey, Ray, the controller in this process,
one worker actor) and runs ``--sessions`` agent sessions until the deadline. A session is a
conversation of turns: each turn routes and generates (session affinity, the previous
context plus a few new tokens), then usually calls a tool — ``Pause`` with the tool's
expected duration, a wait, ``Returning``, and the next turn; after a few turns it ``End``s
and a new session takes its place. Every second the resident memory (RSS) of each process
is sampled: the controller (this process, with the client), each worker, and valkey-server.

Reported: requests and errors (any failed call), p50/p99 TTFT and TPOT (client-side),
RSS per process over time, ``rss_growth`` — the largest relative growth of any process's
RSS from the end of the warm-up (the first ``--warmup-fraction`` of the run) to the mean of
the last tenth — and page integrity after the load: once idle every worker must hold no
page (``leaked_pages`` counts pages still in use) and pass ``CheckIntegrity``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.client import AsyncClient
from kvtier.domain.params import SamplingParams
from kvtier.domain.records import TokenChunk

DEFAULT_DURATION_S = 300.0
DEFAULT_SESSIONS = 32
SAMPLE_INTERVAL_S = 1.0
TURNS_PER_SESSION = (3, 6)  # a session ends after this many turns (uniform)
TOOL_PROBABILITY = 0.8  # a turn ends in a tool call
TOOL_MS = (200, 1500)  # tool durations, uniform
SYSTEM_PROMPT_TOKENS = 64  # shared by every session (a cached prefix)
TURN_TOKENS = (8, 24)  # new user/tool tokens per turn
MAX_TOKENS = 16  # generated per turn
MAX_CONTEXT_TOKENS = 768  # a session that would grow past this ends early
IDLE_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- memory


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (Linux /proc), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every descendant of ``pid``."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append((int(entry), name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def stack_processes(stack: Any) -> dict[str, int]:
    """Process name -> pid for the controller (this process), each worker actor, and valkey."""
    import ray

    processes = {"controller": os.getpid()}
    for worker in stack.workers:
        processes[worker.worker_id] = ray.get(worker.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    for pid, name in _children(os.getpid()):
        if name.startswith(("valkey", "redis")):
            processes["valkey"] = pid
    return processes


@dataclass
class Sampler:
    processes: dict[str, int]
    started_at: float = field(default_factory=time.monotonic)
    times_s: list[float] = field(default_factory=list)
    rss: dict[str, list[int | None]] = field(default_factory=dict)

    def sample(self) -> None:
        self.times_s.append(time.monotonic() - self.started_at)
        for name, pid in self.processes.items():
            self.rss.setdefault(name, []).append(rss_bytes(pid))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_INTERVAL_S)
            except TimeoutError:
                pass
        self.sample()

    def growth(self, warmup_s: float) -> dict[str, float]:
        """Per process: (mean RSS of the last tenth of the run) / (RSS at the end of warm-up) - 1."""
        result = {}
        end_s = self.times_s[-1]
        for name, values in self.rss.items():
            series = [(t, v) for t, v in zip(self.times_s, values, strict=True) if v is not None]
            after = [v for t, v in series if t >= warmup_s]
            if len(after) < 2:
                continue
            tail = [v for t, v in series if t >= max(warmup_s, end_s - (end_s - warmup_s) / 10)] or after[-1:]
            result[name] = sum(tail) / len(tail) / after[0] - 1.0
        return result


# --------------------------------------------------------------------------- load


@dataclass
class Stats:
    requests: int = 0
    hints: int = 0
    sessions: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)

    def error(self, what: str, exc: BaseException) -> None:
        self.errors.append(f"{what}: {type(exc).__name__}: {exc}")


async def _turn(client: AsyncClient, stats: Stats, namespace: Any, session: str, prompt: list[int]) -> list[int]:
    started = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    async for event in client.generate(namespace, prompt, sampling, session_id=session, deadline_s=60):
        if isinstance(event, TokenChunk):
            last = time.perf_counter()
            first = first or last
            tokens.extend(event.token_ids)
    stats.requests += 1
    if first is not None and last is not None:
        stats.ttft_s.append(first - started)
        if len(tokens) > 1:
            stats.tpot_s.append((last - first) / (len(tokens) - 1))
    return tokens


async def _session_loop(
    client: AsyncClient, stats: Stats, namespace: Any, vocab: int, slot: int, deadline: float, system: list[int]
) -> None:
    rng = random.Random(slot)
    generation = 0
    while time.monotonic() < deadline:
        session = f"soak-{slot}-{generation}"
        generation += 1
        stats.sessions += 1
        context = list(system)
        for _ in range(rng.randint(*TURNS_PER_SESSION)):
            if time.monotonic() >= deadline or len(context) > MAX_CONTEXT_TOKENS:
                break
            context += [rng.randrange(vocab) for _ in range(rng.randint(*TURN_TOKENS))]
            try:
                context += await _turn(client, stats, namespace, session, context)
            except Exception as exc:  # counted: a soak reports errors, it does not stop at one
                stats.error("generate", exc)
                break
            if rng.random() < TOOL_PROBABILITY:
                tool_ms = rng.randint(*TOOL_MS)
                try:
                    await client.pause(session, tool=f"tool-{rng.randrange(4)}", expected_ms=tool_ms)
                    stats.hints += 1
                    await asyncio.sleep(tool_ms / 1000 * rng.uniform(0.7, 1.3))
                    await client.returning(session)
                    stats.hints += 1
                except Exception as exc:
                    stats.error("pause/returning", exc)
        try:
            await client.end(session, drop=True)
            stats.hints += 1
        except Exception as exc:
            stats.error("end", exc)


async def _integrity(client: AsyncClient, addresses: list[str]) -> tuple[int, list[str]]:
    """Pages still in use once every worker is idle, and integrity problems."""
    leaked, problems = 0, []
    for address in addresses:
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            stats = await client.worker_stats(address)
            in_use = sum(t.in_use_pages for t in stats.tiers)
            if (in_use == 0 and stats.queue_depth == 0 and stats.num_running_seqs == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        leaked += in_use
        result = await client.check_integrity(address)
        problems += [f"{address}: {p}" for p in result.problems]
    return leaked, problems


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def soak(
    duration_s: float, num_sessions: int = DEFAULT_SESSIONS, warmup_fraction: float = 0.2,
    log: Any = None,
) -> dict[str, Any]:
    """Run the soak on a fresh local stack; the result (see the module docstring)."""
    from kvtier.local.stack import StackOptions, start_local_stack

    say = log or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
        stack = await start_local_stack(StackOptions(state_dir=Path(tmp), num_workers=1))
        try:
            processes = await asyncio.get_running_loop().run_in_executor(None, stack_processes, stack)
            say(f"stack up: {processes}; soaking {num_sessions} sessions for {duration_s:g} s")
            sampler = Sampler(processes)
            stop = asyncio.Event()
            sampling = asyncio.create_task(sampler.run(stop))
            stats = Stats()
            rng = random.Random(0)
            system = [rng.randrange(stack.vocab_size) for _ in range(SYSTEM_PROMPT_TOKENS)]
            started = time.monotonic()
            async with AsyncClient(stack.controller_address, timeout_s=60) as client:
                await asyncio.gather(*(
                    _session_loop(client, stats, stack.namespace, stack.vocab_size, slot, started + duration_s, system)
                    for slot in range(num_sessions)
                ))
                elapsed_s = time.monotonic() - started
                leaked, problems = await _integrity(client, [w.address for w in stack.workers])
            stop.set()
            await sampling
        finally:
            await stack.stop()
    growth = sampler.growth(warmup_fraction * duration_s)
    return {
        "duration_s": round(elapsed_s, 1),
        "sessions": num_sessions,
        "sessions_run": stats.sessions,
        "requests": stats.requests,
        "session_hints": stats.hints,
        "errors": len(stats.errors),
        "error_samples": stats.errors[:10],
        "leaked_pages": leaked,
        "integrity_problems": problems,
        "rss_growth": max(growth.values()) if growth else None,
        "rss_growth_by_process": growth,
        "warmup_s": warmup_fraction * duration_s,
        "ttft_ms": {"p50": _ms(_pct(stats.ttft_s, 0.5)), "p99": _ms(_pct(stats.ttft_s, 0.99))},
        "tpot_ms": {"p50": _ms(_pct(stats.tpot_s, 0.5)), "p99": _ms(_pct(stats.tpot_s, 0.99))},
        "rss_mib": {
            "times_s": [round(t, 2) for t in sampler.times_s],
            **{name: [None if v is None else round(v / 2**20, 2) for v in values] for name, values in sampler.rss.items()},
        },
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def write_plot(result: dict[str, Any], path: Path) -> Path:
    """RSS (MiB) of every process over the run, the warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rss = result["rss_mib"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, values in rss.items():
        if name != "times_s":
            ax.plot(rss["times_s"], values, label=name)
    ax.axvspan(0, result["warmup_s"], color="0.9", label="warm-up")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("RSS (MiB)")
    growth = result["rss_growth"]
    ax.set_title(
        f"kvtier soak: {result['sessions']} sessions, {result['requests']} requests, {result['errors']} errors, "
        f"{result['leaked_pages']} leaked pages, RSS growth {growth:+.1%}" if growth is not None else "kvtier soak",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary(result: dict[str, Any]) -> str:
    growth = result["rss_growth_by_process"]
    return "\n".join([
        f"soak: {result['duration_s']} s, {result['sessions']} concurrent sessions ({result['sessions_run']} run), "
        f"{result['requests']} requests, {result['session_hints']} session hints",
        f"errors: {result['errors']}  leaked pages: {result['leaked_pages']}  "
        f"integrity problems: {len(result['integrity_problems'])}",
        f"TTFT p50/p99: {result['ttft_ms']['p50']} / {result['ttft_ms']['p99']} ms   "
        f"TPOT p50/p99: {result['tpot_ms']['p50']} / {result['tpot_ms']['p99']} ms",
        "RSS growth after warm-up: " + ", ".join(f"{name} {g:+.1%}" for name, g in growth.items()),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=DEFAULT_DURATION_S, help="how long to run (bounded)")
    parser.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS, help="concurrent sessions")
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="share of the run before RSS growth is measured")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plot", type=Path, help="write RSS over time to this PNG")
    args = parser.parse_args(argv)
    if not args.duration_s > 0 or args.sessions < 1 or not 0 <= args.warmup_fraction < 1:
        parser.error("--duration-s must be > 0, --sessions >= 1, --warmup-fraction in [0, 1)")
    result = asyncio.run(soak(args.duration_s, args.sessions, args.warmup_fraction,
                              log=lambda m: print(m, file=sys.stderr, flush=True)))
    if args.plot:
        write_plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else summary(result))
    return 0 if result["errors"] == 0 and result["leaked_pages"] == 0 and not result["integrity_problems"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
