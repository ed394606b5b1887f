"""The agent workload calibrated to the engine it runs on: measured speeds in, slow-down and links out.

The agent workload (``loadtests/agent_workload.py``) sets durations — tool pauses, session
starts, the prefetch margin — against an engine of a given speed, and emulates a GPU's links at
a given ratio to that engine. The same durations mean something else on an engine several times
slower: turns queue behind each other and every ratio measures the backlog. So a run measures,
at start, on the workload's own model and geometry (``measure_machine``):

* a first turn: the prefill of a session's first context (system prompt + user message) to its
  first token, nothing cached;
* a resume: that context plus a turn's output and a tool result, the context cached, to its
  first token (the prefill of the new tokens only);

each the median of a few alternating repeats, so a busy machine slows both as it slows the run.
``calibrate`` turns them into the run's factors, pure arithmetic:

* ``slow_down`` = the larger of (first turn / the design's) and (resume / the design's), never
  below 1 (a faster engine only adds slack) and at most ``MAX_WAIT_SCALE``: the workload played
  as many times slower as this engine is slower than the design's (``--slow-down``'s doc);
* emulated links = the design's: a GPU's ratio of PCIe and NVMe to its HBM, at the design
  machine's memcpy (28 GB/s), which ``slow_down`` divides as it divides every rate. A transfer
  then keeps the design's ratio to a resume whatever the machine: the headline compares resumes
  that wait for transfers with resumes that do not, and that ratio is what it means. (Links
  scaled to this machine's own memcpy would count a slow machine twice: once in its memcpy, once
  in the slow-down.)

``DESIGN`` is the design engine's speed: the first turn and resume the workload's durations were
set against (the module doc of ``agent_workload``: a first turn ~0.2 s and a resume ~30 ms to
first token). The probe times the engine alone, without the RPC hops of a turn through the stack
(a few ms), so on a machine where those hops weigh more than the engine the derived slow-down
errs low.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from kvtier.runtime.config import MAX_WAIT_SCALE

# A GPU's bandwidths (H100/H200 class, PCIe 4 x16, one fast NVMe): the ratios the links keep.
GPU_HBM_BYTES_PER_S, GPU_PCIE_BYTES_PER_S, GPU_NVME_BYTES_PER_S = 3e12, 25e9, 7e9
DESIGN_MEMCPY_BYTES_PER_S = 28e9  # the design machine's host memcpy: torch copy_ of 256 MiB fp32


class MachineSpeed(NamedTuple):
    """What ``measure_machine`` measured (or the design's reference), to first token."""

    first_turn_ms: float
    resume_ms: float


class Calibration(NamedTuple):
    """The factors a run plays the workload with: ``WorkloadSpec.slow_down`` and
    ``WorkloadSpec.emulated_link_bytes_per_s`` (before ``slow_down`` divides them)."""

    slow_down: float
    emulated_link_bytes_per_s: dict[str, float]


DESIGN = MachineSpeed(first_turn_ms=200.0, resume_ms=30.0)


def emulated_links(memcpy_bytes_per_s: float) -> dict[str, float]:
    """HBM <-> DRAM (PCIe) and HBM <-> NVMe at a GPU's ratio to its HBM, scaled to this memcpy."""
    return {
        "dram": memcpy_bytes_per_s * GPU_PCIE_BYTES_PER_S / GPU_HBM_BYTES_PER_S,
        "nvme": memcpy_bytes_per_s * GPU_NVME_BYTES_PER_S / GPU_HBM_BYTES_PER_S,
    }


DESIGN_LINK_BYTES_PER_S = emulated_links(DESIGN_MEMCPY_BYTES_PER_S)  # dram 233 MB/s, nvme 65 MB/s


def calibrate(measured: MachineSpeed, design: MachineSpeed = DESIGN) -> Calibration:
    """The run's factors for an engine that measured ``measured`` (module doc)."""
    if min(*measured, *design) <= 0:
        raise ValueError(f"speeds must be positive: measured {measured}, design {design}")
    slower = max(measured.first_turn_ms / design.first_turn_ms, measured.resume_ms / design.resume_ms)
    slow_down = round(min(max(slower, 1.0), MAX_WAIT_SCALE), 2)
    return Calibration(slow_down, dict(DESIGN_LINK_BYTES_PER_S))


def measure_machine(model_config: dict, *, context_tokens: int, resume_tokens: int, page_size: int,
                    repeats: int = 5) -> MachineSpeed:
    """First-turn and resume times to first token on ``model_config`` (a random checkpoint of it),
    medians of ``repeats`` (module doc). ``context_tokens``: a first turn's
    prompt; ``resume_tokens``: what a resume adds to it. Takes a few seconds."""
    import torch

    from kvtier.engine import Engine, SamplingParams
    from kvtier.engine.model.loader import write_random_checkpoint

    vocab = model_config["vocab_size"]
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    def to_first_token(engine: Engine, prompt: list[int]) -> float:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        elapsed = time.perf_counter() - start
        engine.pop_result(rid)
        return elapsed

    with tempfile.TemporaryDirectory(prefix="kvtier-calibrate-") as tmp:
        path = write_random_checkpoint(Path(tmp) / "model", model_config, seed=0)
        pages_per_turn = (context_tokens + resume_tokens) // page_size + 2
        engine = Engine.from_pretrained(path, page_size=page_size, num_pages=pages_per_turn * (2 * repeats + 2))
        to_first_token(engine, tokens(context_tokens))  # warm-up
        first, resume = [], []
        for _ in range(repeats):
            context = tokens(context_tokens)  # a new session: nothing of it is cached
            first.append(to_first_token(engine, context))
            resume.append(to_first_token(engine, context + tokens(resume_tokens)))
        del engine
    return MachineSpeed(statistics.median(first) * 1e3, statistics.median(resume) * 1e3)
