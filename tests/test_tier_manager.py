"""Tiering inside the engine: demotion, verified promotion, recovery — against the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier.domain.hashing import page_keys
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams, SchedulerConfig
from kvtier.tiers.manager import TierConfig, Watermark
from kvtier.tiers.moves import MoveOutcome
from kvtier.tiers.transfer import TransferReason

from hf_checkpoints import build_checkpoint, hf_logits, load_hf

PS = 4
# The GPU check runs these tests with KVTIER_TEST_DEVICE=cuda: HBM on the device, DRAM pinned,
# copies on the transfer engine's CUDA streams, checksums summed in HBM (the oracle stays on CPU).
DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tier-ckpt") / "llama", "llama", seed=7)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf(ckpt)


def shadow_keys(engine) -> set:
    """Keys of the pages that have a copy below kept as a shadow (decision 0012), any tier."""
    return engine.tiers.shadows.keys()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiered(ckpt, tmp_path, *, num_pages=256, dram=64, nvme=64, page_size=PS, **kwargs) -> Engine:
    config = TierConfig(dram_pages=dram, nvme_slots=nvme, nvme_dir=tmp_path / "nvme" if nvme else None)
    return Engine.from_pretrained(
        ckpt, page_size=page_size, num_pages=num_pages, tier_config=config, device=DEVICE, **kwargs
    )


def plain(ckpt, **kwargs) -> Engine:
    return Engine.from_pretrained(ckpt, page_size=PS, num_pages=256, device=DEVICE, **kwargs)


def assert_oracle(hf, result):
    full = result.prompt_token_ids + result.token_ids
    ref = hf_logits(hf, full)
    p = len(result.prompt_token_ids)
    for i, row in enumerate(result.logits):
        torch.testing.assert_close(row.cpu(), ref[p - 1 + i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("down_to", [Tier.DRAM, Tier.NVME])
def test_prefix_moved_down_and_back_equals_oracle_and_unmoved_run(ckpt, hf, tmp_path, down_to):
    engine = tiered(ckpt, tmp_path, record_logits=True)
    base = prompt(14, seed=1)  # 3 full pages + 2 tokens
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.generate([base], params)
    moved = engine.tiers.demote_all(down_to)
    counts = engine.index.count_by_tier()
    # 14 + 10 tokens, 23 with K/V: 5 full pages, every one now in the lower tier.
    assert moved >= 5 and counts[Tier.HBM] == 0 and counts[down_to] == 5
    engine.check_integrity()

    follow = base[:12] + [5, 6, 7]
    r = engine.generate([follow], params)[0]
    assert r.num_cached_tokens == 12 and r.num_promoted_tokens == 12
    assert r.token_ids == plain(ckpt).generate([follow], params)[0].token_ids
    assert_oracle(hf, r)
    stats = engine.tiers.transfers.stats()
    assert stats.bytes_moved[(down_to, Tier.HBM)] == 3 * engine.geometry.page_bytes
    assert engine.tiers.counters.checksum_failures == 0
    engine.check_integrity()
    engine.close()


def test_flipped_byte_on_nvme_is_rejected_and_recomputed(ckpt, hf, tmp_path):
    engine = tiered(ckpt, tmp_path, dram=0, record_logits=True)
    base = prompt(14, seed=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reference = plain(ckpt).generate([base[:12] + [9]], params)[0]
    engine.generate([base], params)
    engine.tiers.demote_all(Tier.NVME)
    second_key = page_keys(engine.digest_for(None), base, PS)[1]
    node = engine.index.get(second_key)
    assert node is not None and node.tier is Tier.NVME
    nvme = engine.tiers.nvme
    where = nvme.locate(node.page)
    path, offset = where.path, where.payload_offset + 100  # inside the payload
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))

    r = engine.generate([base[:12] + [9]], params)[0]
    assert engine.tiers.counters.checksum_failures == 1
    assert r.num_promoted_tokens == PS  # only the first page came back; the rest recomputed
    assert r.num_cached_tokens == PS
    assert r.token_ids == reference.token_ids
    assert_oracle(hf, r)
    assert engine.index.get(second_key) is None or engine.index.get(second_key).tier is Tier.HBM
    engine.check_integrity()
    engine.close()


def test_decode_keeps_stepping_while_a_large_demotion_is_in_flight(ckpt, tmp_path):
    engine = tiered(ckpt, tmp_path, num_pages=2048, dram=0, nvme=2048, page_size=16)
    fill = [prompt(496, seed=100 + i) for i in range(24)]  # ~744 cached pages
    engine.generate(fill, SamplingParams(max_tokens=1))
    rid = engine.add_request(prompt(20, seed=3), SamplingParams(max_tokens=300, ignore_eos=True))
    engine.step()
    leaving = engine.tiers.demote(Tier.HBM, Tier.NVME, 10_000, TransferReason.WATERMARK)
    assert leaving > 500 and engine.tiers.num_leaving(Tier.HBM) == leaving
    steps_during = 0
    while engine.tiers.transfers.num_pending and engine.has_unfinished():
        engine.step()
        steps_during += 1
    assert steps_during >= 1, "decode must not wait for the demotion"
    engine.tiers.wait_idle()
    counts = engine.index.count_by_tier()
    assert counts[Tier.NVME] == leaving
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_result(rid).token_ids) == 300
    engine.check_integrity()
    engine.close()


def test_watermark_demotion_runs_in_the_background(ckpt, tmp_path):
    config = TierConfig(dram_pages=128, hbm_watermark=Watermark(high=0.5, low=0.25))
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, tier_config=config)
    engine.generate([prompt(60, seed=s) for s in range(4)], SamplingParams(max_tokens=4))
    for _ in range(3):
        engine.step()  # maintain() runs at each step, even with nothing to schedule
        engine.tiers.wait_idle()
    assert engine.pool.num_free >= 0.75 * 64 - 1
    assert engine.index.count_by_tier()[Tier.DRAM] > 0
    assert engine.tiers.transfers.stats().bytes_moved[(Tier.HBM, Tier.DRAM)] > 0
    engine.check_integrity()
    engine.close()


def test_full_nvme_tier_evicts_by_policy_and_keeps_serving(ckpt, hf, tmp_path):
    engine = tiered(ckpt, tmp_path, dram=0, nvme=6, record_logits=True)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for s in range(4):
        engine.generate([prompt(13, seed=20 + s)], params)  # 4 full pages cached each
        engine.tiers.demote_all(Tier.NVME)
    counts = engine.index.count_by_tier()
    assert counts[Tier.NVME] <= 6 and counts[Tier.HBM] == 0
    assert engine.tiers.counters.pages_dropped > 0
    engine.check_integrity()
    last = prompt(13, seed=23)
    r = engine.generate([last], params)[0]
    assert_oracle(hf, r)
    engine.check_integrity()
    engine.close()


def test_preemption_with_tiers_resumes_deterministically(ckpt, tmp_path):
    prompts = [prompt(n, seed=40 + i) for i, n in enumerate([6, 11, 9, 14, 7, 10, 12, 8])]
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i) for i in range(8)]
    reference = plain(ckpt).generate(prompts, params)
    engine = tiered(
        ckpt, tmp_path, num_pages=24, dram=128, nvme=0, scheduler_config=SchedulerConfig(output_reservation_tokens=4)
    )
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    results = [engine.pop_result(r) for r in rids]
    assert sum(r.num_preemptions for r in results) > 0
    # Resumes promote their own pages back from DRAM (swap, not recompute); usage reports
    # promotions as of first admission only, so read the manager's counter.
    assert engine.tiers.counters.promoted_pages > 0, "preempted pages should come back from DRAM"
    assert all(r.num_promoted_tokens <= r.num_cached_tokens + PS for r in results)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    engine.close()


def test_restart_restores_nvme_pages_into_the_index(ckpt, tmp_path):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    base = prompt(17, seed=5)
    first = tiered(ckpt, tmp_path, dram=0)
    first.generate([base], params)
    first.tiers.demote_all(Tier.NVME)
    on_disk = first.index.count_by_tier()[Tier.NVME]
    assert on_disk == 5  # 17 + 6 tokens, 22 with K/V
    first.close()

    second = tiered(ckpt, tmp_path, dram=0)
    assert second.index.count_by_tier()[Tier.NVME] == on_disk
    r = second.generate([base[:16] + [1]], params)[0]
    assert r.num_cached_tokens == 16 and r.num_promoted_tokens == 16
    assert r.token_ids == plain(ckpt).generate([base[:16] + [1]], params)[0].token_ids
    second.check_integrity()
    second.close()


DISK_FULL = textwrap.dedent(
    """
    import json, resource, signal, sys
    import torch
    from pathlib import Path
    from kvtier.engine import Engine, SamplingParams
    from kvtier.tiers.manager import TierConfig
    from kvtier.domain.tiers import Tier
    ckpt, nvme_dir = sys.argv[1], Path(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    cfg = TierConfig(nvme_slots=32, nvme_dir=nvme_dir)
    engine = Engine.from_pretrained(ckpt, page_size=4, num_pages=16, tier_config=cfg)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))  # below the first slot
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[(7 * i + j) % 256 for j in range(13)] for i in range(5)]
    outs = [engine.generate([q], p)[0].token_ids for q in prompts]
    moved = engine.tiers.demote_all(Tier.NVME)
    engine.check_integrity()
    print(json.dumps({"outs": outs, "disk_full": engine.tiers.counters.disk_full_events,
                      "dropped": engine.tiers.counters.pages_dropped, "moved": moved,
                      "nvme": engine.index.count_by_tier()[Tier.NVME]}))
    """
)


def test_disk_full_falls_back_to_dropping_and_keeps_serving(ckpt, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(ckpt), str(tmp_path / "nvme")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path.cwd())},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["disk_full"] > 0 and result["nvme"] == 0 and result["moved"] == 0
    assert result["dropped"] > 0
    expected = plain(ckpt).generate(
        [[(7 * i + j) % 256 for j in range(13)] for i in range(5)], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert result["outs"] == [r.token_ids for r in expected]


def test_a_prefetch_never_spills_the_ancestors_of_the_pages_it_brings_up(ckpt, tmp_path):
    """HBM nearly full with a running request: making room for a prefetched chain's lower pages
    must not spill the chain's own HBM pages above them (idle leaves of HBM while their
    children are below), or a child would rise above its parent. The prefetch promotes what
    fits below its HBM ancestors and leaves the rest below."""
    engine = tiered(ckpt, tmp_path, num_pages=8, dram=16, nvme=0)
    cached = prompt(17, seed=11)  # 4 full pages cached
    engine.generate([cached], SamplingParams(max_tokens=1, ignore_eos=True))
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), cached, PS)]
    assert engine.tiers.demote_pages(chain[2:], Tier.DRAM).num_moved == 2
    engine.tiers.wait_idle()
    engine.tiers.poll()
    engine.add_request(prompt(20, seed=12), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # a running request now holds most of HBM
    outcome = engine.tiers.prefetch(chain)
    assert outcome.num_moved + outcome.num_skipped == 2 and outcome.num_moved >= 1
    tiers = [n.tier for n in chain]
    assert tiers[:2] == [Tier.HBM, Tier.HBM] and tiers == sorted(tiers)  # never faster than a parent
    engine.check_integrity()


def test_a_prefetch_recalls_a_page_on_its_way_down_and_brings_up_the_pages_below_it(ckpt, tmp_path):
    """A chain page still in HBM but in the middle of a background demotion (the watermark
    picked it a moment before) does not stop a prefetch of its chain: the prefetch's pin on it
    recalls it (the demotion, once it lands, leaves a pinned page where it is) and the pages
    below it come up. The copy the demotion made stays as the page's shadow, so its next
    demotion moves no bytes; the index stays consistent throughout."""
    engine = tiered(ckpt, tmp_path, num_pages=16, dram=16, nvme=0)
    cached = prompt(17, seed=13)
    engine.generate([cached], SamplingParams(max_tokens=1, ignore_eos=True))
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), cached, PS)]
    assert engine.tiers.demote_pages(chain[2:], Tier.DRAM).num_moved == 2
    engine.tiers.wait_idle()
    engine.tiers.poll()
    assert engine.tiers.demote(Tier.HBM, Tier.DRAM, 1, TransferReason.WATERMARK) == 1
    assert chain[1].moving and chain[1].tier is Tier.HBM  # the only idle HBM leaf is on its way down
    outcome = engine.tiers.prefetch(chain)
    assert (outcome.num_moved, outcome.num_skipped) == (2, 0)
    engine.tiers.wait_idle()
    engine.tiers.poll()
    assert [n.tier for n in chain] == [Tier.HBM] * 4 and not chain[1].moving
    assert engine.tiers.counters.demotions_abandoned == 1 and chain[1].key in shadow_keys(engine)
    engine.check_integrity()
    without_copy = engine.tiers.counters.demotions_without_copy
    assert engine.tiers.demote_all(Tier.DRAM) == 4
    # The recalled page and the two promoted ones go onto their copies; the root, which never
    # left HBM, alone is copied.
    assert engine.tiers.counters.demotions_without_copy - without_copy == 3
    engine.check_integrity()
    engine.close()


def test_a_page_pinned_while_its_demotion_is_in_flight_stays_where_it_was(ckpt, tmp_path):
    """A pin means "keep it in its tier": a page pinned after its demotion started (an
    operator's ``Admin.Pin``, a session hold) is not moved when the transfer lands, whether it
    was being copied or was going back onto its copy below; unpinned, it may leave again."""
    engine = tiered(ckpt, tmp_path, num_pages=16, dram=16, nvme=0)
    cached = prompt(9, seed=14)  # 2 full pages
    engine.generate([cached], SamplingParams(max_tokens=1, ignore_eos=True))
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), cached, PS)]
    assert engine.tiers.demote(Tier.HBM, Tier.DRAM, 2, TransferReason.WATERMARK) == 2  # copied down
    engine.index.pin(chain[1].key)
    engine.tiers.wait_idle()
    engine.tiers.poll()
    # The pinned leaf stays, and so does its parent (a child stayed faster); both keep the copy.
    assert [n.tier for n in chain] == [Tier.HBM, Tier.HBM] and not chain[1].moving
    assert {n.key for n in chain} <= shadow_keys(engine) and engine.tiers.counters.demotions_abandoned == 2
    engine.check_integrity()
    engine.index.unpin(chain[1].key)
    entry = engine.tiers.shadows.defer(chain[1], Tier.DRAM)  # going back onto its copy, in a batch
    assert entry is not None and chain[1].moving
    engine.index.pin(chain[1].key)
    assert not engine.tiers.shadows.apply(entry)
    assert chain[1].tier is Tier.HBM and chain[1].key in shadow_keys(engine)
    engine.index.unpin(chain[1].key)
    engine.check_integrity()
    without_copy = engine.tiers.counters.demotions_without_copy
    assert engine.tiers.demote_all(Tier.DRAM) == 2 and [n.tier for n in chain] == [Tier.DRAM] * 2
    assert engine.tiers.counters.demotions_without_copy - without_copy == 2
    engine.check_integrity()
    engine.close()


def test_a_page_pinned_while_its_write_to_nvme_is_in_flight_stays_and_its_slot_is_freed(ckpt, tmp_path):
    """With NVMe the only tier below: a page pinned while it is being written stays in HBM,
    the slot written for it is free again (no shadow kept on NVMe), and a restart restores
    nothing from it."""
    engine = tiered(ckpt, tmp_path, num_pages=16, dram=0, nvme=16)
    cached = prompt(9, seed=15)  # 2 full pages
    engine.generate([cached], SamplingParams(max_tokens=1, ignore_eos=True))
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), cached, PS)]
    free_slots = engine.tiers.nvme.num_free
    assert engine.tiers.demote(Tier.HBM, Tier.NVME, 2, TransferReason.WATERMARK) == 2
    engine.index.pin(chain[1].key)
    engine.tiers.wait_idle()
    engine.tiers.poll()
    assert [n.tier for n in chain] == [Tier.HBM, Tier.HBM] and not shadow_keys(engine)
    assert engine.tiers.counters.demotions_abandoned == 2 and engine.tiers.nvme.num_free == free_slots
    engine.check_integrity()
    engine.close()
    again = tiered(ckpt, tmp_path, num_pages=16, dram=0, nvme=16)
    assert again.index.count_by_tier()[Tier.NVME] == 0
    again.check_integrity()
    again.close()


def test_a_request_needing_pages_mid_prefetch_waits_for_that_transfer(ckpt, hf, tmp_path):
    """A Prefetch runs in the background; a request that needs its pages before it is applied
    waits for that transfer (no second copy, no recompute), and its output equals the oracle
    and a run whose pages never moved."""
    engine = tiered(ckpt, tmp_path, dram=0, record_logits=True)
    base = prompt(14, seed=21)  # 3 full pages + 2
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.generate([base], params)
    engine.tiers.demote_all(Tier.NVME)
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), base, PS)]
    assert [n.tier for n in chain] == [Tier.NVME] * 3

    ticket = engine.tiers.start_prefetch(chain)
    # Submitted, not applied: the index still says NVMe until the engine thread applies it.
    assert not ticket.is_done and all(n.moving and n.tier is Tier.NVME for n in chain)
    promoted = engine.tiers.promote(chain)  # what admission does for a matched lower-tier chain
    assert promoted == chain and ticket.is_done and ticket.outcome.num_moved == 3
    assert all(n.tier is Tier.HBM and engine.pool.ref_count(n.page) == 1 for n in chain)
    for node in promoted:
        engine.pool.release(node.page)
    engine.check_integrity()

    engine.tiers.demote_all(Tier.NVME)
    ticket = engine.tiers.start_prefetch(chain)
    follow = base[:12] + [5, 6, 7]
    r = engine.generate([follow], params)[0]
    assert ticket.is_done and ticket.outcome == MoveOutcome(num_moved=3, num_skipped=0)
    assert r.num_cached_tokens == 12
    assert r.token_ids == plain(ckpt).generate([follow], params)[0].token_ids
    assert_oracle(hf, r)
    page_bytes = engine.geometry.page_bytes
    assert engine.tiers.transfers.stats().bytes_moved[(Tier.NVME, Tier.HBM)] == 2 * 3 * page_bytes  # once each
    engine.check_integrity()
    engine.close()


def test_a_cancelled_prefetch_leaves_every_page_in_one_place(ckpt, tmp_path):
    """Cancelling a prefetch in flight (the session ended) applies it at once: pages whose copy
    completed are in HBM, the others stay below; no HBM page it allocated leaks."""
    engine = tiered(ckpt, tmp_path, dram=0, nvme=64)
    base = prompt(30, seed=22)  # 7 full pages
    engine.generate([base], SamplingParams(max_tokens=1, ignore_eos=True))
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), base, PS)]
    engine.tiers.demote_all(Tier.NVME)
    free_before = engine.pool.num_free
    ticket = engine.tiers.start_prefetch(chain)
    assert engine.tiers.cancel_prefetches(chain) == 1 and ticket.is_done
    moved = ticket.outcome.num_moved
    assert moved + ticket.outcome.num_skipped == len(chain)
    assert [n.tier for n in chain] == [Tier.HBM] * moved + [Tier.NVME] * (len(chain) - moved)
    assert not any(n.moving for n in chain)
    assert engine.pool.num_free == free_before - moved
    engine.check_integrity()
    engine.close()


# --------------------------------------------------------------------------- DRAM copies (shadows)


def _bytes_down(engine) -> int:
    return engine.tiers.counters.bytes_moved.get((Tier.HBM, Tier.DRAM), 0)


def test_a_page_promoted_from_dram_goes_back_onto_its_copy_without_moving_bytes(ckpt, hf, tmp_path):
    """KV pages never change once full, so a page promoted from DRAM keeps its DRAM copy; when
    it leaves HBM again (a spill, a watermark or commanded demotion) it is pointed back at that
    copy, no bytes cross the link. The next promotion reads it and the output is the oracle's."""
    engine = tiered(ckpt, tmp_path, nvme=0, record_logits=True)
    base = prompt(14, seed=21)  # 3 full pages + 2 tokens
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.generate([base], params)
    assert engine.tiers.demote_all(Tier.DRAM) >= 4
    copied = _bytes_down(engine)
    follow = base[:12] + [3, 1, 4]
    first = engine.generate([follow], params)[0]
    assert first.num_promoted_tokens == 12
    engine.check_integrity()  # three shadows: DRAM pages kept beside the HBM ones
    assert len(shadow_keys(engine)) == 3

    # Synchronously (demote_all: every idle page, the new ones copied, the promoted ones not).
    moved = engine.tiers.demote_all(Tier.DRAM)
    assert engine.tiers.counters.demotions_without_copy == 3
    assert _bytes_down(engine) - copied == (moved - 3) * engine.geometry.page_bytes  # only the new ones
    again = engine.generate([follow], params)[0]
    assert again.num_promoted_tokens == 12 and again.token_ids == first.token_ids
    assert again.token_ids == plain(ckpt).generate([follow], params)[0].token_ids
    assert_oracle(hf, again)
    engine.check_integrity()

    # In the background (a commanded demotion of the chain: its deepest page is copied, the
    # ones above it go back onto their copies once it has landed, deepest first).
    extended = follow + again.token_ids + [7, 7, 7, 7]  # a page that was never below
    engine.generate([extended], SamplingParams(max_tokens=1, ignore_eos=True))
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), extended, PS)]
    chain = [n for n in chain if n is not None]
    assert len(chain) >= 4 and all(n.tier is Tier.HBM for n in chain)
    shadowed = sum(n.key in shadow_keys(engine) for n in chain)
    assert 3 <= shadowed < len(chain)  # the newest page was computed here: it has no copy below
    before, shadows_used = _bytes_down(engine), engine.tiers.counters.demotions_without_copy
    outcome = engine.tiers.demote_pages(chain, Tier.DRAM)
    assert outcome.num_moved == len(chain) and outcome.num_skipped == 0
    assert engine.tiers.counters.demotions_without_copy - shadows_used == shadowed
    assert _bytes_down(engine) - before == (len(chain) - shadowed) * engine.geometry.page_bytes
    engine.check_integrity()
    last = engine.generate([extended], params)[0]
    assert last.num_promoted_tokens == len(chain) * PS
    assert last.token_ids == plain(ckpt).generate([extended], params)[0].token_ids
    engine.check_integrity()
    engine.close()


