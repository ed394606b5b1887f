"""What every ``kvtier`` command shares: the ``app``, exit codes, options and the controller helpers.

Each command module (``main``: the local commands and ``status``; ``admin``: the operator
commands; ``bench``; ``policy``; ``token``) registers its commands on ``app`` and imports
only this module, so the command modules form no import circle; ``kvtier.cli.main`` imports
them all and runs the app.

Exit codes, the same for every command:

    0  done
    1  the controller refused or failed the operation (NOT_FOUND, FAILED_PRECONDITION, ...)
    2  bad input (a flag, a file, or INVALID_ARGUMENT from the controller), or the
       controller could not be reached

Commands raise domain errors; ``main`` turns each into one ``error: ...`` line on stderr,
never a traceback. ``remote_error`` is the one place a controller's status code becomes a
message and an exit code. ``--json`` prints one JSON document on stdout and nothing else
(progress and notes go to stderr).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from kvtier.domain.errors import KvtierError
from kvtier.domain.tiers import Tier
from kvtier.policy.capacity import validate_budget
from kvtier.runtime.config import WorkerConfig, load_config, settings_of

if TYPE_CHECKING:
    from kvtier.client import AsyncClient

T = TypeVar("T")

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
DEFAULT_CONTROLLER = "127.0.0.1:50051"
DEFAULT_STATE_DIR = Path(".kvtier")
GIB = 1 << 30
DEMO_TRACE = Path("../shared/traces/azure_llm_inference_2023_code.csv")
DEMO_TRACE_COLUMN = "ContextTokens"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_TIER_LABELS = {"hbm": "HBM", "dram": "DRAM", "nvme": "NVMe"}

app = typer.Typer(
    name="kvtier",
    help="kvtier: distributed KV-cache tiering for LLM serving (HBM -> DRAM -> NVMe).",
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)


def _console() -> Console:
    # Piped output (CI logs, `| less`) gets a fixed width instead of rich's 80 columns,
    # which would wrap the tier table.
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _worker_setting_help(name: str) -> str:
    """A WorkerConfig setting's help, accepted values and default, as ``kvtier worker`` has them."""
    info = next(i for i in settings_of(WorkerConfig) if i.name == name)
    return f"{info.help[:1].upper()}{info.help[1:]}; {info.accepted or 'any'}, default {info.default}."


def _worker_option(name: str) -> Any:
    """A ``kvtier up`` option setting every worker's ``name``: its env var and help as ``kvtier worker`` has them."""
    return typer.Option(envvar=f"KVTIER_{name.upper()}", help=_worker_setting_help(name))


def _gib_to_bytes(gib: float, flag: str, *, positive: bool = False) -> int:
    validate_budget(gib, name=flag, positive=positive)
    return round(gib * GIB)


