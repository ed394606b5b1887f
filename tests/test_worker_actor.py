"""The worker's start-up: vLLM-named flags into WorkerConfig, the built-in model written
once, and the actor's phases run in this process (Ray itself is in tests/e2e)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier.domain.errors import ConfigError, FailedPrecondition
from kvtier.engine import SamplingParams
from kvtier.runtime.config import WorkerConfig
from kvtier.worker.actor import WorkerActor, ensure_tiny_model, worker_args


def test_vllm_flag_names_build_the_worker_config(tmp_path):
    args = worker_args(
        [
            "--model", str(tmp_path / "m"),
            "--block-size", "32",
            "--gpu-memory-utilization", "0.8",
            "--max-model-len", "4096",
            "--kv-cache-dtype", "bf16",
            "--controller", "ctrl:7000",
            "--hbm-bytes", "64Mi",
            "--port", "0",
            "--worker-id", "w3",
            "--heartbeat-interval-s", "0.5",
            "--log-json",
        ],
        env={},
    )  # fmt: skip
    config = args.config
    assert config.model == tmp_path / "m"
    assert (config.page_size, config.gpu_memory_utilization, config.max_model_len) == (32, 0.8, 4096)
    assert (config.kv_cache_dtype, config.controller_address, config.hbm_bytes) == (
        "bf16",
        "ctrl:7000",
        64 << 20,
    )
    assert config.log_json is True
    assert (args.worker_id, args.heartbeat_interval_s) == ("w3", 0.5)
    defaults = worker_args([], env={"KVTIER_PAGE_SIZE": "8"})
    assert defaults.config.page_size == 8 and defaults.worker_id is None


@pytest.mark.parametrize(
    ("argv", "field", "says"),
    [
        (["--block-size", "12"], "page_size", "(from --block-size)"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization", "(from --gpu-memory-utilization)"),
        (["--heartbeat-interval-s", "0"], "heartbeat_interval_s", "(0, 60]"),
        (["--session-hold-fraction", "0"], "session_hold_fraction", "(0, 1]"),
        (["--wait-scale", "101"], "wait_scale", "(0, 100]"),
    ],
)
def test_bad_flags_name_the_field_and_the_flag(argv, field, says):
    with pytest.raises(ConfigError) as caught:
        worker_args(argv, env={})
    assert caught.value.field == field and says in caught.value.message


def test_built_in_model_is_written_once(tmp_path):
    first = ensure_tiny_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == first == tmp_path / "models" / "tiny"
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tiny-")]


@pytest.fixture
def restore_logging():
    """The actor configures process logging (it owns its process); undo that for other tests."""
    root, kvtier_logger = logging.getLogger(), logging.getLogger("kvtier")
    saved = (list(root.handlers), root.level, kvtier_logger.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    kvtier_logger.setLevel(saved[2])


async def test_phases_in_order_then_serve(tmp_path: Path, restore_logging):
    config = WorkerConfig(device="cpu", hbm_bytes=4 << 20, page_size=16, state_dir=tmp_path, session_hold_fraction=0.5)
    actor = WorkerActor(config, worker_id="w-inproc", connect_controller=False)
    with pytest.raises(FailedPrecondition, match="init_device"):
        actor.load_model()
    assert actor.phase() == "constructed"
    assert actor.init_device() == "cpu"
    with pytest.raises(FailedPrecondition, match="allocate_pools"):
        actor.serve()
    assert actor.load_model()["model_id"] == "tiny"
    pools = actor.allocate_pools()
    assert pools["num_pages"] == (4 << 20) // pools["page_bytes"] and pools["source"] == "configured"
    with pytest.raises(FailedPrecondition, match="not serving"):
        actor.check_health()
    address = actor.serve()
    try:
        assert actor.phase() == "serve" and actor.address() == address
        assert actor._server.loop.holds.cap_pages == 0.5 * pools["num_pages"]  # the configured share
        actor.check_health()
        namespace = actor.namespace()
        with Client() as client:
            tokens, final = await asyncio.to_thread(
                client.complete, namespace, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), worker=address
            )
        assert len(tokens) == 4 and final.usage.prompt_tokens == 5
        assert actor.stats().worker_id == "w-inproc"
    finally:
        actor.shutdown()


@pytest.mark.parametrize(("name", "policy_cls"), [("lru", "LRUPolicy"), ("value", "ValuePolicy")])
def test_the_worker_radix_uses_the_configured_eviction_policy(tmp_path: Path, restore_logging, name, policy_cls):
    args = worker_args(["--eviction-policy", name, "--hbm-bytes", "2Mi", "--device", "cpu",
                        "--state-dir", str(tmp_path), "--dram-bytes", "1Mi"], env={})
    actor = WorkerActor(args.config, worker_id="w-policy", connect_controller=False)
    actor.init_device()
    actor.load_model()
    assert actor.allocate_pools()["eviction_policy"] == name
    assert type(actor._engine.index.policy).__name__ == policy_cls


def test_an_unknown_eviction_policy_is_refused_naming_the_field():
    from kvtier.cache.eviction import POLICY_NAMES
    from kvtier.runtime.config import settings_of

    with pytest.raises(ConfigError) as caught:
        worker_args(["--eviction-policy", "lfu"], env={})
    assert caught.value.field == "eviction_policy" and "(from --eviction-policy)" in caught.value.message
    with pytest.raises(ConfigError, match="eviction_policy"):
        worker_args([], env={"KVTIER_EVICTION_POLICY": "random"})
    # The config's choices are the policies the engine knows (config.py does not import them).
    accepted = next(s.accepted for s in settings_of(WorkerConfig) if s.name == "eviction_policy")
    assert sorted(accepted.removeprefix("one of ").split(", ")) == sorted(POLICY_NAMES)
