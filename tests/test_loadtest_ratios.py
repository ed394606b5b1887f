"""`loadtests.ratios` reads each benchmark's JSON and checks its targets."""

import pytest

from loadtests.ratios import BENCHES, Ratio, last_json, main


def test_the_last_json_object_after_progress_lines() -> None:
    text = 'running ...\n{\n  "a": 1\n}\nrunning again {not json}\n{\n  "b": {"c": 2}\n}\n'
    assert last_json(text) == {"b": {"c": 2}}


def test_output_without_json_is_an_error() -> None:
    with pytest.raises(ValueError, match="no JSON object"):
        last_json("only progress\n")


def test_bounds_in_both_directions() -> None:
    assert Ratio("x", lambda r: None, 1.5, True).met(1.5) is True
    assert Ratio("x", lambda r: None, 1.5, True).met(1.51) is False
    assert Ratio("x", lambda r: None, 0.8, False).met(0.79) is False
    assert Ratio("x", lambda r: None, 0.8, False).met(None) is None


def test_every_ratio_reads_its_benchmark_keys() -> None:
    tiers = next(b for b in BENCHES if b.name == "tiers")
    result = {"geometries": {"tiny": {"nvme_read_vs_direct": 0.9, "dram_demote_vs_memcpy": 0.7},
                             "llama-3.1-8b": {"nvme_read_vs_direct": 0.96, "dram_demote_vs_memcpy": 0.85}}}
    assert [r.met(r.read(result)) for r in tiers.ratios if not r.optional] == [True, True, False, True]


def test_the_lmcache_ratios_are_read_only_where_the_peer_ran() -> None:
    tiers = next(b for b in BENCHES if b.name == "tiers")
    peer = [r for r in tiers.ratios if r.optional]
    assert len(peer) == 8  # four paths, two geometries
    assert {r.read({"lmcache": {"skipped": "LMCache peer skipped: ..."}}) for r in peer} == {None}
    ran = {"lmcache": {"geometries": {name: {path: {"median": 1.2} for path in
                                             ("mem_write", "mem_read", "disk_write", "disk_read")}
                                      for name in ("tiny", "llama-3.1-8b")}}}
    ran["lmcache"]["geometries"]["llama-3.1-8b"]["disk_read"]["median"] = 0.9
    missed = [r.name for r in peer if r.met(r.read(ran)) is False]
    assert missed == ["kvtier / LMCache, disk read, 2 MiB"]


def test_an_unknown_benchmark_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--only", "nope"])
    assert "--only: unknown benchmarks ['nope']" in capsys.readouterr().err
