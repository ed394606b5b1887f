"""The agent workload's calibration rule: measured speeds in, slow-down and emulated links out."""

from __future__ import annotations

import pytest

from kvtier.runtime.config import MAX_WAIT_SCALE
from loadtests.agent_calibration import DESIGN, MachineSpeed, calibrate, emulated_links

D = MachineSpeed(first_turn_ms=200.0, resume_ms=30.0)


@pytest.mark.parametrize(
    ("first_turn_ms", "resume_ms", "slow_down", "dram_mbps_played", "nvme_mbps_played"),
    [
        (200.0, 30.0, 1.0, 233.33, 65.33),  # the design engine: the workload as designed
        (1200.0, 30.0, 6.0, 38.89, 10.89),  # first turns 6x slower: links played 6x slower too
        (200.0, 120.0, 4.0, 58.33, 16.33),  # resumes 4x slower: the slower part decides
        (1000.0, 240.0, 8.0, 29.17, 8.17),  # both slower: the larger factor
        (50.0, 10.0, 1.0, 233.33, 65.33),  # a faster engine only adds slack: never below 1
        (300.0, 45.0, 1.5, 155.56, 43.56),
        (1e6, 30.0, MAX_WAIT_SCALE, 2.33, 0.65),  # capped at what the worker's waits take
    ],
)
def test_calibration_table(first_turn_ms: float, resume_ms: float, slow_down: float,
                           dram_mbps_played: float, nvme_mbps_played: float) -> None:
    """Measured speeds -> the slow-down, and the links as the run plays them (divided by it): a
    transfer keeps the design's ratio to a resume (~240 ms of NVMe per 15 MiB against a 30 ms resume, times the slow-down)."""
    derived = calibrate(MachineSpeed(first_turn_ms, resume_ms), D)
    assert derived.slow_down == pytest.approx(slow_down)
    played = {t: r / derived.slow_down / 1e6 for t, r in derived.emulated_link_bytes_per_s.items()}
    assert played == pytest.approx({"dram": dram_mbps_played, "nvme": nvme_mbps_played}, abs=0.01)


def test_links_keep_a_gpus_ratio_of_pcie_and_nvme_to_its_hbm() -> None:
    links = emulated_links(3e12)  # an H100's HBM: its own links
    assert links == pytest.approx({"dram": 25e9, "nvme": 7e9})


def test_the_design_reference_is_the_speed_the_workload_was_set_against() -> None:
    assert DESIGN == D
    assert calibrate(DESIGN).slow_down == 1.0


@pytest.mark.parametrize("bad", [MachineSpeed(0.0, 30.0), MachineSpeed(200.0, -1.0)])
def test_calibration_refuses_speeds_that_are_not_positive(bad: MachineSpeed) -> None:
    with pytest.raises(ValueError, match="positive"):
        calibrate(bad)
