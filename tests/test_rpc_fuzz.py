"""Every RPC of every kvtier service, fuzzed over real gRPC on loopback (issue 9, item 4).

One real controller (real Valkey) and one in-process worker (a tiny random-weight model)
joined by a real WorkerLink serve on a background event-loop thread; the tests call them
with *raw bytes* (``channel.unary_unary(path)`` without serializers), so nothing on the
client side can tidy a request up. Inputs: arbitrary bytes; messages built field by field
from the descriptors with edge values (missing identity fields, negative and overflowing
numbers, NaN, unknown enum numbers, long strings and lists); raw-wire mutations (invalid
UTF-8 in a string field, a varint overflowing its field, a wrong wire type, a truncated
message); and targeted cases (10^6 token ids, stop sequences over their limits, a message
over the server's maximum size).

Every answer must be OK or a documented status code — INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, FAILED_PRECONDITION, UNIMPLEMENTED (an RPC not built yet) — never
INTERNAL or UNKNOWN, and never later than the call's deadline. After every example both
servers still answer their health checks and a known-good Route and Generate (greedy
tokens equal to transformers'), and at the end the worker's pools and indexes pass
``check_integrity`` with no page held.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import redis
import torch
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.controller.server import serve_controller
from kvtier.domain.hashing import NamespaceIdentity
from kvtier.domain.records import GenerateRequest, RouteRequest, TokenPrefix
from kvtier.engine import Engine, SamplingParams
from kvtier.rpc._gen import (
    admin_pb2,
    common_pb2,
    router_pb2,
    sessions_pb2,
    worker_link_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from kvtier.rpc.convert.common import to_proto_namespace_identity
from kvtier.rpc.convert.limits import (
    MAX_DURATION_MS,
    MAX_MESSAGE_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_STOP_TOKEN_IDS,
)
from kvtier.rpc.convert.router import to_proto_route_request
from kvtier.rpc.convert.worker import (
    from_proto_integrity_result,
    from_proto_worker_stats,
    to_proto_generate_request,
)
from kvtier.rpc.status import FIELD_METADATA_KEY
from kvtier.runtime.config import ControllerConfig
from kvtier.worker.actor import WorkerRuntime
from kvtier.worker.link import WorkerLink
from kvtier.worker.servicer import serve_worker

from hf_checkpoints import build_checkpoint, load_hf

PAGE_SIZE = 4
VOCAB = 256
CONTEXT = 512
WORKER_ID = "w-fuzz"
CALL_TIMEOUT_S = 20.0  # a fuzzed call answering later than this counts as a hang
GOOD_PROMPT = (3, 1, 4, 1, 5, 9, 2, 6, 5)
GOOD_STEPS = 3
ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
# The client may send more than the server accepts, so oversize messages reach the server.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVICES = (
    (router_pb2, "Router", "controller"),
    (sessions_pb2, "Sessions", "controller"),
    (admin_pb2, "Admin", "controller"),
    (worker_link_pb2, "WorkerLink", "controller"),
    (worker_pb2, "Worker", "worker"),
)
# A dozen examples per RPC in `make test`; KVTIER_FUZZ_EXAMPLES=500 digs deeper locally.
FUZZ = settings(
    max_examples=int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@dataclass(frozen=True)
class Rpc:
    path: str
    method: pb_descriptor.MethodDescriptor
    server: str  # "controller" or "worker"

    @property
    def input_type(self) -> pb_descriptor.Descriptor:
        return self.method.input_type

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def all_rpcs() -> list[Rpc]:
    rpcs = []
    for module, name, server in SERVICES:
        service = module.DESCRIPTOR.services_by_name[name]
        rpcs += [Rpc(f"/{service.full_name}/{m.name}", m, server) for m in service.methods]
    return rpcs


RPCS = all_rpcs()


# --------------------------------------------------------------------------- servers


@dataclass
class Servers:
    runtime: WorkerRuntime
    worker: Any
    controller: Any
    link: WorkerLink
    namespace: NamespaceIdentity
    expected_tokens: list[int]
    channels: dict[str, grpc.Channel]

    def call(self, rpc: Rpc, payload: bytes | list[bytes], timeout_s: float = CALL_TIMEOUT_S) -> grpc.RpcError | None:
        """Send raw request bytes; the error (None on OK). Streams are read to their end."""
        channel = self.channels[rpc.server]
        try:
            if rpc.method.client_streaming:
                messages = payload if isinstance(payload, list) else [payload]
                call = channel.stream_stream(rpc.path)
                for _ in call(iter(messages), timeout=timeout_s):
                    pass
            elif rpc.method.server_streaming:
                for _ in channel.unary_stream(rpc.path)(payload, timeout=timeout_s):
                    pass
            else:
                channel.unary_unary(rpc.path)(payload, timeout=timeout_s)
        except grpc.RpcError as err:
            return err
        return None


def _good_generate(namespace: NamespaceIdentity, steps: int = GOOD_STEPS) -> worker_pb2.GenerateRequest:
    return to_proto_generate_request(
        GenerateRequest(
            namespace=namespace,
            prompt_token_ids=GOOD_PROMPT,
            sampling=SamplingParams(max_tokens=steps, ignore_eos=True),
        )
    )


@pytest.fixture(scope="module")
def servers(redis_url, tmp_path_factory) -> Iterator[Servers]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.close()
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("fuzz-ckpt") / "tiny-llama", "llama", seed=0)
    hf = load_hf(checkpoint)
    out = hf.generate(torch.tensor([GOOD_PROMPT]), max_new_tokens=GOOD_STEPS, min_new_tokens=GOOD_STEPS, do_sample=False)
    expected = out[0, len(GOOD_PROMPT) :].tolist()
    engine = Engine.from_pretrained(checkpoint, page_size=PAGE_SIZE, num_pages=160)
    runtime = WorkerRuntime("kvtier-fuzz-servers")
    state_dir = tmp_path_factory.mktemp("fuzz-state")

    async def start():
        worker = await serve_worker(engine, worker_id=WORKER_ID)
        config = ControllerConfig(port=0, state_dir=state_dir, lease_ttl_s=3.0, heartbeat_interval_s=1.0)
        controller = await serve_controller(config, redis_url=redis_url, controller_id="ctl-fuzz")
        link = WorkerLink(
            worker.loop,
            controller_address=controller.address,
            worker_id=worker.worker_id,
            address=worker.address,
            boot_id=worker.boot_id,
            heartbeat_interval_s=0.5,
            batch_interval_s=0.02,
            max_backoff_s=0.2,
        )
        link.start()
        return worker, controller, link

    worker, controller, link = runtime.run(start(), timeout_s=60)
    channels = {
        "controller": grpc.insecure_channel(controller.address, options=CHANNEL_OPTIONS),
        "worker": grpc.insecure_channel(worker.address, options=CHANNEL_OPTIONS),
    }
    servers = Servers(runtime, worker, controller, link, engine.namespace, expected, channels)
    deadline = time.monotonic() + 30
    while WORKER_ID not in _routed(servers):
        assert time.monotonic() < deadline, "the worker never became routable"
        time.sleep(0.05)
    yield servers
    for channel in channels.values():
        channel.close()

    async def stop():
        await link.stop()
        await controller.stop(0)
        await worker.stop(0)
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    runtime.run(stop(), timeout_s=60)
    runtime.close()


def _routed(servers: Servers) -> list[str]:
    """The workers a good Route ranks; none while no live worker serves the namespace (Route
    answers UNAVAILABLE until the worker's registration is read)."""
    request = to_proto_route_request(RouteRequest(servers.namespace, TokenPrefix(GOOD_PROMPT)))
    try:
        raw = servers.channels["controller"].unary_unary("/kvtier.v1.Router/Route")(
            request.SerializeToString(), timeout=10
        )
    except grpc.RpcError as exc:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            return []
        raise
    return [w.worker_id for w in router_pb2.RouteResponse.FromString(raw).workers]


def assert_serving(servers: Servers) -> None:
    """Both servers healthy; a good Route ranks the worker; a good Generate matches the oracle."""
    for channel in servers.channels.values():
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert servers.worker.loop.is_alive, "the engine thread died"
    assert WORKER_ID in _routed(servers)
    stub = worker_pb2_grpc.WorkerStub(servers.channels["worker"])
    tokens = []
    for event in stub.Generate(_good_generate(servers.namespace), timeout=30):
        tokens += event.tokens.token_ids
    assert tokens == servers.expected_tokens


def assert_answered(rpc: Rpc, err: grpc.RpcError | None) -> None:
    if err is None:
        return
    code = err.code()
    assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"{rpc.path} hung past its deadline"
    assert code in ALLOWED, f"{rpc.path} answered {code.name}: {err.details()}"
    if code is not grpc.StatusCode.UNIMPLEMENTED:
        assert err.details(), f"{rpc.path} answered {code.name} without a message"


# --------------------------------------------------------------------------- strategies

INT32_EDGES = [0, 1, -1, 2**31 - 1, -(2**31)]
UINT32_EDGES = [0, 1, 2**32 - 1, 2**31]
INT64_EDGES = [0, 1, -1, 2**63 - 1, -(2**63)]
UINT64_EDGES = [0, 1, 2**64 - 1, 2**63]
_FD = pb_descriptor.FieldDescriptor
KEY_BYTES_EDGE = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))


