"""``kvtier gateway``: the OpenAI-compatible HTTP front end (``kvtier.gateway``).

    kvtier gateway --model DIR [--host 127.0.0.1] [--port 8000] [--require-key] [--tool-parser NAME]

``--model`` is the checkpoint directory the workers serve (its tokenizer and chat template
are the gateway's). The gateway's own token (``--token``: a frontend or admin token, else
the local stack's admin token) reads the served model's description (``Router.ListModels``);
each request's ``Authorization: Bearer`` key is passed through as that request's frontend token.
``--tool-parser`` names the model's tool-call format (``hermes``, ``llama3``); without it the
chat template selects one (``kvtier.gateway.tool_parsers.select_parser``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from kvtier.cli.common import ControllerOption, Remote, TimeoutOption, TokenOption, app, fail
from kvtier.domain.errors import ConfigError


@app.command("gateway")
def gateway_command(
    model: Annotated[Path, typer.Option(help="Checkpoint directory the workers serve (tokenizer, chat template).")],
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 30.0,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model name clients send (default: the directory's name).")
    ] = None,
    require_key: Annotated[bool, typer.Option(help="Refuse requests without an API key (401).")] = False,
    tool_parser: Annotated[
        str | None, typer.Option(help="Tool-call format of the model: hermes or llama3 (default: chosen from "
                                      "its chat template).")
    ] = None,
) -> None:
    """Serve OpenAI Chat Completions in front of the controller and workers.

    [bold]Example[/bold]

      kvtier gateway --model .kvtier/models/SmolLM2-135M-Instruct --port 8000
    """
    import uvicorn

    from kvtier.gateway.app import GatewayOptions, create_app
    from kvtier.gateway.model import describe_served_model
    from kvtier.gateway.tool_parsers import parser_format

    if tool_parser is not None:
        try:
            parser_format(tool_parser)
        except ConfigError as exc:
            fail(f"--tool-parser: {exc.message}")
    remote = Remote.of(controller, token, timeout_s)
    served = remote.run(lambda client: describe_served_model(client, model.expanduser().resolve(),
                                                             name=served_model_name, tool_parser=tool_parser))
    app_ = create_app(served, GatewayOptions(remote.address, require_key=require_key))
    typer.echo(f"gateway for model {served.name!r} (tool calls: {served.tool_parser}) on http://{host}:{port}/v1")
    asyncio.run(uvicorn.Server(uvicorn.Config(app_, host=host, port=port, log_level="warning")).serve())
