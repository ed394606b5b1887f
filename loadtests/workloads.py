"""Seeded generators of prefix-chained request traces, each a differently shaped workload.

    python -m loadtests.workloads NAME [--seed N] [--out FILE]   (writes Mooncake-format JSONL)

Every generator returns records in the Mooncake trace's format (``timestamp`` in ms,
``input_length``, ``output_length``, ``hash_ids``: the i-th 512-token block together with
everything before it, so two requests share a prefix of k blocks exactly when their first k
ids are equal), sorted by arrival. The same seed gives the same trace. Sizes are chosen so
that 1k, 10k and 50k blocks span "far too small" to "nearly everything fits"
(about 100k block references, 25k-60k distinct blocks).

The shapes, with the parameters each draws from (all assumptions of this generator, written
down so that a reader can judge them; none is fitted to a policy):

``chat``       multi-turn conversations. Sessions start as a Poisson process; each picks one
               of 20 system prompts (1-4 blocks, Zipf-popular), runs a geometric number of
               turns (mean 5), each turn adds a user message and a reply (1-3 blocks), and the
               user thinks between turns for a lognormal time (median 40 s, sigma 1.2: most
               replies within a minute, a long tail of users who come back much later).
``agent``      tool-calling agents. Four tenants with a long system prompt each (6-12 blocks);
               sessions of 5-16 steps, each step appends one tool result block (sometimes
               two); between steps a tool runs for a lognormal time by tool kind (median
               0.5 s, 2 s, 8 s or 60 s; sigma 0.5), and the agent's own turn takes ~1 s.
``rag``        retrieval-augmented questions over a shared corpus: a system prompt (2 blocks),
               then one of 3,000 documents (2-10 blocks) drawn Zipf(1.1) by popularity, then
               a question (1 block) that is new every time. Only the documents repeat, and
               only as the first one after the prompt, as a retriever's top hit would.
``fewshot``    few-shot prompts across tenants: 200 tenants (Zipf(0.9) popular) with a
               few-shot prompt of 4-24 blocks each, followed by a 1-2 block query; tenants'
               prompts change version now and then (every ~2,000 of their requests on
               average), so a popular prefix also goes stale.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

Record = dict[str, object]
BLOCK_TOKENS = 512


@dataclass(slots=True)
class _Ids:
    """Fresh block ids: one counter per trace, so no two contents share an id by accident."""

    next_id: int = 1

    def take(self, n: int) -> list[int]:
        start = self.next_id
        self.next_id += n
        return list(range(start, start + n))


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def _record(t_ms: float, ids: list[int], output_blocks: int = 1) -> Record:
    return {
        "timestamp": int(t_ms),
        "input_length": BLOCK_TOKENS * len(ids),
        "output_length": BLOCK_TOKENS * output_blocks,
        "hash_ids": list(ids),
    }


@dataclass(slots=True)
class _Sessions:
    """Sessions whose turns are scheduled ahead: (time, order, context) in arrival order."""

    records: list[tuple[float, int, Record]] = field(default_factory=list)

    def add(self, t_ms: float, ids: list[int], output_blocks: int = 1) -> None:
        self.records.append((t_ms, len(self.records), _record(t_ms, ids, output_blocks)))

    def sorted(self) -> list[Record]:
        return [r for _, _, r in sorted(self.records, key=lambda x: (x[0], x[1]))]


def chat(seed: int = 0, num_sessions: int = 4_500) -> list[Record]:
    rng = random.Random(seed)
    ids = _Ids()
    prompts = [ids.take(rng.randint(1, 4)) for _ in range(20)]
    weights = _zipf_weights(len(prompts), 1.0)
    out = _Sessions()
    t = 0.0
    for _ in range(num_sessions):
        t += rng.expovariate(1 / 400.0)  # a new session every 0.4 s on average
        context = list(rng.choices(prompts, weights)[0])
        turn_t = t
        num_turns = 1 + int(rng.expovariate(1 / 4.0))
        for _turn in range(num_turns):
            context += ids.take(rng.randint(1, 2))  # the user's message
            out.add(turn_t, context, 1)
            context += ids.take(rng.randint(0, 1))  # the reply, part of the next turn's prefix
            turn_t += 1000.0 * rng.lognormvariate(math.log(40.0), 1.2)
    return out.sorted()


TOOL_MEDIANS_S = (0.5, 2.0, 8.0, 60.0)


def agent(seed: int = 0, num_sessions: int = 1_200) -> list[Record]:
    rng = random.Random(seed)
    ids = _Ids()
    prompts = [ids.take(rng.randint(6, 12)) for _ in range(4)]
    out = _Sessions()
    t = 0.0
    for _ in range(num_sessions):
        t += rng.expovariate(1 / 1_500.0)
        context = list(rng.choice(prompts)) + ids.take(1)  # the task
        step_t = t
        for _step in range(rng.randint(5, 16)):
            out.add(step_t, context, 1)
            tool_s = rng.lognormvariate(math.log(rng.choice(TOOL_MEDIANS_S)), 0.5)
            step_t += 1000.0 * (1.0 + tool_s)
            context += ids.take(1 if rng.random() < 0.7 else 2)  # the call and its result
    return out.sorted()


def rag(seed: int = 0, num_requests: int = 14_000) -> list[Record]:
    rng = random.Random(seed)
    ids = _Ids()
    prompt = ids.take(2)
    docs = [ids.take(rng.randint(2, 10)) for _ in range(3_000)]
    weights = _zipf_weights(len(docs), 1.1)
    records = []
    t = 0.0
    for _ in range(num_requests):
        t += rng.expovariate(1 / 100.0)
        doc = rng.choices(docs, weights)[0]
        records.append(_record(t, prompt + doc + ids.take(1)))
    return records


def fewshot(seed: int = 0, num_requests: int = 9_000) -> list[Record]:
    rng = random.Random(seed)
    ids = _Ids()
    num_tenants = 200
    lengths = [rng.randint(4, 24) for _ in range(num_tenants)]
    prompts = [ids.take(n) for n in lengths]
    weights = _zipf_weights(num_tenants, 0.9)
    records = []
    t = 0.0
    for _ in range(num_requests):
        t += rng.expovariate(1 / 150.0)
        tenant = rng.choices(range(num_tenants), weights)[0]
        if rng.random() < 1 / 2_000:
            prompts[tenant] = ids.take(lengths[tenant])  # a new prompt version
        records.append(_record(t, prompts[tenant] + ids.take(rng.randint(1, 2))))
    return records


GENERATORS: dict[str, Callable[..., list[Record]]] = {"chat": chat, "agent": agent, "rag": rag, "fewshot": fewshot}


def generate(name: str, seed: int = 0) -> list[Record]:
    generator = GENERATORS.get(name)
    if generator is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(GENERATORS)}")
    return generator(seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.workloads", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(GENERATORS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSONL file (default: stdout)")
    args = parser.parse_args(argv)
    lines = "".join(json.dumps(r) + "\n" for r in generate(args.name, args.seed))
    if args.out:
        with open(args.out, "w") as f:
            f.write(lines)
    else:
        sys.stdout.write(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