def test_a_shadow_goes_with_its_page_and_gives_way_to_dram_pages(ckpt, tmp_path):
    """A shadow is freed when its HBM page is dropped, and a DRAM allocation that finds no free
    page takes the oldest shadow before it moves or drops a page the index keeps in DRAM."""
    engine = tiered(ckpt, tmp_path, nvme=0, dram=8)
    base = prompt(14, seed=22)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([base], params)
    engine.tiers.demote_all(Tier.DRAM)
    engine.generate([base[:12] + [9]], params)  # three pages promoted: three shadows
    assert len(shadow_keys(engine)) == 3
    dram = engine.tiers.dram
    cached_before = sum(dram.is_cached(p) for p in range(dram.num_pages))
    first = engine.index.get(page_keys(engine.digest_for(None), base, PS)[0])
    dropped = engine.index.drop_subtree(first)
    assert dropped >= 3 and not shadow_keys(engine)
    assert sum(dram.is_cached(p) for p in range(dram.num_pages)) == cached_before - 3 - (dropped - 3)
    engine.check_integrity()

    other = prompt(14, seed=23)
    engine.generate([other], params)
    engine.tiers.demote_all(Tier.DRAM)
    engine.generate([other[:12] + [5]], params)
    assert len(shadow_keys(engine)) == 3
    in_dram = engine.index.count_by_tier()[Tier.DRAM]
    # Fill DRAM with pages the index keeps there: the shadows give way first, oldest first.
    for seed in (24, 25, 26):
        engine.generate([prompt(9, seed=seed)], params)
    engine.tiers.demote_all(Tier.DRAM)
    assert engine.index.count_by_tier()[Tier.DRAM] > in_dram
    assert len(shadow_keys(engine)) < 3
    assert engine.tiers.counters.pages_dropped == 0 or engine.index.count_by_tier()[Tier.DRAM] == dram.num_pages
    engine.check_integrity()
    engine.close()