def _ints(lo: int, hi: int, edges: list[int]) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _strings(field: pb_descriptor.FieldDescriptor, namespace: NamespaceIdentity) -> st.SearchStrategy[str]:
    known = getattr(namespace, field.name, None)
    words = ["", "hbm", "dram", "nvme", "fp32", "bf16", "value", WORKER_ID + "-x", "s-1", "t"]
    if isinstance(known, str):
        words.append(known)
    return st.one_of(
        st.sampled_from(words),
        st.text(max_size=24),
        st.integers(250, 5000).map(lambda n: "x" * n),  # around MAX_ID_CHARS / MAX_TEXT_CHARS
    )


def _scalar(field: pb_descriptor.FieldDescriptor, namespace: NamespaceIdentity) -> st.SearchStrategy[Any]:
    t = field.type
    if t in (_FD.TYPE_INT32, _FD.TYPE_SINT32, _FD.TYPE_SFIXED32):
        if field.name in ("ids", "prompt_token_ids", "stop_token_ids", "tool_call_sequence"):
            return _ints(-(2**31), 2**31 - 1, [0, 5, VOCAB - 1, VOCAB, -1, 2**31 - 1])
        return _ints(-(2**31), 2**31 - 1, INT32_EDGES)
    if t in (_FD.TYPE_UINT32, _FD.TYPE_FIXED32):
        if field.name == "page_size":
            return _ints(0, 2**32 - 1, [0, PAGE_SIZE, 16, 2**32 - 1])
        return _ints(0, 2**32 - 1, UINT32_EDGES)
    if t in (_FD.TYPE_INT64, _FD.TYPE_SINT64, _FD.TYPE_SFIXED64):
        return _ints(-(2**63), 2**63 - 1, INT64_EDGES)
    if t in (_FD.TYPE_UINT64, _FD.TYPE_FIXED64):
        return _ints(0, 2**64 - 1, UINT64_EDGES)
    if t in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        floats = st.floats(allow_nan=True, allow_infinity=True, width=64 if t == _FD.TYPE_DOUBLE else 32)
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0]), floats)
    if t == _FD.TYPE_BOOL:
        return st.booleans()
    if t == _FD.TYPE_STRING:
        return _strings(field, namespace)
    if t == _FD.TYPE_BYTES:
        return KEY_BYTES_EDGE
    if t == _FD.TYPE_ENUM:
        return st.integers(-2, len(field.enum_type.values) + 2)  # unknown numbers included
    raise AssertionError(f"no strategy for field type {t}")


