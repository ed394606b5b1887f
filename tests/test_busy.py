"""``--busy``: the burner runs while a benchmark runs, stops with it, and stops by itself."""

from __future__ import annotations

import argparse
import time

from loadtests.busy import add_busy_flag, busy_core


def test_burner_runs_inside_and_is_gone_after():
    with busy_core(True) as proc:
        assert proc is not None and proc.is_alive()
        time.sleep(0.2)
        assert proc.is_alive()
    assert not proc.is_alive()


def test_burner_stops_by_itself_after_its_bound():
    with busy_core(True, max_s=0.3) as proc:
        proc.join(timeout=30)
        assert not proc.is_alive() and proc.exitcode == 0


def test_off_means_no_process_and_the_flag_parses():
    with busy_core(False) as proc:
        assert proc is None
    parser = argparse.ArgumentParser()
    add_busy_flag(parser)
    assert parser.parse_args(["--busy"]).busy and not parser.parse_args([]).busy