def test_a_page_picked_up_before_its_demotion_lands_keeps_its_shadow(ckpt, tmp_path):
    """A page reserved to go back onto its DRAM copy but picked up by a sequence meanwhile stays
    in HBM, and its copy stays its shadow (still identical); the accounting holds throughout."""
    engine = tiered(ckpt, tmp_path, nvme=0)
    base = prompt(14, seed=27)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([base], params)
    engine.tiers.demote_all(Tier.DRAM)
    engine.generate([base[:12] + [8]], params)
    node = engine.index.get(page_keys(engine.digest_for(None), base, PS)[2])
    assert node.tier is Tier.HBM and node.key in shadow_keys(engine)
    entry = engine.tiers.shadows.defer(node, Tier.DRAM)
    assert entry is not None and node.moving and node.key not in shadow_keys(engine)
    engine.index.pool.acquire(node.page)  # a sequence takes the page before the demotion applies
    assert not engine.tiers.shadows.apply(entry)
    assert node.tier is Tier.HBM and not node.moving and node.key in shadow_keys(engine)
    engine.index.pool.release(node.page)
    engine.tiers.check_integrity()
    assert engine.tiers.demote_all(Tier.DRAM) > 0 and node.tier is Tier.DRAM  # onto the kept copy
    assert engine.tiers.counters.demotions_without_copy >= 1
    engine.tiers.check_integrity()
    engine.close()


