"""Fixtures of the fault-injection suite: the checkpoint every worker serves and its oracle."""

from __future__ import annotations

import pytest
from fault_harness import Oracle

from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint


@pytest.fixture(scope="session")
def fault_checkpoint(tmp_path_factory):
    # The directory name is the model id every request names.
    # init_std 0.2: a random model with the default 0.02 repeats one token, and proves little.
    return write_random_checkpoint(
        tmp_path_factory.mktemp("faults") / "tiny", TINY_LLAMA_CONFIG, seed=0, init_std=0.2
    )


@pytest.fixture(scope="session")
def oracle(fault_checkpoint) -> Oracle:
    return Oracle(fault_checkpoint)
