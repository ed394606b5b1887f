"""``kvtier token``: make bearer tokens and the hashed entries of a token table (``kvtier.rpc.auth``).

    kvtier token create --name frontend-acme --role frontend --tenant acme --table tokens.yaml
        prints a fresh token once (stdout) and appends its hashed entry to the table
    kvtier token create --name worker-0 --role worker --worker-id worker-0 --table tokens.yaml
        a worker's own token: it registers that worker id and no other
    echo -n "$TOKEN" | kvtier token hash
        prints the SHA-256 a table stores for a token read from stdin

Nothing here talks to a server: servers re-read their table within a second of a change,
so an appended entry works and a removed one stops working without a restart.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvtier.cli.common import app
from kvtier.domain.errors import InvalidArgument
from kvtier.rpc.auth import ROLES, append_entry, hash_token, make_entry, new_token

token_app = typer.Typer(
    name="token",
    help="Bearer tokens: create one (and its hashed table entry), or hash one from stdin.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)
app.add_typer(token_app, name="token")
_FLAGS = {"token.name": "--name", "token.role": "--role", "token.tenants": "--tenant",
          "token.worker_id": "--worker-id"}


@token_app.command("create")
def create_command(
    name: Annotated[str, typer.Option(help="Name of the caller: shown in audit fields and errors.")],
    role: Annotated[str, typer.Option(help=f"One of {', '.join(ROLES)}.")],
    tenant: Annotated[
        list[str] | None, typer.Option(help="A tenant a frontend token may act for; repeat for several.")
    ] = None,
    worker_id: Annotated[
        str | None, typer.Option(help="The worker id a worker token registers (required for --role worker).")
    ] = None,
    table: Annotated[
        Path | None,
        typer.Option(help="Token table (.yaml or .toml) to append the hashed entry to (created if missing)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: name, role, tenants, token, sha256.")] = False,
) -> None:
    """Make a fresh token; print it once and append its hashed entry to --table.

    The token is shown only here: the table keeps its SHA-256. Store it where the caller
    reads it (a 0600 file, a Secret) right away.

    [bold]Examples[/bold]

      kvtier token create --name frontend-acme --role frontend --tenant acme --table tokens.yaml
      kvtier token create --name ops --role admin --table tokens.yaml --json
      kvtier token create --name worker-0 --role worker --worker-id worker-0 --table tokens.yaml
    """
    if role not in ROLES:
        raise InvalidArgument(f"--role must be one of {', '.join(ROLES)}, got {role!r}", field="--role")
    token = new_token()
    try:
        entry = make_entry(name, role, tenant or [], hash_token(token), where="token", worker_id=worker_id)
    except InvalidArgument as err:  # name the flag, not the table field
        flag = _FLAGS.get(err.field or "", "--name")
        raise InvalidArgument(err.message.replace(err.field or "", flag), field=flag) from None
    if table is not None:
        append_entry(table, entry)
    if as_json:
        print(json.dumps({**entry.as_dict(), "tenants": sorted(entry.tenants), "token": token}, indent=2))
        return
    print(token)
    where = f"appended to {table}" if table is not None else "not stored: add this entry to a token table"
    print(f"# {entry.name} ({entry.role.value}) sha256 {entry.sha256}; {where}", file=sys.stderr)


@token_app.command("hash")
def hash_command() -> None:
    """Print the SHA-256 a token table stores for the token read from stdin (whitespace stripped).

    [bold]Example[/bold]

      kvtier token hash < frontend.token
    """
    token = sys.stdin.read().strip()
    if not token:
        raise InvalidArgument("stdin is empty; pipe the token in: kvtier token hash < FILE", field="stdin")
    print(hash_token(token))
