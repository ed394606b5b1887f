"""TLS and mTLS with test-generated certificates (trustme) over real gRPC on loopback
(kvtier.rpc.tls, DESIGN §8): TLS clients work, plaintext clients are refused, and on a
controller that requires client certificates a worker registers over WorkerLink only with one.
The in-process WorkerActor covers the worker's own wiring: TLS server, health probe, mTLS link."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import AsyncClient
from kvtier.controller.server import serve_controller
from kvtier.domain import errors
from kvtier.domain.errors import ConfigError
from kvtier.engine import Engine
from kvtier.engine.model.loader import TINY_LLAMA_CONFIG, write_random_checkpoint
from kvtier.rpc.auth import hash_token
from kvtier.rpc.tls import ClientTls, server_credentials
from kvtier.runtime.config import ClientConfig, ControllerConfig, WorkerConfig
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN, WORKER, ACTOR = "kvt_tls-admin", "kvt_tls-worker", "kvt_tls-actor"


@dataclasses.dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of these


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("worker-0.kvtier.test")
    paths = Pki(*(root / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other.pem")))
    ca.cert_pem.write_to_path(paths.ca)
    other.cert_pem.write_to_path(paths.other_ca)
    for cert, cert_path, key_path in ((server, paths.server_cert, paths.server_key),
                                      (client, paths.client_cert, paths.client_key)):
        for i, blob in enumerate(cert.cert_chain_pems):
            blob.write_to_path(cert_path, append=i > 0)
        cert.private_key_pem.write_to_path(key_path)
    return paths


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens.yaml"
    path.write_text(f"tokens:\n  - {{name: ops, role: admin, sha256: {hash_token(ADMIN)}}}\n"
                    f"  - {{name: w, role: worker, worker_id: w-tls, sha256: {hash_token(WORKER)}}}\n"
                    f"  - {{name: a, role: worker, worker_id: w-actor, sha256: {hash_token(ACTOR)}}}\n")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", TINY_LLAMA_CONFIG, seed=0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def tls_worker(checkpoint, pki):
    server = await serve_worker(Engine.from_pretrained(checkpoint, page_size=4, num_pages=32), worker_id="w-tls",
                                credentials=server_credentials(pki.server_cert, pki.server_key),
                                identity_token=WORKER)
    yield server
    await server.stop(0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mtls_controller(redis_url, pki, table, tmp_path_factory):
    """TLS, client certificates required (mTLS), bearer tokens, and a plaintext health port."""
    config = ControllerConfig(
        port=0, state_dir=tmp_path_factory.mktemp("ctl"), auth_token_file=table, lease_ttl_s=2.0,
        heartbeat_interval_s=0.5, tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
        tls_client_ca_file=pki.ca, health_port=0, tls_ca_file=pki.ca,  # dials TLS workers for address proofs
    )
    controller = await serve_controller(config, redis_url=redis_url)
    yield controller
    await controller.stop(0)


async def test_tls_client_works_and_plaintext_or_untrusting_clients_are_refused(tls_worker, pki):
    async with AsyncClient(tls=ClientTls(ca_file=pki.ca), timeout_s=5) as client:
        assert (await client.worker_stats(tls_worker.address)).worker_id == "w-tls"
    async with AsyncClient(timeout_s=5, max_retries=0) as plaintext:
        with pytest.raises(errors.Unavailable):
            await plaintext.worker_stats(tls_worker.address)
    async with AsyncClient(tls=ClientTls(ca_file=pki.other_ca), timeout_s=5, max_retries=0) as untrusting:
        with pytest.raises(errors.Unavailable):
            await untrusting.worker_stats(tls_worker.address)
    # The server still serves TLS clients after refusing those.
    config = ClientConfig(controller_address="unused:1", tls_ca_file=pki.ca)
    async with AsyncClient.from_config(config) as client:
        assert (await client.check_integrity(tls_worker.address)).is_ok


async def test_mtls_controller_requires_a_client_certificate_of_every_caller(mtls_controller, pki):
    with_cert = ClientTls(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    async with AsyncClient(mtls_controller.address, token=ADMIN, tls=with_cert, timeout_s=5) as client:
        assert (await client.status()).controller_id == mtls_controller.controller_id
    async with AsyncClient(mtls_controller.address, token=ADMIN, tls=ClientTls(ca_file=pki.ca), timeout_s=5,
                           max_retries=0) as no_cert:
        with pytest.raises(errors.Unavailable):
            await no_cert.status()
    async with AsyncClient(mtls_controller.address, token=ADMIN, timeout_s=5, max_retries=0) as plaintext:
        with pytest.raises(errors.Unavailable):
            await plaintext.status()
    # Probes that cannot speak TLS use the plaintext health-only port.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mtls_controller.health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:  # and nothing else
            await channel.unary_unary("/kvtier.v1.Admin/Status")(b"", timeout=5)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_worker_link_registers_over_mtls_only_with_a_client_certificate(mtls_controller, tls_worker, pki):
    async def link(tls: ClientTls, worker_id: str) -> WorkerLink:
        link = WorkerLink(tls_worker.loop, controller_address=mtls_controller.address, worker_id=worker_id,
                          address=tls_worker.address, boot_id=f"boot-{worker_id}", heartbeat_interval_s=0.2,
                          max_backoff_s=0.2, token=WORKER, tls=tls)
        link.start()
        return link

    without = await link(ClientTls(ca_file=pki.ca), "w-no-cert")
    with_cert = await link(ClientTls(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key), "w-tls")
    try:
        await asyncio.wait_for(with_cert.connected.wait(), 15)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while mtls_controller.registry.get("w-tls") is None:  # the controller reads the registration
            assert loop.time() < deadline, "the worker with a certificate never registered"
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0)  # several retries of the refused one
        assert not without.is_connected and without.num_connections == 0
        assert mtls_controller.registry.get("w-no-cert") is None
    finally:
        await without.stop()
        await with_cert.stop()


async def test_worker_actor_serves_tls_probes_itself_and_links_over_mtls(mtls_controller, pki, table, checkpoint,
                                                                          tmp_path):
    from kvtier.worker.actor import WorkerActor

    token_file = tmp_path / "worker.token"
    token_file.write_text(ACTOR + "\n")
    config = WorkerConfig(
        controller_address=mtls_controller.address, model=checkpoint, device="cpu", page_size=4,
        hbm_bytes=4 << 20, dram_bytes=0, state_dir=tmp_path, auth_token_file=token_file, auth_tokens_file=table,
        tls_cert_file=pki.server_cert, tls_key_file=pki.server_key,
        tls_client_ca_file=pki.ca, tls_ca_file=pki.ca,
    )
    actor = WorkerActor(config, worker_id="w-actor", heartbeat_interval_s=0.2)
    try:
        for phase in ("init_device", "load_model", "allocate_pools", "serve"):
            await asyncio.to_thread(getattr(actor, phase))
        await asyncio.to_thread(actor.check_health)  # dials its own mTLS server
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while mtls_controller.registry.get("w-actor") is None:
            assert loop.time() < deadline, "the actor's link never registered over mTLS"
            await asyncio.sleep(0.05)
        # Its server needs a client certificate and an admin token for Stats.
        tls = ClientTls(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
        async with AsyncClient(token=ADMIN, tls=tls, timeout_s=5) as client:
            assert (await client.worker_stats(actor.address())).worker_id == "w-actor"
        async with AsyncClient(tls=tls, timeout_s=5) as anonymous:
            with pytest.raises(errors.Unauthenticated):
                await anonymous.worker_stats(actor.address())
    finally:
        await asyncio.to_thread(actor.shutdown, 0.0)


async def test_bad_tls_files_are_refused_at_start_naming_the_setting(tmp_path, pki):
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    with pytest.raises(ConfigError) as info:
        server_credentials(not_pem, pki.server_key)
    assert info.value.field == "tls_cert_file" and "not a PEM file" in info.value.message
    with pytest.raises(ConfigError) as info:
        server_credentials(pki.server_cert, tmp_path / "missing.key")
    assert info.value.field == "tls_key_file" and "cannot read" in info.value.message
    with pytest.raises(ConfigError) as info:
        server_credentials(None, None, pki.ca)
    assert info.value.field == "tls_client_ca_file"
    with pytest.raises(ConfigError) as info:
        ClientTls.from_files(tmp_path / "absent-ca.pem")
    assert info.value.field == "tls_ca_file"
    with pytest.raises(ConfigError) as info:
        ClientTls.from_files(None, server_name="kvtier.test")
    assert info.value.field == "tls_server_name"
    assert ClientTls.from_files(None) is None
