"""The OpenAI-compatible gateway of a local stack (``kvtier up``, ``kvtier demo``).

``start_gateway`` serves ``kvtier.gateway`` on uvicorn in the caller's event loop, in the
process that runs the stack, so stopping that process (Ctrl-C, ``kvtier down``) stops the
gateway with everything else. The gateway reads the served model's description with the
stack's admin token; each request's own ``Authorization: Bearer`` key is its frontend token.
Its URL is recorded under ``"gateway"`` in the stack's state file next to the controller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.client import AsyncClient
from kvtier.domain.errors import ConfigError, FailedPrecondition
from kvtier.gateway.app import GatewayOptions, create_app
from kvtier.gateway.model import ServedModel, describe_served_model
from kvtier.local.stack import STATE_FILE, LocalStack

DEFAULT_GATEWAY_PORT = 8000


@dataclass(slots=True)
class LocalGateway:
    url: str  # http://host:port (the OpenAI base URL is url + "/v1")
    model: ServedModel
    app: Any = field(repr=False)  # the FastAPI app (its state.metrics: the gateway's counters)
    _server: Any = field(repr=False)  # uvicorn.Server
    _serving: asyncio.Task[None] = field(repr=False)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    async def stop(self) -> None:
        """Stop accepting, end open streams, and wait for the server (at most 10 s)."""
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._serving), timeout=10)
        except TimeoutError:
            self._server.force_exit = True
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving


async def start_gateway(
    stack: LocalStack, checkpoint: Path, *, host: str = "127.0.0.1", port: int = DEFAULT_GATEWAY_PORT,
    require_key: bool = True, tool_parser: str | None = None,
) -> LocalGateway:
    """Serve the gateway for ``stack`` (which serves ``checkpoint``) on ``host:port`` (0: a free port);
    ``tool_parser``: the tool-call format (None: the chat template's)."""
    import uvicorn

    async with AsyncClient(stack.controller_address, token=stack.admin_token) as client:
        try:
            model = await describe_served_model(client, checkpoint.expanduser().resolve(), tool_parser=tool_parser)
        except ConfigError as exc:  # no tokenizer or chat template: a weights-only checkpoint
            raise ConfigError(f"{exc.message}; the gateway needs the checkpoint's tokenizer and chat "
                              "template (`kvtier up --no-gateway` serves without the gateway)",
                              field=exc.field) from None
    app = create_app(model, GatewayOptions(stack.controller_address, require_key=require_key))
    # The socket is bound here, not by uvicorn, so a taken port is an error to the caller
    # rather than uvicorn's exit of the whole process.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FailedPrecondition(f"the gateway cannot listen on {host}:{port} ({exc.strerror}); pick another "
                                 "port with --gateway-port (0: a free one)", field="gateway_port") from None
    bound = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=bound, log_level="warning"))
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()  # raises what stopped it
            raise FailedPrecondition("the gateway stopped while starting; see its log")
        await asyncio.sleep(0.05)
    gateway = LocalGateway(f"http://{host}:{bound}", model, app, server, serving)
    _record(stack.options.state_dir, gateway.url)
    return gateway


def _record(state_dir: Path, url: str) -> None:
    path = state_dir / STATE_FILE
    state = json.loads(path.read_text()) if path.exists() else {}
    state["gateway"] = url
    path.write_text(json.dumps(state, indent=2))
