"""`loadtests.lmcache_peer` from the benchmark's side: finding LMCache's Python, skipping
without it, and turning the peer's seconds into kvtier / LMCache ratios (LMCache itself
is not installed here; `make lmcache-venv` builds it for the benchmark)."""

from pathlib import Path

import pytest

from loadtests import bench_tiers, lmcache_peer


def test_without_lmcache_the_peer_is_skipped_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(lmcache_peer, "DEFAULT_VENV_PYTHON", tmp_path / "no-venv" / "bin" / "python")
    monkeypatch.setattr(lmcache_peer.importlib.util, "find_spec", lambda name: None)
    python, line = lmcache_peer.find_python(None)
    assert python is None
    assert line.startswith("LMCache peer skipped:") and "\n" not in line
    assert lmcache_peer.report_lines({"skipped": line}) == [line]


def test_the_venv_python_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    venv_python = tmp_path / "bin" / "python"
    venv_python.parent.mkdir()
    venv_python.touch()
    monkeypatch.setattr(lmcache_peer, "DEFAULT_VENV_PYTHON", venv_python)
    assert lmcache_peer.find_python(None)[0] == str(venv_python)


def test_a_missing_lmcache_python_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "python"
    with pytest.raises(SystemExit):
        bench_tiers.main(["--lmcache-python", str(missing)])
    assert f"--lmcache-python {missing}: no such file" in capsys.readouterr().err


def test_lmcache_python_and_no_lmcache_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_tiers.main(["--lmcache-python", "x", "--no-lmcache"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_ratios_are_kvtier_throughput_over_lmcache_per_path() -> None:
    kvtier = {"demote_Bps": 4e9, "promote_Bps": 2e9, "write_Bps": 1e9, "read_Bps": 1.8e9}
    peer_s = {"mem_write_s": 0.5, "mem_read_s": 0.5, "disk_write_s": 1.0, "disk_read_s": 0.5}
    rounds = [lmcache_peer.round_ratios(kvtier, peer_s, num_bytes=10**9)]
    rounds.append(lmcache_peer.round_ratios({**kvtier, "read_Bps": 2.2e9}, peer_s, num_bytes=10**9))
    summary = lmcache_peer.summarize({"tiny": rounds})
    paths = summary["geometries"]["tiny"]
    assert paths["mem_write"]["median"] == pytest.approx(2.0)
    assert paths["disk_write"]["median"] == pytest.approx(1.0)
    assert paths["disk_read"]["median"] == pytest.approx(1.0)
    assert paths["disk_read"]["range"] == [pytest.approx(0.9), pytest.approx(1.1)]
    assert summary["worst_median"] == pytest.approx(1.0)
    assert summary["rounds"] == 2
