"""Peer fetch on a three-node Ray cluster: tests/e2e/multinode/peer_cluster_cases.py, run in a
pytest process of its own. Ray allows one ``ray.init`` per process and this suite shares one
local instance (tests/conftest.py), so the cluster's driver cannot be this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).parent / "multinode" / "peer_cluster_cases.py"
TIMEOUT_S = 600


@pytest.mark.slow
def test_peer_fetch_on_a_three_node_ray_cluster(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
         str(CASES)],
        cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
