"""The agent workload's calibration rule: measured speeds in, slow-down and emulated links out."""

from __future__ import annotations

import pytest

from kvtier.runtime.config import MAX_WAIT_SCALE
from loadtests.agent_calibration import DESIGN, MachineSpeed, calibrate, emulated_links

D = MachineSpeed(first_turn_ms=200.0, resume_ms=30.0, memcpy_bytes_per_s=28e9)


@pytest.mark.parametrize(
    ("first_turn_ms", "resume_ms", "memcpy_gbps", "slow_down", "dram_mbps", "nvme_mbps"),
    [
        (200.0, 30.0, 28.0, 1.0, 233.33, 65.33),  # the design engine: the workload as designed
        (1200.0, 30.0, 28.0, 6.0, 233.33, 65.33),  # first turns 6x slower
        (200.0, 120.0, 28.0, 4.0, 233.33, 65.33),  # resumes 4x slower: the slower part decides
        (1000.0, 240.0, 28.0, 8.0, 233.33, 65.33),  # both slower: the larger factor
        (50.0, 10.0, 28.0, 1.0, 233.33, 65.33),  # a faster engine only adds slack: never below 1
        (300.0, 45.0, 7.0, 1.5, 58.33, 16.33),  # slower memory: links keep a GPU's ratio to it
        (200.0, 30.0, 112.0, 1.0, 933.33, 261.33),
        (1e6, 30.0, 28.0, MAX_WAIT_SCALE, 233.33, 65.33),  # capped at what the worker's waits take
    ],
)
def test_calibration_table(first_turn_ms: float, resume_ms: float, memcpy_gbps: float, slow_down: float,
                           dram_mbps: float, nvme_mbps: float) -> None:
    derived = calibrate(MachineSpeed(first_turn_ms, resume_ms, memcpy_gbps * 1e9), D)
    assert derived.slow_down == pytest.approx(slow_down)
    assert derived.emulated_link_bytes_per_s["dram"] / 1e6 == pytest.approx(dram_mbps, abs=0.01)
    assert derived.emulated_link_bytes_per_s["nvme"] / 1e6 == pytest.approx(nvme_mbps, abs=0.01)


def test_links_keep_a_gpus_ratio_of_pcie_and_nvme_to_its_hbm() -> None:
    links = emulated_links(3e12)  # an H100's HBM: its own links
    assert links == pytest.approx({"dram": 25e9, "nvme": 7e9})


def test_the_design_reference_is_the_speed_the_workload_was_set_against() -> None:
    assert DESIGN == D
    assert calibrate(DESIGN).slow_down == 1.0


@pytest.mark.parametrize("bad", [MachineSpeed(0.0, 30.0, 28e9), MachineSpeed(200.0, -1.0, 28e9),
                                 MachineSpeed(200.0, 30.0, 0.0)])
def test_calibration_refuses_speeds_that_are_not_positive(bad: MachineSpeed) -> None:
    with pytest.raises(ValueError, match="positive"):
        calibrate(bad)
