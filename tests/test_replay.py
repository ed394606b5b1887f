"""Trace replay: exact hit counts on hand-made traces, and the Mooncake trace's numbers."""

from __future__ import annotations

import json

import pytest

from loadtests import replay as R

REAL_TRACE = R.DEFAULT_TRACE
needs_trace = pytest.mark.skipif(not REAL_TRACE.is_file(), reason=f"no trace at {REAL_TRACE}")


def write_trace(path, requests: list[list[int]]):
    with open(path, "w") as f:
        for i, ids in enumerate(requests):
            f.write(json.dumps({"timestamp": 10 * i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}))
            f.write("\n")
    return path


@pytest.fixture(scope="module")
def real_trace():
    if not REAL_TRACE.is_file():
        pytest.skip(f"no trace at {REAL_TRACE}")
    return R.load_trace(REAL_TRACE)


# HBM 3, DRAM 2, NVMe 1 pages, LRU. Chains: 1-2, 3-4 (and 5 under 4, 6 under 2).
#   r1 [1,2]    miss 2                                   HBM 1 2
#   r2 [3,4]    miss 2; 4 needs a page: 2 -> DRAM         HBM 1 3 4    DRAM 2
#   r3 [1,2]    hbm 1, dram 1; 2 comes up, 4 -> DRAM      HBM 1 2 3    DRAM 4
#   r4 [3,4,5]  hbm 1, dram 1; 4 up, 2 -> DRAM; 5: 1 -> DRAM
#                                                        HBM 3 4 5    DRAM 2 1
#   r5 [1,2,6]  dram 2; DRAM holds only the pages coming up, so 5 -> NVMe, then 4 -> NVMe
#               drops 5; 6: 3 -> DRAM                     HBM 1 2 6    DRAM 3   NVMe 4
#   r6 [3,4]    dram 1, nvme 1; 6 -> DRAM; 2 -> DRAM makes room by dropping 6 (NVMe holds
#               only 4, coming up)                        HBM 1 3 4    DRAM 2
HAND = [[1, 2], [3, 4], [1, 2], [3, 4, 5], [1, 2, 6], [3, 4]]


def test_tiered_hit_counts_equal_the_hand_computation(tmp_path):
    trace = R.load_trace(write_trace(tmp_path / "t.jsonl", HAND))
    sim = R.Replay("lru", hbm_blocks=3, dram_blocks=2, nvme_blocks=1, trace=trace)
    result = sim.run(trace, check_every=1)
    assert result.num_refs == 14
    assert result.hits_by_tier == {R.Tier.HBM: 2, R.Tier.DRAM: 5, R.Tier.NVME: 1}
    assert result.pages_dropped == 2
    assert sim.index.count_by_tier() == {R.Tier.HBM: 3, R.Tier.DRAM: 1, R.Tier.NVME: 0}
    assert [sim.index.get(k).tier for k in trace[0].keys] == [R.Tier.HBM, R.Tier.DRAM]
    assert R.infinite_hit_rate(trace) == 8 / 14 == result.hit_rate
    sim.close()


def test_value_keeps_the_block_hit_twice_where_lru_keeps_the_newer(tmp_path):
    # HBM 2: [1] hit twice, then [2] and [3] arrive; [3] needs a page, then [1] returns.
    trace = R.load_trace(write_trace(tmp_path / "t.jsonl", [[1], [1], [1], [2], [3], [1]]))
    lru = R.replay(trace, "lru", hbm_blocks=2, check_every=1)
    value = R.replay(trace, "value", hbm_blocks=2, check_every=1)
    assert lru.hits_by_tier[R.Tier.HBM] == 2  # LRU evicted [1] (older) for [3]
    assert value.hits_by_tier[R.Tier.HBM] == 3  # (2 + 1) x cost outweighs [2]'s 1 x cost
    assert R.infinite_hit_rate(trace) == 3 / 6


def test_a_request_longer_than_hbm_caches_what_fits(tmp_path):
    trace = R.load_trace(write_trace(tmp_path / "t.jsonl", [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]))
    result = R.replay(trace, "value", hbm_blocks=3, check_every=1)
    assert result.hits_by_tier[R.Tier.HBM] == 3


def test_malformed_records_name_their_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        R.load_trace(path)


def test_cli_json_and_sweep(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", HAND)
    assert R.main(["--trace", str(path), "--policy", "lru", "--hbm-blocks", "3", "--dram-blocks", "2",
                   "--nvme-blocks", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hit_rate"] == pytest.approx(8 / 14)
    assert out["hit_rate_by_tier"] == pytest.approx({"hbm": 2 / 14, "dram": 5 / 14, "nvme": 1 / 14})
    assert out["lru_hit_rate"] == out["infinite_hit_rate"] == pytest.approx(8 / 14)  # 6 pages hold it all
    png = tmp_path / "sweep.png"
    assert R.main(["--trace", str(path), "--sweep", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "infinite cache: 57.1 %" in text and "50000" in text
    assert png.stat().st_size > 0
    assert R.main(["--trace", str(tmp_path / "missing.jsonl")]) == 2


# ---- the Mooncake trace ----------------------------------------------------------------
@needs_trace
def test_infinite_cache_share_matches_the_trace_readme(real_trace):
    assert len(real_trace) == 3993
    assert 100 * R.infinite_hit_rate(real_trace) == pytest.approx(64.0, abs=0.1)
    # A cache larger than the trace's 43,924 distinct blocks never evicts: it is infinite.
    big = R.replay(real_trace, "lru", hbm_blocks=50_000)
    assert big.hit_rate == R.infinite_hit_rate(real_trace) and big.pages_dropped == 0


@needs_trace
@pytest.mark.parametrize("total", [2_000, 10_000])
def test_kvtier_serves_at_least_as_much_as_lru_at_the_same_capacity(real_trace, total):
    hbm, dram, nvme = R.split(total)
    kvtier = R.replay(real_trace, "value", hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme)
    lru = R.replay(real_trace, "lru", hbm_blocks=total)
    assert kvtier.hit_rate >= lru.hit_rate
    assert kvtier.compute_saved >= lru.compute_saved
    assert sum(kvtier.hits_by_tier.values()) == round(kvtier.hit_rate * kvtier.num_refs)


@needs_trace
@pytest.mark.parametrize("policy", ["value", "lru"])
def test_replay_keeps_every_pool_consistent(real_trace, policy):
    R.replay(real_trace[:300], policy, hbm_blocks=60, dram_blocks=40, nvme_blocks=100, check_every=1)
