"""The worker pool's plan (``kvtier/local/worker_pool.py``): which slots a set of Ray nodes gets,
each slot's ports, NVMe directory and device, and which worker id each slot holds when the ids
come from a tokens directory (``kvtier/local/worker_ids.py``). Pure; the placement on real Ray
nodes is ``tests/e2e/test_multinode.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.domain.errors import ConfigError
from kvtier.local.worker_ids import assign_worker_ids, list_worker_ids, unclaimed
from kvtier.local.worker_pool import RayNode, WorkerSlot, plan_slots, ray_nodes, slot_config
from kvtier.runtime.config import WorkerConfig


def node(node_id: str, address: str, cpus: float = 8, gpus: int = 0) -> RayNode:
    return RayNode(node_id, address, cpus, gpus)


def summary(slots):
    return [(s.node_id, s.index, s.uses_gpu) for s in slots]


def test_one_worker_per_gpu_and_one_per_cpu_node_ordered_by_address():
    nodes = [node("b" * 16, "10.0.0.2", gpus=2), node("a" * 16, "10.0.0.1"), node("c" * 16, "10.0.0.3", gpus=1)]
    assert summary(plan_slots(nodes)) == [
        ("a" * 16, 0, False), ("b" * 16, 0, True), ("b" * 16, 1, True), ("c" * 16, 0, True)]


def test_workers_per_node_sets_cpu_nodes_and_caps_gpu_nodes_and_cpus_bound_both():
    nodes = [node("a", "10.0.0.1", cpus=3), node("b", "10.0.0.2", gpus=4), node("h", "10.0.0.9", cpus=0)]
    assert summary(plan_slots(nodes, workers_per_node=2)) == [
        ("a", 0, False), ("a", 1, False), ("b", 0, True), ("b", 1, True)]
    assert summary(plan_slots(nodes, workers_per_node=5)) == [
        ("a", 0, False), ("a", 1, False), ("a", 2, False), ("b", 0, True), ("b", 1, True), ("b", 2, True),
        ("b", 3, True)]  # a head started with num-cpus 0 gets none
    with pytest.raises(ConfigError) as bad:
        plan_slots(nodes, workers_per_node=0)
    assert bad.value.field == "workers_per_node"


def test_a_slot_gets_its_own_ports_nvme_directory_and_device():
    slot = WorkerSlot("0123456789abcdef", "10.0.0.2", 3, uses_gpu=True)
    config = slot_config(WorkerConfig(port=50061, metrics_port=9100, nvme_dir=Path("/nvme")), slot)
    assert (config.port, config.metrics_port, config.nvme_dir, config.device) == (50064, 9103, Path("/nvme/gpu3"), "cuda")
    assert slot.worker_id == "worker-0123456789ab-3"
    free = slot_config(WorkerConfig(port=0, metrics_port=None, device="cpu"), slot)
    assert (free.port, free.metrics_port, free.nvme_dir, free.device) == (0, None, None, "cpu")
    assert WorkerSlot(None, "", 1, uses_gpu=False).worker_id == "worker-1"


def test_dead_nodes_are_not_planned():
    raw = [{"NodeID": "a", "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}},
           {"NodeID": "b", "NodeManagerAddress": "10.0.0.2", "Alive": False, "Resources": {"CPU": 2.0}}]
    assert ray_nodes(raw) == [RayNode("a", "10.0.0.1", 2.0, 1)]


def test_worker_pool_refuses_a_bad_config_file_before_joining_ray(tmp_path: Path):
    bad = tmp_path / "worker.toml"
    bad.write_text("bogus_key = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "worker-pool", "--ray-address", "127.0.0.1:1", "--config", str(bad)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""},
    )
    assert done.returncode == 2 and "unknown setting 'bogus_key'" in done.stderr and "Traceback" not in done.stderr


# -- worker ids from a tokens directory (kvtier/local/worker_ids.py) ----------------------------

A0, A1, B0, C0 = ("a", 0), ("a", 1), ("b", 0), ("c", 0)
IDS = ["worker-0", "worker-1", "worker-2"]


@pytest.mark.parametrize(("case", "slots", "claims", "available", "live", "expected"), [
    ("fresh pool: lowest ids in plan order", [A0, A1, B0], {}, IDS, [],
     ({A0: "worker-0", A1: "worker-1", B0: "worker-2"}, ["worker-0", "worker-1", "worker-2"], [], [])),
    ("adopted slots keep their ids, a new one takes the lowest free", [A0, A1, B0],
     {"worker-2": A0, "worker-0": B0}, IDS, ["worker-2", "worker-0"],
     ({A0: "worker-2", B0: "worker-0", A1: "worker-1"}, ["worker-1"], [], [])),
    ("a claimed slot whose actor died keeps its id", [A0], {"worker-1": A0}, IDS, [],
     ({A0: "worker-1"}, [], [], [])),
    ("none free: the slot gets none", [A0, A1, B0, C0], {}, IDS, [],
     ({A0: "worker-0", A1: "worker-1", B0: "worker-2"}, ["worker-0", "worker-1", "worker-2"], [], [C0])),
    ("a gone node's id is released once its actor is gone, and reused", [A0, C0],
     {"worker-0": A0, "worker-1": B0}, ["worker-0", "worker-1"], ["worker-0"],
     ({A0: "worker-0", C0: "worker-1"}, ["worker-1"], ["worker-1"], [])),
    ("a gone node's id stays taken while an actor has that name", [A0, C0],
     {"worker-0": A0, "worker-1": B0}, ["worker-0", "worker-1"], ["worker-0", "worker-1"],
     ({A0: "worker-0"}, [], [], [C0])),
    ("a live actor no claim names keeps its id from being given", [A0], {}, IDS, ["worker-0"],
     ({A0: "worker-1"}, ["worker-1"], [], [])),
    ("natural order: worker-2 before worker-10", [A0, A1], {}, ["worker-10", "worker-2", "worker-1x"], [],
     ({A0: "worker-1x", A1: "worker-2"}, ["worker-1x", "worker-2"], [], [])),
    ("two claims on one slot: the lower id stays, the other is released", [A0], {"worker-1": A0, "worker-0": A0},
     IDS, [], ({A0: "worker-0"}, [], ["worker-1"], [])),
    ("no ids at all", [A0], {}, [], [], ({}, [], [], [A0])),
])
def test_worker_id_assignment(case, slots, claims, available, live, expected):
    got = assign_worker_ids(slots, claims, available, live)
    worker_ids, new, released, without = expected
    assert (got.worker_ids, list(got.new_claims), list(got.released), list(got.without_id)) == (
        worker_ids, new, released, without), case
    assert len(set(got.worker_ids.values())) == len(got.worker_ids), case  # never one id twice


def test_only_unclaimed_slots_need_the_id_list():
    assert unclaimed([A0, A1, B0], {"worker-0": A1}) == [A0, B0]
    assert unclaimed([A0], {"worker-0": A0}) == []


def test_the_ids_of_a_tokens_directory_are_its_file_names_as_a_secret_volume_presents_them(tmp_path: Path):
    # A Kubernetes Secret volume: keys are links into a hidden timestamped directory.
    data = tmp_path / "..2026_12_06_09_00_00.1"
    data.mkdir()
    for key in ("worker-10", "worker-2", "worker-0"):
        (data / key).write_text("kvt_x\n")
    (tmp_path / "..data").symlink_to(data.name)
    for key in ("worker-10", "worker-2", "worker-0"):
        (tmp_path / key).symlink_to(f"..data/{key}")
    (tmp_path / "sub").mkdir()
    assert list_worker_ids(tmp_path) == ["worker-0", "worker-2", "worker-10"]

    (tmp_path / "not an id").write_text("x")
    with pytest.raises(ConfigError, match="not an id") as bad:
        list_worker_ids(tmp_path)
    assert bad.value.field == "worker_tokens_dir"
    with pytest.raises(ConfigError, match="cannot be read") as missing:
        list_worker_ids(tmp_path / "absent")
    assert missing.value.field == "worker_tokens_dir"