def _format_bytes(num_bytes: float | Fraction) -> str:
    num_bytes = float(num_bytes)  # Fraction has no format spec before Python 3.12
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:,.0f} {unit}" if unit == "B" else f"{num_bytes:,.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _json_number(value: Any) -> int | float:
    """Fractions (fp4 bytes per token) as JSON numbers: whole ones as integers."""
    return int(value) if value == int(value) else float(value)


# ---- talking to a controller ----------------------------------------------------------------

ControllerOption = Annotated[
    str | None,
    typer.Option(
        "--controller",
        envvar="KVTIER_CONTROLLER",
        show_default=False,
        help="host:port of the controller. Default: the one `kvtier up` recorded in "
        "$KVTIER_STATE_DIR (./.kvtier), else 127.0.0.1:50051.",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="KVTIER_TOKEN",
        show_default=False,
        help="Bearer token (admin role) sent with every call; prefer the env var, which stays out of `ps`.",
    ),
]
TimeoutOption = Annotated[
    float, typer.Option("--timeout-s", min=0.001, help="Deadline of each call to the controller, seconds.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout, nothing else.")]


class CommandFailed(Exception):
    """The command cannot complete; ``main`` prints the message as one line and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True, slots=True)
class Remote:
    """Where and how a command reaches the controller (flags already resolved)."""

    address: str
    token: str | None = None
    timeout_s: float = 10.0

    @classmethod
    def of(cls, controller: str | None, token: str | None, timeout_s: float) -> Remote:
        address = resolve_controller(controller)
        return cls(address, token or resolve_local_token(address), timeout_s)

    def client(self) -> AsyncClient:
        """A client for this controller. TLS and a token file come from ClientConfig's
        ``KVTIER_*`` variables (KVTIER_TLS_CA_FILE, KVTIER_AUTH_TOKEN_FILE, ...); --token wins."""
        from kvtier.client import AsyncClient
        from kvtier.rpc.auth import read_token_file
        from kvtier.rpc.tls import ClientTls
        from kvtier.runtime.config import ClientConfig

        config = load_config(ClientConfig, overrides={"controller_address": self.address, "timeout_s": self.timeout_s})
        token = self.token
        if token is None and config.auth_token_file is not None:
            token = read_token_file(config.auth_token_file)
        tls = ClientTls.from_files(config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name)
        return AsyncClient(self.address, token=token, timeout_s=self.timeout_s, max_retries=1, tls=tls)

    def run(self, work: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """Run ``work`` with a client for this controller; its errors become ``CommandFailed``."""
        client = self.client()  # configuration errors (exit 2) before anything is sent

        async def go() -> T:
            async with client:
                return await work(client)

        try:
            return asyncio.run(go())
        except KvtierError as exc:
            raise remote_error(self, exc) from None


def resolve_controller(flag: str | None) -> str:
    """--controller / KVTIER_CONTROLLER, else the address `kvtier up` recorded, else the default port."""
    if flag:
        return flag
    from kvtier.local.stack import STATE_FILE

    state_dir = Path(os.environ.get("KVTIER_STATE_DIR") or DEFAULT_STATE_DIR).expanduser()
    try:
        recorded = json.loads((state_dir / STATE_FILE).read_text())["controller"]
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_CONTROLLER
    return recorded if isinstance(recorded, str) and recorded else DEFAULT_CONTROLLER


def resolve_local_token(address: str) -> str | None:
    """The admin token `kvtier up` keeps in $KVTIER_STATE_DIR (./.kvtier), when ``address`` is
    that stack's controller; never sent anywhere else."""
    from kvtier.local.stack import local_admin_token

    return local_admin_token(Path(os.environ.get("KVTIER_STATE_DIR") or DEFAULT_STATE_DIR), address)


# status code name -> (exit code, what to do about it); everything else exits 1 as it is.
_REMOTE_FAILURES: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (EXIT_BAD_INPUT, ""),
    "UNAVAILABLE": (EXIT_BAD_INPUT, "; start one with `kvtier up` or pass --controller HOST:PORT"),
    "DEADLINE_EXCEEDED": (EXIT_BAD_INPUT, "; check that it is running, or raise --timeout-s"),
    "UNAUTHENTICATED": (EXIT_FAILED, "; pass --token or set KVTIER_TOKEN"),
    "PERMISSION_DENIED": (EXIT_FAILED, "; this needs a token with the admin role"),
    "UNIMPLEMENTED": (EXIT_FAILED, "; this controller's version does not offer it"),
}


def remote_error(remote: Remote, exc: KvtierError) -> CommandFailed:
    """The one mapping from a failed controller call to a one-line message and an exit code."""
    details = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    code = exc.code
    if type(exc) is KvtierError and ":" in details:  # a status kvtier.domain.errors has no class for
        name, rest = details.split(":", 1)
        if name.isupper():
            code, details = name, rest.strip()
    exit_code, hint = _REMOTE_FAILURES.get(code, (EXIT_FAILED, ""))
    if code == "UNAVAILABLE":
        return CommandFailed(f"cannot reach the controller at {remote.address} ({details[:200]}){hint}", exit_code)
    if code == "DEADLINE_EXCEEDED":
        return CommandFailed(
            f"no answer from the controller at {remote.address} within {remote.timeout_s:g} s{hint}", exit_code
        )
    where = f" ({exc.field})" if exc.field and exc.field not in details else ""
    return CommandFailed(f"{code} from {remote.address}: {details}{where}{hint}", exit_code)


def jsonable(value: Any) -> Any:
    """A domain record as plain JSON: tiers by label, enums by value, bytes as hex, tuples as lists."""
    if isinstance(value, Tier):
        return value.label
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {(k.label if isinstance(k, Tier) else str(k)): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def print_json(value: Any) -> None:
    print(json.dumps(jsonable(value), indent=2))


def stderr_console() -> Console:
    """Progress and notes of commands whose stdout may be JSON."""
    return Console(stderr=True)


def fail(message: str, exit_code: int = EXIT_BAD_INPUT) -> NoReturn:
    # One line, so scripts can show it whole; parser messages (YAML, JSON) may span several.
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"error: {one_line}", file=sys.stderr)
    sys.exit(exit_code)