def test_a_page_promoted_from_nvme_goes_back_onto_its_slot_without_a_write(ckpt, hf, tmp_path):
    """The same for NVMe: a slot a page was read from stays its copy (its header and payload are
    unchanged), so the page goes back without a write; the next read verifies it as ever."""
    engine = tiered(ckpt, tmp_path, dram=0, record_logits=True)
    base = prompt(14, seed=28)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.generate([base], params)
    engine.tiers.demote_all(Tier.NVME)
    written = engine.tiers.counters.bytes_moved[(Tier.HBM, Tier.NVME)]
    follow = base[:12] + [2, 7]
    first = engine.generate([follow], params)[0]
    assert first.num_promoted_tokens == 12 and engine.tiers.num_shadows(Tier.NVME) == 3
    engine.check_integrity()
    moved = engine.tiers.demote_all(Tier.NVME)
    assert engine.tiers.counters.demotions_without_copy == 3
    assert engine.tiers.counters.bytes_moved[(Tier.HBM, Tier.NVME)] - written == (moved - 3) * engine.geometry.page_bytes
    again = engine.generate([follow], params)[0]
    assert again.num_promoted_tokens == 12 and again.token_ids == first.token_ids
    assert engine.tiers.counters.checksum_failures == 0
    assert_oracle(hf, again)
    engine.check_integrity()
    engine.close()


