"""``kvtier sessions``: the controller's sessions, filtered by state, page by page."""


from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from kvtier.cli.common import (
    ControllerOption,
    JsonOption,
    Remote,
    TimeoutOption,
    TokenOption,
    _console,
    app,
    print_json,
)
from kvtier.cli.flags import format_at
from kvtier.client import AsyncClient
from kvtier.domain.errors import InvalidArgument
from kvtier.domain.records import SessionInfo, SessionState


def _session_state(name: str | None) -> SessionState | None:
    if name is None:
        return None
    try:
        return SessionState(name.strip().lower())
    except ValueError:
        valid = ", ".join(s.value for s in SessionState)
        raise InvalidArgument(f"--state must be one of {valid}, got {name!r}", field="--state") from None


@app.command("sessions")
def sessions_command(
    state: Annotated[
        str | None, typer.Option(show_default=False, help="Only sessions in this state: active, paused, resuming, ended.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Most sessions to list (fetched page by page).")] = 1000,
    controller: ControllerOption = None,
    token: TokenOption = None,
    timeout_s: TimeoutOption = 10.0,
    as_json: JsonOption = False,
) -> None:
    """Sessions the controller tracks: state, worker, tool call, predicted return and prefetch.

    [bold]Examples[/bold]

      kvtier sessions
      kvtier sessions --state paused --json
    """
    wanted = _session_state(state)

    async def fetch(client: AsyncClient) -> tuple[list[SessionInfo], bool]:
        sessions: list[SessionInfo] = []
        async for session in client.iter_sessions(wanted, page_size=min(limit, 1000)):
            if len(sessions) == limit:
                return sessions, True
            sessions.append(session)
        return sessions, False

    sessions, truncated = Remote.of(controller, token, timeout_s).run(fetch)
    if as_json:
        print_json({"sessions": sessions, "truncated": truncated})
        return
    table = Table(title=f"{len(sessions)} session(s)" + (f" (first {limit})" if truncated else ""))
    for name in ("session", "state", "worker", "tool", "paused", "returns", "prefetch", "parked in", "cached tokens"):
        table.add_column(name, justify="right" if name == "cached tokens" else "left")
    for s in sessions:
        table.add_row(
            s.session_id,
            s.state.value,
            s.worker_id or "-",
            s.tool_name or "-",
            format_at(s.paused_at_ms),
            format_at(s.predicted_return_at_ms) + (f" ({s.prediction_source.value})" if s.prediction_source else ""),
            format_at(s.prefetch_at_ms),
            s.parked_tier.label if s.parked_tier else "-",
            f"{s.num_cached_tokens:,}",
        )
    _console().print(table)
