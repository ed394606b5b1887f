"""``python -m kvtier.controller [--config FILE] [flags]``: one controller in this process.

Serves until SIGINT or SIGTERM, then closes worker links and gives the leader lease up so
a standby takes over at once. Every ``ControllerConfig`` field is a flag (``--lease-ttl-s``),
an environment variable (``KVTIER_LEASE_TTL_S``) or a config-file key.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.domain.errors import KvtierError
from kvtier.runtime import tracing
from kvtier.runtime.config import ControllerConfig, load_config, settings_of
from kvtier.runtime.log import setup_logging

EXIT_BAD_INPUT = 2


@dataclass(frozen=True, slots=True)
class ControllerArgs:
    config: ControllerConfig
    controller_id: str | None = None
    advertise_host: str | None = None


def controller_args(
    argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None
) -> ControllerArgs:
    """Parse flags into ``ControllerArgs``; ``load_config`` validates them (errors name the field)."""
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.controller", description="Run one kvtier controller."
    )
    parser.add_argument("--config", help="configuration file (.toml or .yaml)")
    for s in settings_of(ControllerConfig):
        if s.name in ("log_json", "allow_unauthenticated"):  # switches: given means true
            parser.add_argument(s.flag, dest=s.name, action="store_const", const="true", help=s.help)
        else:
            accepted = s.accepted or f"default {s.default}"
            parser.add_argument(s.flag, dest=s.name, help=f"{s.help} ({accepted}; env {s.env_var})")
    parser.add_argument("--controller-id", help="id in logs, Admin.Status and the leader lease "
                                                "(default controller-<host>-<pid>-<port>)")
    parser.add_argument(
        "--advertise-host",
        help="host workers and clients dial (default: the listen host, or this machine's address "
        "when listening on every interface)",
    )
    ns = vars(parser.parse_args(argv))
    controller_id, advertise_host = ns.pop("controller_id"), ns.pop("advertise_host")
    file = ns.pop("config")
    config = load_config(ControllerConfig, file=file, env=env, overrides=ns)
    return ControllerArgs(config, controller_id, advertise_host)


async def _serve(args: ControllerArgs) -> int:
    from kvtier.controller.server import serve_controller

    try:
        # Spans and metrics over OTLP when otlp_endpoint is set (a missing exporter fails here).
        tracing.setup_process("kvtier-controller", otlp_endpoint=args.config.otlp_endpoint)
        server = await serve_controller(
            args.config, controller_id=args.controller_id, advertise_host=args.advertise_host
        )
    except KvtierError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"kvtier controller {server.controller_id} serving on {server.address} "
          f"({server.access.role.value})", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
    tracing.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = controller_args(argv)
    except KvtierError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    setup_logging(args.config.log_level, args.config.log_json)
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
