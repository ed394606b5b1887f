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
    assert [r.met(r.read(result)) for r in tiers.ratios] == [True, True, False, True]


def test_an_unknown_benchmark_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--only", "nope"])
    assert "--only: unknown benchmarks ['nope']" in capsys.readouterr().err
