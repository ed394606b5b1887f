"""Workers on a multi-node Ray cluster: three nodes on this machine (``ray.cluster_utils.Cluster``,
each its own raylet and object store, told apart by a custom resource), run by
``tests/e2e/multinode_driver.py`` in a process of its own (one ``ray.init`` per process; the
suite shares a local instance, ``tests/conftest.py``).

- ``kvtier up --ray-address`` (``start_local_stack``) puts one worker on each node, pinned by
  node, and the controller routes to all three;
- ``kvtier worker-pool`` (``WorkerPool``) does the same with detached named workers, and a
  restarted pool adopts them instead of starting new ones, and starts one on a node that joined.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("multinode_driver.py")
ROOT = DRIVER.parents[2]


@pytest.mark.slow
def test_workers_land_one_per_node_pinned_and_a_restarted_pool_adopts_them_and_covers_a_new_node(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    done = subprocess.run([sys.executable, str(DRIVER), str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))

    up = result["up"]
    assert sorted(up["nodes"]) == ["node_a", "node_b", "node_c"], up  # one worker per node
    assert up["routable"] == sorted(up["workers"]) and len(set(up["workers"])) == 3

    pool = result["pool"]
    assert sorted(pool["nodes"]) == ["node_a", "node_b", "node_c"], pool
    assert pool["routable"] == sorted(pool["workers"])
    assert sorted(pool["adopted"]) == sorted(pool["workers"]) and pool["same_actors"]
    assert pool["joined_nodes"] == ["node_d"]  # the node that joined got its worker