def _message(descriptor: pb_descriptor.Descriptor, namespace: NamespaceIdentity, depth: int):
    """Field values by name for one message (a dict); nested messages are dicts too."""
    if descriptor.full_name == "kvtier.v1.NamespaceIdentity":
        # Mostly the served namespace with some fields changed, so validation gets past it.
        valid = {
            f.name: getattr(namespace, f.name) for f in descriptor.fields if getattr(namespace, f.name, None)
        }
        changes = st.fixed_dictionaries(
            {}, optional={f.name: _field(f, namespace, depth) for f in descriptor.fields}
        )
        return st.one_of(changes.map(lambda c: {**valid, **c}), changes)
    if depth <= 0:
        return st.just({})
    return st.fixed_dictionaries({}, optional={f.name: _field(f, namespace, depth - 1) for f in descriptor.fields})


def _field(field: pb_descriptor.FieldDescriptor, namespace: NamespaceIdentity, depth: int):
    if field.type == _FD.TYPE_MESSAGE:
        entry = field.message_type
        if entry.GetOptions().map_entry:
            key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
            value = (
                _message(value_field.message_type, namespace, depth)
                if value_field.type == _FD.TYPE_MESSAGE
                else _scalar(value_field, namespace)
            )
            return st.dictionaries(_scalar(key_field, namespace), value, max_size=4)
        element = _message(entry, namespace, depth)
    else:
        element = _scalar(field, namespace)
    if field.is_repeated:
        return st.lists(element, max_size=6)
    return element