def _clean_chain(engine, tokens: list[int], params) -> list:
    """Compute ``tokens``, send every idle page to DRAM, and bring its full pages back up: they
    are in HBM with an intact copy below (clean). Returns the full pages' nodes, root first."""
    engine.generate([tokens], params)
    engine.tiers.demote_all(Tier.DRAM)
    full = len(tokens) // PS * PS
    again = engine.generate([tokens[:full] + [1]], params)[0]
    assert again.num_promoted_tokens == full
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), tokens, PS)]
    assert all(n is not None and n.tier is Tier.HBM and n.key in shadow_keys(engine) for n in chain)
    return chain


def test_the_watermark_leaves_clean_pages_in_hbm_and_an_allocation_takes_them_without_a_copy(ckpt, hf, tmp_path):
    """An idle HBM page whose copy below is intact leaves at no cost whenever its room is
    needed, so it counts as free: the watermark copies down only pages without a copy and
    leaves the clean ones cached in HBM. An allocation that finds no free page then takes a
    clean page onto its copy (no bytes move) before it spills one that must be copied. The
    clean pages that stayed are still served from HBM, and outputs are the oracle's."""
    config = TierConfig(dram_pages=128, hbm_watermark=Watermark(high=0.5, low=0.25))
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, tier_config=config,
                                    device=DEVICE, record_logits=True)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    base = prompt(40, seed=31)
    chain = _clean_chain(engine, base, params)  # 10 clean pages
    assert engine.tiers.num_reclaimable() >= engine.pool.num_free + len(chain)
    for s in range(4):  # dirty pages (computed here, no copy below) push HBM over its high mark
        engine.generate([prompt(36, seed=40 + s)], params)
    for _ in range(3):
        engine.step()
        engine.tiers.wait_idle()
    assert engine.index.count_by_tier()[Tier.DRAM] > 0  # dirty pages went down (copied)
    assert all(n.tier is Tier.HBM for n in chain)  # the clean ones stayed
    assert engine.tiers.num_reclaimable() >= 0.75 * 64 - 1  # the low mark, counting them as free
    assert engine.pool.num_free < 0.75 * 64 - 1
    engine.check_integrity()

    # An allocation beyond the free pages takes clean pages, coldest first, at no copy.
    down, without_copy = _bytes_down(engine), engine.tiers.counters.demotions_without_copy
    big = prompt(4 * (engine.pool.num_free + 6), seed=50)
    out = engine.generate([big], params)[0]
    taken = engine.tiers.counters.demotions_without_copy - without_copy
    assert taken >= 6 and _bytes_down(engine) == down
    assert out.token_ids == plain(ckpt).generate([big], params)[0].token_ids
    assert_oracle(hf, out)
    engine.check_integrity()

    # The chain's deepest pages went first (leaves leave first); the rest are still hits in
    # HBM, and the ones that went come back from their copies.
    kept = [n for n in chain if n.tier is Tier.HBM]
    assert 0 < len(kept) < len(chain) and chain[: len(kept)] == kept
    follow = base + [2]
    again = engine.generate([follow], params)[0]
    assert again.num_cached_tokens == len(chain) * PS
    assert again.num_promoted_tokens == (len(chain) - len(kept)) * PS
    assert again.token_ids == plain(ckpt).generate([follow], params)[0].token_ids
    engine.check_integrity()
    engine.close()


