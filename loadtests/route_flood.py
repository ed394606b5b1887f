"""A small Route's latency while another credential floods Route with huge prefixes.

    python -m loadtests.route_flood [--flooders 16] [--tokens 1048576] [--duration-s 20] [--json]

Starts a controller (embedded Valkey, authentication on, one worker registered straight into
its registry: Route ranks it, nothing dials it), measures tenant A's 3-token Route p99 idle,
then again while ``--flooders`` threads of another process send tenant B's
``--tokens``-token Route back to back (one pre-serialized request, one channel). Prints both
p99s, their ratio (the goal: at most 3) and how the flood was answered (OK, or
RESOURCE_EXHAUSTED from B's per-credential limits). ``flood`` is the flooding process's entry
point (``tests/test_control_plane_fairness.py`` runs it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOKENS = {"fe-a": "kvt_flood-a", "fe-b": "kvt_flood-b"}


def flood(address: str, token: str, num_threads: int, num_tokens: int, run_s: float) -> None:
    """Send one ``num_tokens``-token Route from ``num_threads`` threads back to back for
    ``run_s``; print "flooding" at the first answer, then the answers' codes as JSON."""
    import grpc
    from google.rpc import error_details_pb2

    from kvtier.rpc._gen import router_pb2
    from kvtier.rpc.status import status_details

    msg = router_pb2.RouteRequest()
    msg.namespace.model_id, msg.namespace.page_size, msg.namespace.kv_dtype = "m", 16, "fp32"
    msg.token_ids.ids.extend(range(num_tokens))
    raw = msg.SerializeToString()
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                      ("grpc.max_receive_message_length", 64 << 20)])
    route = channel.unary_unary("/kvtier.v1.Router/Route")
    counts: dict[str, int] = {}
    retry_info = [False]
    lock = threading.Lock()
    deadline = time.monotonic() + run_s

    def one_caller() -> None:
        while time.monotonic() < deadline:
            try:
                route(raw, metadata=(("authorization", "Bearer " + token),), timeout=30)
                code = "OK"
            except grpc.RpcError as err:
                code = err.code().name
                status = status_details(err)
                if status is not None and any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details):
                    retry_info[0] = True
            with lock:
                counts[code] = counts.get(code, 0) + 1
                if sum(counts.values()) == 1:
                    print("flooding", flush=True)

    def report(*_: object) -> None:
        with lock:
            print(json.dumps({"counts": counts, "retry_info": retry_info[0]}), flush=True)

    def stop(*_: object) -> None:  # terminated before its time: report what it saw
        report()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    threads = [threading.Thread(target=one_caller, daemon=True) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report()


def flood_command(address: str, token: str, num_threads: int, num_tokens: int, run_s: float) -> list[str]:
    return [sys.executable, "-m", "loadtests.route_flood", "flood", address, token, str(num_threads),
            str(num_tokens), str(run_s)]


def write_table(path: Path) -> Path:
    from kvtier.rpc.auth import hash_token

    path.write_text("tokens:\n" + "".join(
        f"  - name: {name}\n    role: frontend\n    tenants: [{name[-1]}]\n    sha256: {hash_token(token)}\n"
        for name, token in TOKENS.items()))
    return path


def register_worker(controller) -> None:  # type: ignore[no-untyped-def]
    from kvtier.domain.records import BootId, ModelIdentity, Registration, WorkerId

    controller.registry.connect(Registration(
        worker_id=WorkerId("w"), address="127.0.0.1:1", boot_id=BootId("b"), model=ModelIdentity("m"),
        page_size=16, capacities=()), link_id=1)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def small_routes(client, num: int, *, for_s: float = 0.0, gap_s: float = 0.0) -> list[float]:  # type: ignore[no-untyped-def]
    """Latencies of ``num`` 3-token Routes one after another, or as many as fit in ``for_s``
    seconds with ``gap_s`` between them."""
    from kvtier.domain.hashing import NamespaceIdentity

    namespace = NamespaceIdentity(model_id="m", page_size=16)
    out: list[float] = []
    until = time.perf_counter() + for_s
    while len(out) < num or time.perf_counter() < until:
        start = time.perf_counter()
        await client.route(namespace, [1, 2, len(out) % 7], None)
        out.append(time.perf_counter() - start)
        if gap_s:
            await asyncio.sleep(gap_s)
    return out


async def measure(num_flooders: int, num_tokens: int, duration_s: float) -> dict[str, object]:
    from kvtier.client import AsyncClient
    from kvtier.controller.server import serve_controller
    from kvtier.runtime.config import ControllerConfig

    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        config = ControllerConfig(port=0, state_dir=state, auth_token_file=write_table(state / "tokens.yaml"),
                                  lease_ttl_s=600.0, heartbeat_interval_s=1.0)
        controller = await serve_controller(config)
        try:
            register_worker(controller)
            async with AsyncClient(controller.address, token=TOKENS["fe-a"]) as client:
                await small_routes(client, 30)
                idle = await small_routes(client, 0, for_s=duration_s / 2, gap_s=0.01)
                process = subprocess.Popen(flood_command(controller.address, TOKENS["fe-b"], num_flooders, num_tokens,
                                                         run_s=duration_s + 60.0), stdout=subprocess.PIPE, text=True)
                try:
                    assert process.stdout is not None
                    await asyncio.to_thread(process.stdout.readline)
                    loaded = await small_routes(client, 0, for_s=duration_s, gap_s=0.01)
                finally:
                    process.terminate()
                    out, _ = await asyncio.to_thread(process.communicate)
        finally:
            await controller.stop(0)
    lines = out.strip().splitlines()
    report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return {"idle_p99_ms": round(p99(idle) * 1e3, 2), "flood_p99_ms": round(p99(loaded) * 1e3, 2),
            "ratio": round(p99(loaded) / p99(idle), 2), "num_samples": [len(idle), len(loaded)],
            "flood_answers": report.get("counts")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["flood"]:
        address, token, num_threads, num_tokens, run_s = argv[1:6]
        flood(address, token, int(num_threads), int(num_tokens), float(run_s))
        return 0
    parser = argparse.ArgumentParser(prog="python -m loadtests.route_flood", description=__doc__.split("\n")[0])
    parser.add_argument("--flooders", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds of small Routes under the flood "
                        "(half as long idle before)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.flooders, args.tokens, args.duration_s))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"small Route p99: idle {result['idle_p99_ms']} ms, under the flood {result['flood_p99_ms']} ms "
              f"({result['ratio']}x); flood answers {result['flood_answers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