def build(descriptor: pb_descriptor.Descriptor, values: dict[str, Any]) -> Any:
    message = message_factory.GetMessageClass(descriptor)()
    _fill(message, values)
    return message


def _fill(message: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        target = getattr(message, name) if field.type == _FD.TYPE_MESSAGE or field.is_repeated else None
        if field.type == _FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for k, v in value.items():
                if value_field.type == _FD.TYPE_MESSAGE:
                    _fill(target[k], v)
                else:
                    target[k] = v
        elif field.type == _FD.TYPE_MESSAGE and field.is_repeated:
            for item in value:
                _fill(target.add(), item)
        elif field.type == _FD.TYPE_MESSAGE:
            target.SetInParent()
            _fill(target, value)
        elif field.is_repeated:
            target.extend(value)
        else:
            setattr(message, name, value)


# Raw protobuf wire encoding, for what a well-behaved serializer refuses to produce.
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


def _mutation(descriptor: pb_descriptor.Descriptor):
    """Raw bytes appended to a message: each one something a serializer never writes."""
    strings = [f.number for f in descriptor.fields if f.type == _FD.TYPE_STRING]
    numbers = [
        f.number for f in descriptor.fields if f.type not in (_FD.TYPE_MESSAGE, _FD.TYPE_STRING, _FD.TYPE_BYTES)
    ]
    choices = [
        st.builds(lambda n, w: tag(n, w), st.integers(1, 20), st.sampled_from([3, 4, 6, 7])),  # bad wire types
        st.builds(lambda n: tag(n, 2) + varint(1 << 20) + b"short", st.integers(1, 20)),  # truncated
        st.builds(lambda n: tag(n, 0) + b"\xff" * 11, st.integers(1, 20)),  # an 11-byte varint
    ]
    if strings:
        bad_utf8 = st.sampled_from([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b", b"\xf8\x88\x80\x80\x80"])
        choices.append(st.builds(length_delimited, st.sampled_from(strings), bad_utf8))
    if numbers:
        overflow = st.sampled_from([2**64 - 1, 2**63, 2**32, 2**32 + 7, 2**40])
        choices.append(st.builds(lambda n, v: tag(n, 0) + varint(v), st.sampled_from(numbers), overflow))
        choices.append(st.builds(lambda n: tag(n, 2) + varint(3) + b"abc", st.sampled_from(numbers)))  # wrong type
    return st.one_of(choices)


def payloads(rpc: Rpc, namespace: NamespaceIdentity):
    """One fuzzed request as bytes: arbitrary, structured, or structured plus a raw mutation."""
    structured = _message(rpc.input_type, namespace, depth=3).map(
        lambda values: build(rpc.input_type, values).SerializeToString()
    )
    mutated = st.builds(lambda body, tail: body + tail, structured, _mutation(rpc.input_type))
    return st.one_of(st.binary(max_size=200), structured, structured, mutated)


def register_message(worker_id: str, namespace: NamespaceIdentity) -> bytes:
    register = worker_link_pb2.Register(
        worker_id=worker_id,
        address="127.0.0.1:9",
        boot_id="boot-fuzz",
        model=common_pb2.ModelIdentity(
            model_id=namespace.model_id, weights_digest=namespace.weights_digest, kv_dtype=namespace.kv_dtype
        ),
        page_size=PAGE_SIZE,
        capacities=[common_pb2.TierCapacity(tier=common_pb2.TIER_HBM, capacity_pages=8, capacity_bytes=8)],
    )
    return worker_link_pb2.WorkerEvent(register=register).SerializeToString()


# --------------------------------------------------------------------------- tests


def test_the_fuzzed_rpcs_are_every_rpc_of_every_kvtier_service():
    services = set()
    for module in (router_pb2, sessions_pb2, admin_pb2, worker_link_pb2, worker_pb2):
        services |= {s.full_name for s in module.DESCRIPTOR.services_by_name.values()}
    fuzzed = {rpc.path.split("/")[1] for rpc in RPCS}
    assert fuzzed == services
    assert len(RPCS) == sum(len(m.DESCRIPTOR.services_by_name[n].methods) for m, n, _ in SERVICES)


@pytest.mark.parametrize("rpc", RPCS, ids=lambda r: r.path.strip("/").replace("kvtier.v1.", ""))
@FUZZ
@given(data=st.data())
def test_malformed_requests_get_a_documented_status_and_the_servers_keep_serving(servers, rpc, data):
    payload = data.draw(payloads(rpc, servers.namespace), label="request bytes")
    if rpc.method.client_streaming:
        # A WorkerLink stream: the fuzzed event first, or after a valid Register (of a worker
        # that is not the real one), so both the handshake and a live stream get fuzzed.
        after_register = data.draw(st.booleans(), label="after a valid register")
        fake_worker = data.draw(st.sampled_from(["fuzz-a", "fuzz-b"]), label="worker id")
        payload = [register_message(fake_worker, servers.namespace), payload] if after_register else [payload]
    assert_answered(rpc, servers.call(rpc, payload))
    assert_serving(servers)


def _expect(servers: Servers, rpc_path: str, message: Any, code: grpc.StatusCode, field: str | None):
    rpc = next(r for r in RPCS if r.path == rpc_path)
    payload = message if isinstance(message, bytes) else message.SerializeToString()
    err = servers.call(rpc, payload)
    assert err is not None, f"{rpc_path} accepted the request"
    assert err.code() is code, f"{rpc_path}: {err.code().name}: {err.details()}"
    if field is not None:
        assert dict(err.trailing_metadata() or ()).get(FIELD_METADATA_KEY) == field, err.details()
    assert_serving(servers)
    return err.details()


def _generate(servers: Servers, prompt=GOOD_PROMPT, **sampling: Any) -> worker_pb2.GenerateRequest:
    message = _good_generate(servers.namespace)
    del message.prompt_token_ids[:]
    message.prompt_token_ids.extend(prompt)
    for name, value in sampling.items():
        field = getattr(message.sampling, name)
        if isinstance(value, list):
            del field[:]
            if value and isinstance(value[0], list):
                for seq in value:
                    field.add(ids=seq)
            else:
                field.extend(value)
        else:
            setattr(message.sampling, name, value)
    return message


def test_a_million_prompt_tokens_are_refused_by_the_context_limit(servers):
    details = _expect(
        servers, "/kvtier.v1.Worker/Generate", _generate(servers, prompt=[7] * 10**6),
        grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids",
    )
    assert f"{CONTEXT} tokens" in details


def test_more_prompt_tokens_than_any_request_may_carry_is_resource_exhausted(servers):
    over = MAX_PROMPT_TOKENS + 1
    _expect(servers, "/kvtier.v1.Worker/Generate", _generate(servers, prompt=[7] * over),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt_token_ids")
    route = to_proto_route_request(RouteRequest(servers.namespace, TokenPrefix((1,))))
    route.token_ids.ids.extend([1] * over)
    _expect(servers, "/kvtier.v1.Router/Route", route, grpc.StatusCode.RESOURCE_EXHAUSTED, "token_ids.ids")


def test_route_with_a_million_token_prefix_answers_in_time(servers):
    route = to_proto_route_request(RouteRequest(servers.namespace, TokenPrefix(tuple(range(10**6)))))
    raw = servers.channels["controller"].unary_unary("/kvtier.v1.Router/Route")(
        route.SerializeToString(), timeout=CALL_TIMEOUT_S
    )
    response = router_pb2.RouteResponse.FromString(raw)
    assert [w.worker_id for w in response.workers] == [WORKER_ID]
    assert response.workers[0].matched_tokens.hbm_tokens == 0
    assert_serving(servers)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"stop_sequences": [[1]] * 17}, "sampling.stop_sequences"),
        ({"stop_sequences": [[1] * 65]}, "sampling.stop_sequences[0]"),
        ({"stop_sequences": [[]]}, "sampling.stop_sequences[0]"),
        ({"stop_sequences": [[1], [1, -4]]}, "sampling.stop_sequences[1].ids[1]"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "sampling.stop_token_ids"),
        ({"tool_call_sequence": [2] * 65}, "sampling.tool_call_sequence"),
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_p": float("inf")}, "sampling.top_p"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
    ],
    ids=[
        "17-stop-sequences", "65-token-stop-sequence", "empty-stop-sequence", "negative-stop-token",
        "too-many-stop-ids", "long-tool-call-sequence", "nan-temperature", "negative-temperature",
        "inf-top-p", "zero-top-p", "zero-max-tokens",
    ],
)
def test_sampling_parameters_beyond_their_limits_are_invalid_argument(servers, sampling, field):
    details = _expect(
        servers, "/kvtier.v1.Worker/Generate", _generate(servers, **sampling), grpc.StatusCode.INVALID_ARGUMENT, field
    )
    assert details.startswith(field)