def test_a_clean_page_above_a_held_or_uncopied_page_is_not_free_to_take(ckpt, tmp_path):
    """Leaves leave HBM first, so a clean page counts as free only when everything under it in
    HBM is clean and idle too: not above a page computed since (no copy below), nor above a
    pinned page (a session's hold pins only its deepest page)."""
    engine = tiered(ckpt, tmp_path, nvme=0)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    base = prompt(16, seed=33)
    chain = _clean_chain(engine, base, params)  # 4 clean pages
    free = engine.pool.num_free
    assert engine.tiers.num_reclaimable() == free + len(chain)

    engine.index.pin(chain[-1].key)  # a hold on the deepest keeps the chain above it
    assert engine.tiers.num_reclaimable() == free
    engine.index.unpin(chain[-1].key)
    assert engine.tiers.num_reclaimable() == free + len(chain)

    engine.generate([base + prompt(4, seed=34)], SamplingParams(max_tokens=1, ignore_eos=True))
    below = engine.index.get(page_keys(engine.digest_for(None), base + prompt(4, seed=34), PS)[len(chain)])
    assert below is not None and below.tier is Tier.HBM and below.key not in shadow_keys(engine)
    assert engine.tiers.num_reclaimable() == engine.pool.num_free  # a page with no copy under them
    engine.check_integrity()
    engine.close()


