"""The wire contract from a second language: tests/contract_node/contract.mjs, a Node client
built from proto/ alone (@grpc/grpc-js + @grpc/proto-loader, no kvtier code), drives a live
controller and worker (real gRPC on loopback, real valkey-server, bearer-token auth) through
health, reflection, ListModels, Route, Generate with a prefix hit, sessions, Admin with and
without the admin role, and bad input with standard google.rpc.Status details. Its greedy
output must equal the Python client's for the same prompt."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
import pytest_asyncio

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc.auth import TokenTableFile, hash_token
from kvtier.runtime.config import ControllerConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

from polling import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODE_DIR = Path(__file__).resolve().parents[1] / "contract_node"
NODE = shutil.which("node")
if NODE is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
    pytest.skip("needs node and `npm ci --prefix tests/contract_node` (make test runs both)", allow_module_level=True)

TOKENS = {"admin": "kvt_node-admin", "frontend": "kvt_node-frontend", "worker": "kvt_node-worker"}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        f"  - {{name: admin, role: admin, sha256: {hash_token(TOKENS['admin'])}}}\n"
        f"  - {{name: node, role: frontend, tenants: [node], sha256: {hash_token(TOKENS['frontend'])}}}\n"
        f"  - {{name: worker, role: worker, worker_id: w-node, sha256: {hash_token(TOKENS['worker'])}}}\n"
    )
    return path


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(redis_url, table, tmp_path_factory):
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)
    controller = await serve_controller(
        ControllerConfig(port=0, state_dir=tmp_path_factory.mktemp("ctl"), auth_token_file=table,
                         lease_ttl_s=2.0, heartbeat_interval_s=0.5),
        redis_url=redis_url,
    )
    worker = await serve_worker(Engine.from_pretrained(checkpoint, page_size=4, num_pages=256),
                                worker_id="w-node", tokens=TokenTableFile(table), identity_token=TOKENS["worker"])
    link = WorkerLink(worker.loop, controller_address=controller.address, worker_id=worker.worker_id,
                      address=worker.address, boot_id=worker.boot_id, heartbeat_interval_s=0.2,
                      batch_interval_s=0.02, max_backoff_s=0.2, token=TOKENS["worker"], tickets=worker.tickets)
    link.start()
    try:
        await wait_for(lambda: controller.registry.get(worker.worker_id) is not None, what="worker registration")
        yield controller, worker
    finally:
        await link.stop()
        await worker.stop(0)
        await controller.stop(0)


async def test_a_node_client_from_proto_alone_drives_the_stack(stack):
    controller, _ = stack
    proc = await asyncio.create_subprocess_exec(
        NODE, str(NODE_DIR / "contract.mjs"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "KVTIER_CONTROLLER": controller.address,
             "KVTIER_FRONTEND_TOKEN": TOKENS["frontend"], "KVTIER_ADMIN_TOKEN": TOKENS["admin"]},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, err.decode()[-4000:]
    result = json.loads(out.decode().strip().splitlines()[-1])

    # The same request from the Python client: the same greedy tokens.
    namespace = NamespaceIdentity(**result["namespace"])
    async with AsyncClient(controller.address, token=TOKENS["frontend"]) as client:
        tokens, final = await client.complete(
            namespace, result["prompt"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert tokens == result["tokens"]
    assert final.usage.cached_tokens > 0  # the Node client's requests left the prefix cached