@pytest.mark.parametrize(
    "sampling",
    [
        {"max_tokens": 2**32 - 1},
        {"seed": 2**64 - 1},
        {"top_k": 2**32 - 1},
        {"temperature": 1e308, "seed": 1},
        {"stop_token_ids": [2**31 - 1]},
    ],
    ids=["max-tokens-uint32-max", "seed-uint64-max", "top-k-uint32-max", "huge-temperature", "int32-max-stop-id"],
)
def test_numeric_edges_in_sampling_generate_or_are_refused_cleanly(servers, sampling):
    rpc = next(r for r in RPCS if r.name == "Generate")
    assert_answered(rpc, servers.call(rpc, _generate(servers, **sampling).SerializeToString()))
    assert_serving(servers)


@pytest.mark.parametrize("priority", [2**31 - 1, -(2**31), 1001])
def test_priority_out_of_range_is_invalid_argument(servers, priority):
    message = _generate(servers)
    message.priority = priority
    _expect(servers, "/kvtier.v1.Worker/Generate", message, grpc.StatusCode.INVALID_ARGUMENT, "priority")


@pytest.mark.parametrize(
    ("rpc_path", "strip", "field"),
    [
        ("/kvtier.v1.Router/Route", "namespace", "namespace"),
        ("/kvtier.v1.Router/Route", "model_id", "namespace.model_id"),
        ("/kvtier.v1.Router/Route", "kv_dtype", "namespace.kv_dtype"),
        ("/kvtier.v1.Router/Route", "page_size", "namespace.page_size"),
        ("/kvtier.v1.Router/Route", "prefix", "prefix"),
        ("/kvtier.v1.Admin/Lookup", "namespace", "namespace"),
        ("/kvtier.v1.Admin/Lookup", "model_id", "namespace.model_id"),
        ("/kvtier.v1.Worker/Generate", "namespace", "namespace"),
        ("/kvtier.v1.Worker/Generate", "model_id", "namespace.model_id"),
        ("/kvtier.v1.Worker/Generate", "kv_dtype", "namespace.kv_dtype"),
        ("/kvtier.v1.Worker/Generate", "page_size", "namespace.page_size"),
        ("/kvtier.v1.Worker/Generate", "prompt", "prompt_token_ids"),
    ],
)
def test_missing_identity_fields_are_invalid_argument_naming_the_field(servers, rpc_path, strip, field):
    if rpc_path.endswith("Generate"):
        message = _generate(servers)
    elif rpc_path.endswith("Route"):
        message = to_proto_route_request(RouteRequest(servers.namespace, TokenPrefix(GOOD_PROMPT)))
    else:
        message = admin_pb2.LookupRequest(
            namespace=to_proto_namespace_identity(servers.namespace), token_ids=common_pb2.TokenIds(ids=[1])
        )
    if strip == "namespace":
        message.ClearField("namespace")
    elif strip == "prefix":
        message.ClearField("token_ids")
    elif strip == "prompt":
        del message.prompt_token_ids[:]
    else:
        message.namespace.ClearField(strip)
    _expect(servers, rpc_path, message, grpc.StatusCode.INVALID_ARGUMENT, field)