def test_a_clean_page_with_a_child_in_dram_never_goes_onto_its_nvme_copy(ckpt, tmp_path):
    """An HBM leaf may have a child in DRAM. Taking it as a clean page onto its NVMe copy would
    put it below that child (an IntegrityError that stopped a worker's engine): it is not
    taken, and the index stays consistent."""
    engine = tiered(ckpt, tmp_path)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    base = prompt(2 * PS, seed=61)
    engine.generate([base], params)
    engine.tiers.demote_all(Tier.NVME)
    engine.generate([base[:PS] + [3]], params)  # the first page back up, its NVMe slot kept
    digest = engine.digest_for(None)
    parent = engine.index.get(page_keys(digest, base, PS)[0])
    assert parent.tier is Tier.HBM and engine.tiers.num_shadows(Tier.NVME) >= 1
    branch = base[:PS] + prompt(PS, seed=62)
    engine.generate([branch + [1]], params)
    child = engine.index.get(page_keys(digest, branch, PS)[1])
    assert child.tier is Tier.HBM
    engine.tiers.demote_pages([child], Tier.DRAM)
    engine.tiers.wait_idle()
    assert child.tier is Tier.DRAM and parent.tier is Tier.HBM
    while engine.tiers.reclaim_clean():
        pass
    assert parent.tier in (Tier.HBM, Tier.DRAM)
    engine.check_integrity()
    engine.close()


def test_the_kept_count_of_clean_pages_equals_a_walk_from_the_leaves_through_random_traffic(ckpt, tmp_path):
    """The clean HBM pages are kept as pins, holds, moves and copies change (``CleanPages``),
    not counted by a walk each time. Through random traffic (shared prefixes, commanded
    demotions and prefetches, pins, spills onto copies, watermark demotions in flight), the kept
    set equals a walk from the leaves (the oracle) after every operation."""
    import random

    rng = random.Random(5)
    config = TierConfig(dram_pages=48, nvme_slots=48, nvme_dir=tmp_path / "nvme",
                        hbm_watermark=Watermark(high=0.7, low=0.5))
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=40, tier_config=config, device=DEVICE)
    clean = engine.tiers.clean
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    bases = [prompt(12, seed=60 + b) for b in range(3)]
    pinned: list = []
    seen_clean, reclaimed = 0, 0

    def check() -> None:
        nonlocal seen_clean
        clean.check()  # raises when the kept set differs from the walk
        assert engine.tiers.num_reclaimable() == engine.pool.num_free + len(clean.walk())
        seen_clean = max(seen_clean, clean.count())

    # At least 60 operations, more (at most 200) until the traffic has both made and taken clean
    # pages: whether a spill finds one depends on when the background moves land.
    for i in range(200):
        if i >= 60 and seen_clean >= 3 and reclaimed >= 1:
            break
        op = rng.randrange(6)
        nodes = [n for n in engine.index.nodes()]
        if op <= 1:  # a request on a shared prefix: hits, promotions, spills onto copies
            before = engine.tiers.counters.demotions_without_copy
            tail = prompt(rng.randrange(1, 10), seed=rng.randrange(1000))
            engine.generate([rng.choice(bases) + tail], params)
            reclaimed += engine.tiers.counters.demotions_without_copy - before
        elif op == 2:  # a commanded park of some idle pages
            movable = [n for n in nodes if n.tier is Tier.HBM]
            if movable:
                engine.tiers.start_demotion(rng.sample(movable, min(len(movable), 8)), rng.choice([Tier.DRAM, Tier.NVME]))
        elif op == 3:  # a prefetch of a chain that is partly below
            below = [n for n in nodes if n.tier is not Tier.HBM]
            leaf = rng.choice(below or nodes) if nodes else None
            chain = []
            while leaf is not None:
                chain.append(leaf)
                leaf = leaf.parent
            if chain:
                engine.tiers.start_prefetch(chain[::-1])
        elif op == 4:  # a hold's pin, or its release
            if pinned and rng.random() < 0.5:
                node = pinned.pop(rng.randrange(len(pinned)))
                if engine.index.get(node.key) is node:
                    engine.index.unpin(node.key)
            elif nodes:
                node = rng.choice(nodes)
                engine.index.pin(node.key)
                pinned.append(node)
        else:  # apply what landed; the watermark starts more
            engine.tiers.maintain()
        check()
        if rng.random() < 0.3:
            engine.tiers.wait_idle()
            engine.tiers.maintain()
            check()
    engine.tiers.wait_idle()
    engine.tiers.maintain()
    check()
    engine.check_integrity()
    assert seen_clean >= 3 and reclaimed >= 1  # the traffic did make and take clean pages
    engine.close()


