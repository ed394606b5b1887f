"""The FastAPI app: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
``/health``, ``/metrics``.

Auth: ``Authorization: Bearer <key>`` is passed through to the controller and workers as
the request's frontend token, so the token table decides the key's tenant and no key can
reach another tenant's pages. With ``require_key`` a request without a key is a 401 here;
a key the stack does not know is a 401 from the stack. One ``AsyncClient`` per key is kept
(least recently used ones are closed past ``MAX_CLIENTS``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.background import BackgroundTask

from kvtier.client import AsyncClient
from kvtier.domain.errors import KvtierError
from kvtier.gateway import generation
from kvtier.gateway.chat import Call, ChatCompletion, Detached, sampling_params, sse, usage_body
from kvtier.gateway.errors import ApiError, from_kvtier
from kvtier.gateway.generation import Finished
from kvtier.gateway.metrics import GatewayMetrics
from kvtier.gateway.model import ServedModel
from kvtier.gateway.protocol import CompletionRequest, parse_chat, parse_completion
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.gateway.app")
MAX_BODY_BYTES = 4 << 20
MAX_CLIENTS = 256
DRAIN_LIMIT_BYTES = 64 << 20
REQUEST_TIMEOUT_S = 600.0


@dataclass(slots=True)
class GatewayOptions:
    controller: str
    require_key: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    # Deadline of one request's calls to the stack, the whole Generate stream included: long
    # enough for max_tokens of decode on a slow or busy machine.
    timeout_s: float = REQUEST_TIMEOUT_S


class Clients:
    """One ``AsyncClient`` per bearer key (None: no key), least recently used closed first."""

    def __init__(self, controller: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.controller = controller
        self.timeout_s = timeout_s
        self._clients: OrderedDict[str | None, AsyncClient] = OrderedDict()

    async def get(self, key: str | None) -> AsyncClient:
        client = self._clients.pop(key, None) or AsyncClient(self.controller, token=key, timeout_s=self.timeout_s)
        self._clients[key] = client
        while len(self._clients) > MAX_CLIENTS:
            _, old = self._clients.popitem(last=False)
            await old.close()
        return client

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


def session_scope(key: str | None) -> str:
    """The session digest's tenant part: the key's hash (the stack maps keys to tenants)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] if key else ""


def create_app(model: ServedModel, options: GatewayOptions) -> FastAPI:
    metrics = GatewayMetrics()
    clients = Clients(options.controller, options.timeout_s)
    detached = Detached()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await detached.wait()
        await clients.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: ApiError, endpoint: str) -> JSONResponse:
        metrics.requests.labels(endpoint, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    async def read_body(request: Request) -> Any:
        """The JSON body. A body over the limit is read to its end (up to ``DRAIN_LIMIT_BYTES``)
        and dropped before the 413, so the client, still sending, reads the error instead of a
        reset connection."""
        too_large = ApiError(413, f"the body is over {options.max_body_bytes} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES:
            raise too_large
        raw = bytearray()
        num_bytes = 0
        async for piece in request.stream():
            num_bytes += len(piece)
            if num_bytes > DRAIN_LIMIT_BYTES:
                raise too_large
            if num_bytes <= options.max_body_bytes:
                raw += piece
        if num_bytes > options.max_body_bytes:
            raise too_large
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the body is not valid UTF-8", param="body", code="invalid_encoding") from None
        try:
            return json.loads(text)
        except ValueError:
            raise ApiError(400, "the body is not valid JSON", param="body", code="invalid_json") from None

    def bearer(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not key and options.require_key:
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>", code="invalid_api_key")
        return key or None

    def expected_ms(request: Request) -> int | None:
        value = request.headers.get("x-tool-expected-ms")
        if value is None:
            return None
        if not value.isdigit():
            raise ApiError(400, "X-Tool-Expected-Ms must be a non-negative integer", param="X-Tool-Expected-Ms")
        return int(value)

    def check_model(name: str) -> None:
        if name != model.name:
            raise ApiError(404, f"model {name!r} does not exist; GET /v1/models lists {model.name!r}",
                           param="model", code="model_not_found")

    async def handle(endpoint: str, request: Request,
                     run: Callable[[Any, str | None], Awaitable[Response]]) -> Response:
        try:
            key = bearer(request)
            response = await run(await read_body(request), key)
        except ApiError as exc:
            return error(exc, endpoint)
        except KvtierError as exc:
            return error(from_kvtier(exc), endpoint)
        except Exception:
            log.exception("unexpected error in %s", endpoint)
            return error(ApiError(500, "internal error in the gateway; see its log", code="internal_error"), endpoint)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def streamed(chunks: AsyncGenerator[dict[str, Any], None], endpoint: str) -> Response:
        """An SSE response; the first chunk is awaited here so that routing errors are HTTP statuses.

        A client that hangs up cancels the body's task (Starlette), which closes ``chunks`` and
        with it the worker's stream: the worker aborts the sequence and frees its pages. The
        stream counts in flight until ``close``, run once by the body's end or, when the client
        left before the body started, by the response's background task."""
        started = time.perf_counter()
        iterator = chunks  # an async generator is its own iterator, and has aclose
        first = await anext(iterator)
        metrics.streams_in_flight.inc()
        is_closed = False

        async def close() -> None:
            nonlocal is_closed
            if not is_closed:
                is_closed = True
                metrics.streams_in_flight.dec()
                await iterator.aclose()

        async def body() -> AsyncIterator[bytes]:
            try:
                yield sse(first)
                first_text = True
                async for chunk in iterator:
                    if first_text:
                        metrics.ttft_s.observe(time.perf_counter() - started)
                        first_text = False
                    yield sse(chunk)
            except KvtierError as exc:
                yield sse(from_kvtier(exc).body())
            finally:
                await close()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(close),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        async def run(body: Any, key: str | None) -> Response:
            req = parse_chat(body)
            check_model(req.model)
            call = Call(await clients.get(key), session_scope(key), request.headers.get("x-session-id"),
                        expected_ms(request), metrics, detached)
            completion = ChatCompletion(model, req, call)
            if req.stream:
                return await streamed(completion.stream(), "chat")
            return JSONResponse(await completion.result())

        return await handle("chat", request, run)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        async def run(body: Any, key: str | None) -> Response:
            req = parse_completion(body)
            check_model(req.model)
            client = await clients.get(key)
            chunks = text_completion(model, req, client)
            if req.stream:
                return await streamed(chunks, "completions")
            text, last = [], {}
            async for chunk in chunks:
                text.append(chunk["choices"][0]["text"])
                last = chunk
            last["choices"][0]["text"] = "".join(text)
            return JSONResponse(last)

        return await handle("completions", request, run)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "kvtier", "max_model_len": model.context_tokens}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model.name}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    app.state.metrics = metrics
    return app


async def text_completion(
    model: ServedModel, req: CompletionRequest, client: AsyncClient
) -> AsyncGenerator[dict[str, Any], None]:
    """``/v1/completions`` chunks: the prompt as given (no chat template), text deltas, then
    one chunk with the finish reason and usage (the non-streaming handler joins them). The
    first chunk comes from the worker's first answer, so a refused request is an HTTP status."""
    ids = model.text.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    if any(not 0 <= t < model.text.vocab_size for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {model.text.vocab_size})", param="prompt")
    sampling = sampling_params(model, req.sampling, len(ids))
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": model.name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    async for event in generation.run(client, model, ids, sampling, stops=req.sampling.stop):
        if isinstance(event, Finished):
            final = chunk("", event.finish_reason)
            if req.include_usage or not req.stream:
                final["usage"] = usage_body(event)
            yield final
        else:
            yield chunk(event)