@pytest.mark.parametrize("rpc", [r for r in RPCS if any(f.type == _FD.TYPE_STRING for f in r.input_type.fields)],
                         ids=lambda r: r.name)
def test_invalid_utf8_in_a_string_field_is_invalid_argument(servers, rpc):
    field = next(f for f in rpc.input_type.fields if f.type == _FD.TYPE_STRING)
    payload = length_delimited(field.number, b"bad \xff\xfe utf-8")
    if rpc.method.client_streaming:
        payload = length_delimited(1, payload)  # inside WorkerEvent.register
    details = _expect(servers, rpc.path, payload, grpc.StatusCode.INVALID_ARGUMENT, "request")
    assert "UTF-8" in details


def test_a_field_path_holding_any_text_still_travels_as_valid_metadata(servers):
    # A map key is the caller's text and ends up in the field path: escaped, not INTERNAL.
    policy = admin_pb2.SetPolicyRequest(
        policy=admin_pb2.Policy(watermarks={"h\x00b\u00fcm\n": admin_pb2.Watermarks(high=0.9, low=0.5)},
                                eviction_policy="value")
    )
    _expect(servers, "/kvtier.v1.Admin/SetPolicy", policy, grpc.StatusCode.INVALID_ARGUMENT,
            "policy.watermarks.h\\x00b\\xfcm\\n")