def test_a_running_sequence_waits_for_pages_on_their_way_down_instead_of_being_preempted(ckpt, hf, tmp_path):
    """A sequence outgrows the free pages while every idle page is mid-demotion (moving, not a
    victim): the copies land soon, so it waits for them rather than preempting itself and
    recomputing (the race behind test_prefetch's held-page test failing under load)."""
    geometry_probe = Engine.from_pretrained(ckpt, page_size=PS, num_pages=16, device=DEVICE)
    page_bytes = geometry_probe.pool.geometry.page_bytes
    geometry_probe.close()
    # The demotion of the idle pages takes ~1.5 s on the emulated link: far longer than the turn.
    config = TierConfig(dram_pages=64, link_bytes_per_s={(Tier.HBM, Tier.DRAM): 5 * page_bytes / 1.5})
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=16, tier_config=config, device=DEVICE,
                                    record_logits=True)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([prompt(5 * PS, seed=70)], params)  # 5 idle cached pages
    assert engine.pool.num_free == 11
    moving = engine.tiers.demote(Tier.HBM, Tier.DRAM, 5, TransferReason.WATERMARK)
    assert moving == 5 and engine.tiers.num_leaving(Tier.HBM) == 5

    grow = prompt(10 * PS, seed=71)  # 10 of the 11 free pages; its output needs two more
    out = engine.generate([grow], SamplingParams(max_tokens=2 * PS, ignore_eos=True))[0]
    assert engine.scheduler.num_preemptions == 0
    assert engine.index.count_by_tier()[Tier.DRAM] == 5  # the copies landed and freed their pages
    assert out.token_ids == plain(ckpt).generate([grow], SamplingParams(max_tokens=2 * PS, ignore_eos=True))[0].token_ids
    assert_oracle(hf, out)
    engine.check_integrity()
    engine.close()


def test_every_tier_copy_goes_through_the_transfer_engine(ckpt, hf, tmp_path):
    """Spills, room-making below, drains and promotions are all transfer records: the transfer
    engine's count of pages moved per tier pair equals the tier manager's."""
    never = Watermark(high=1.0, low=1.0)  # no background demotion: every move here is synchronous
    config = TierConfig(dram_pages=6, nvme_slots=64, nvme_dir=tmp_path / "nvme", hbm_watermark=never,
                        dram_watermark=never)
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=16, tier_config=config, device=DEVICE,
                                    record_logits=True)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [prompt(14, seed=40 + i) for i in range(6)]
    for p in prompts:  # each caches 4 full pages: HBM spills into DRAM, DRAM makes room on NVMe
        engine.generate([p], params)
        engine.check_integrity()
    engine.tiers.demote_all(Tier.NVME)
    r = engine.generate([prompts[0][:12] + [1, 2]], params)[0]
    assert r.num_promoted_tokens == 12
    assert_oracle(hf, r)
    moved = engine.tiers.counters.pages_moved
    assert moved[(Tier.HBM, Tier.DRAM)] > 0 and moved[(Tier.DRAM, Tier.NVME)] > 0 and moved[(Tier.NVME, Tier.HBM)] == 3
    assert engine.tiers.transfers.stats().pages_moved == moved
    engine.check_integrity()
    engine.close()


def test_a_synchronous_move_waits_on_its_completion_without_polling(ckpt, hf, tmp_path, monkeypatch):
    """Spills and promotions on the engine thread block on the transfer's completion, which the
    emulated link's thread reports a while later, and never sleep in a loop meanwhile."""
    page_bytes = Engine.from_pretrained(ckpt, page_size=PS, num_pages=8).geometry.page_bytes
    rate = 20 * page_bytes  # 50 ms a page, acknowledged from the link thread
    config = TierConfig(dram_pages=32, link_bytes_per_s={(Tier.HBM, Tier.DRAM): rate, (Tier.DRAM, Tier.HBM): rate})
    engine = Engine.from_pretrained(ckpt, page_size=PS, num_pages=64, tier_config=config, device=DEVICE,
                                    record_logits=True)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    base = prompt(14, seed=50)
    engine.generate([base], params)
    real_sleep = time.sleep
    sleepers: list[str] = []

    def sleep(seconds: float) -> None:
        sleepers.append(threading.current_thread().name)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    engine_thread = threading.current_thread().name
    started = time.monotonic()
    moved = engine.tiers.demote_all(Tier.DRAM)
    assert moved == 4 and engine.index.count_by_tier()[Tier.DRAM] == 4
    assert time.monotonic() - started >= 4 * page_bytes / rate
    assert engine.tiers.counters.spill_link_wait_s > 0
    engine.check_integrity()
    r = engine.generate([base[:12] + [7, 8]], params)[0]  # promotion on hit, awaited on the engine thread
    assert r.num_promoted_tokens == 12 and engine.tiers.counters.promotion_wait_s >= 3 * page_bytes / rate
    assert_oracle(hf, r)
    engine.tiers.demote_all(Tier.DRAM)
    chain = [engine.index.get(k) for k in page_keys(engine.digest_for(None), base, PS)[:3]]
    assert engine.tiers.prefetch(chain).num_moved == 3  # a ticket waited for with ``wait_for``
    assert engine_thread not in sleepers
    engine.check_integrity()
    engine.close()
