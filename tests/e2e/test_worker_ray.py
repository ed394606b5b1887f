"""A worker as a real Ray actor on a local Ray instance: phases, generation over its gRPC
address, health, and a kill mid-stream (the client sees UNAVAILABLE; the restarted actor
runs its phases again by itself and serves new requests)."""

from __future__ import annotations

import pytest
import ray

from kvtier.client import Client
from kvtier.domain import errors
from kvtier.domain.records import TokenChunk
from kvtier.engine import SamplingParams
from kvtier.runtime.config import WorkerConfig
from kvtier.worker.actor import call_actor, run_phases, start_worker_actor

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]




def test_worker_actor_serves_dies_mid_stream_and_comes_back(local_ray, tmp_path_factory):
    config = WorkerConfig(
        device="cpu", hbm_bytes=8 << 20, page_size=16, state_dir=tmp_path_factory.mktemp("state")
    )
    actor, address = start_worker_actor(config, worker_id="w-ray", max_restarts=1, connect_controller=False)
    ray.get(actor.check_health.remote())
    namespace = ray.get(actor.namespace.remote())
    assert namespace.model_id == "tiny"

    with Client(timeout_s=60) as client:
        tokens, final = client.complete(namespace, PROMPT, SamplingParams(max_tokens=8), worker=address)
        assert len(tokens) == 8 and final.usage.prompt_tokens == len(PROMPT)

        # Kill the actor while it streams a long generation.
        events = client.generate(
            namespace, PROMPT, SamplingParams(max_tokens=2000, ignore_eos=True), worker=address
        )
        assert isinstance(next(events), TokenChunk)
        ray.kill(actor, no_restart=False)
        with pytest.raises(errors.Unavailable):
            for _ in events:
                pass
        with pytest.raises(errors.Unavailable):
            client.complete(namespace, PROMPT, worker=address)

        # Ray restarted the process; its constructor ran every phase again, so it serves at
        # once, and run_phases (idempotent) only reports the new address.
        assert call_actor(actor, "phase", timeout_s=120) == "serve"
        ray.get(actor.check_health.remote(), timeout=60)
        new_address = run_phases(actor)
        assert ray.get(actor.address.remote()) == new_address != address
        tokens_again, _ = client.complete(namespace, PROMPT, SamplingParams(max_tokens=8), worker=new_address)
        assert tokens_again == tokens, "same checkpoint, same greedy tokens"
    ray.kill(actor, no_restart=True)