def test_a_message_over_the_maximum_size_is_resource_exhausted(servers):
    over = length_delimited(4, b"s" * (MAX_MESSAGE_BYTES + 1024))  # RouteRequest.session_id
    _expect(servers, "/kvtier.v1.Router/Route", over, grpc.StatusCode.RESOURCE_EXHAUSTED, None)
    prompt = length_delimited(2, varint(5) * (MAX_MESSAGE_BYTES + 1024))  # packed prompt ids
    _expect(servers, "/kvtier.v1.Worker/Generate", prompt, grpc.StatusCode.RESOURCE_EXHAUSTED, None)


@pytest.mark.parametrize("hint", ["Pause", "Returning"])
@pytest.mark.parametrize("duration_ms", [2**64 - 1, MAX_DURATION_MS + 1])
def test_session_hint_durations_beyond_a_year_are_invalid_argument(servers, hint, duration_ms):
    session = f"s-edge-{hint}-{duration_ms}"
    route = to_proto_route_request(
        RouteRequest(servers.namespace, TokenPrefix(GOOD_PROMPT), session_id=session)
    )
    servers.channels["controller"].unary_unary("/kvtier.v1.Router/Route")(route.SerializeToString(), timeout=10)
    if hint == "Pause":
        message, field = sessions_pb2.PauseRequest(session_id=session, tool_name="t", expected_ms=duration_ms), "expected_ms"
    else:
        message, field = sessions_pb2.ReturningRequest(session_id=session, eta_ms=duration_ms), "eta_ms"
    _expect(servers, f"/kvtier.v1.Sessions/{hint}", message, grpc.StatusCode.INVALID_ARGUMENT, field)


