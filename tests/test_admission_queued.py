"""``Admission.release_queued`` (worker/admission.py) on a real small engine: a request handed
to the engine keeps its cached pages pinned in HBM until its first step; when the queue's head
needs those pages' room and nothing runs, the engine admits nothing, step after step, until the
queued requests' pins are released. Driven step by step here, as ``EngineLoop`` drives it."""

from __future__ import annotations

import pytest

from kvtier.domain.records import GenerateRequest
from kvtier.engine import Engine, SamplingParams
from kvtier.tiers.manager import TierConfig
from kvtier.worker.admission import Admission
from kvtier.worker.holds import Holds
from kvtier.worker.room import Room

from hf_checkpoints import build_checkpoint

PAGE_SIZE = 4
NUM_PAGES = 16
STALLED_STEPS = 5


def _run_to_end(engine: Engine, prompt: list[int]) -> None:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not any(o.request_id == rid and o.finished for o in engine.step()):
        pass
    engine.pop_result(rid)


@pytest.fixture
def engine(tmp_path):
    ckpt = build_checkpoint(tmp_path / "llama", "llama", seed=3)
    # A tier manager with no lower tier: nothing leaves HBM, so room is only free or evictable pages.
    engine = Engine.from_pretrained(ckpt, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
                                    tier_config=TierConfig(dram_pages=0))
    yield engine
    engine.tiers.close()


def test_queued_pins_stall_the_queues_head_until_released(engine):
    holds = Holds(engine, hold_fraction=None)
    admission: Admission[str] = Admission(engine, holds, Room(engine, holds))
    cached = list(range(10, 10 + 8 * PAGE_SIZE))  # 8 pages, cached in HBM once it has run
    _run_to_end(engine, cached)
    # The head: 10 pages of a new prompt, more than the free pages alone (16 - 8 cached).
    head = engine.enqueue(list(range(200, 200 + 10 * PAGE_SIZE - 2)), SamplingParams(max_tokens=1, ignore_eos=True))
    # Behind it, a turn on the cached prompt: short of room (the head's pages are promised), it
    # waits; once ready it is handed to the engine with its cached chain pinned.
    turn = GenerateRequest(namespace=engine.namespace, prompt_token_ids=tuple(cached + [7, 8]),
                           sampling=SamplingParams(max_tokens=1, ignore_eos=True))
    assert admission.offer("turn", "turn", turn, engine.digest_for(None))
    assert [a.run for a in admission.ready()] == ["turn"]
    engine.enqueue(list(turn.prompt_token_ids), turn.sampling, request_id="turn")

    for _ in range(STALLED_STEPS):  # nothing runs, and the head never fits: the turn's pin holds its room
        assert engine.step(release_pin=holds.yield_weakest) == [] and engine.num_running == 0
    assert admission.release_queued() == 1 and admission.release_queued() == 0
    outputs = engine.step(release_pin=holds.yield_weakest)
    assert head in {o.request_id for o in outputs}  # admitted and stepped: prefill and its one token
    while engine.has_unfinished():  # the turn follows; its pages may have left HBM with the pin
        engine.step(release_pin=holds.yield_weakest)
    engine.check_integrity()  # raises with the numbers when pages leaked