def test_session_hints_at_the_duration_limits_are_answered(servers):
    session = "s-edge-limits"
    route = to_proto_route_request(
        RouteRequest(servers.namespace, TokenPrefix(GOOD_PROMPT), session_id=session)
    )
    servers.channels["controller"].unary_unary("/kvtier.v1.Router/Route")(route.SerializeToString(), timeout=10)
    sessions = {r.name: r for r in RPCS if r.path.startswith("/kvtier.v1.Sessions/")}
    for rpc, message in [
        (sessions["Pause"], sessions_pb2.PauseRequest(session_id=session, expected_ms=MAX_DURATION_MS)),
        (sessions["Returning"], sessions_pb2.ReturningRequest(session_id=session, eta_ms=MAX_DURATION_MS)),
        (sessions["Pause"], sessions_pb2.PauseRequest(session_id=session, expected_ms=0)),
        (sessions["Returning"], sessions_pb2.ReturningRequest(session_id=session, eta_ms=0)),
        (sessions["End"], sessions_pb2.EndRequest(session_id=session)),
    ]:
        assert_answered(rpc, servers.call(rpc, message.SerializeToString()))
    assert_serving(servers)


def test_a_worker_link_event_that_does_not_convert_is_rejected_and_the_stream_stays_up(servers):
    rejected = servers.controller.links.num_rejected
    bad_key = worker_link_pb2.WorkerEvent(
        page_events=worker_link_pb2.PageEventBatch(
            seq=1,
            events=[worker_link_pb2.PageEvent(kind=1, namespace_digest=b"x" * 16, page_key=b"short", depth=1, tier=1)],
        )
    )
    heartbeat = worker_link_pb2.WorkerEvent(heartbeat=worker_link_pb2.Heartbeat(seq=1))
    rpc = next(r for r in RPCS if r.name == "Connect")
    messages = [register_message("fuzz-c", servers.namespace), bad_key.SerializeToString(), heartbeat.SerializeToString()]
    assert servers.call(rpc, messages) is None, "the stream ends when the worker closes it, not before"
    assert servers.controller.links.num_rejected == rejected + 1
    assert_serving(servers)


@pytest.mark.parametrize("first", ["heartbeat", "garbage"])
def test_a_worker_link_stream_must_start_with_a_decodable_register(servers, first):
    rpc = next(r for r in RPCS if r.name == "Connect")
    if first == "heartbeat":
        message = worker_link_pb2.WorkerEvent(heartbeat=worker_link_pb2.Heartbeat(seq=1)).SerializeToString()
        code, field = grpc.StatusCode.FAILED_PRECONDITION, "event"
    else:
        message, code, field = b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "request"
    _expect(servers, rpc.path, message, code, field)


def test_after_the_fuzzing_no_page_is_held_and_every_pool_is_consistent(servers):
    stub = worker_pb2_grpc.WorkerStub(servers.channels["worker"])
    deadline = time.monotonic() + 15
    while True:
        stats = from_proto_worker_stats(stub.Stats(worker_pb2.StatsRequest(), timeout=10))
        if sum(t.in_use_pages for t in stats.tiers) == 0 and stats.queue_depth == stats.num_running_seqs == 0:
            break
        assert time.monotonic() < deadline, f"pages still held: {stats}"
        time.sleep(0.05)
    result = from_proto_integrity_result(stub.CheckIntegrity(worker_pb2.CheckIntegrityRequest(), timeout=10))
    assert result.is_ok, result.problems
    assert servers.link.is_connected, "the real worker's link must survive the fuzzed WorkerLink streams"
