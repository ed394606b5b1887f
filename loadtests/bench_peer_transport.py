"""Which transport carries page groups between workers: the Ray object store or a gRPC stream.

    python -m loadtests.bench_peer_transport [--json] [--mib 1 8 32] [--repeats 5]

A two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: two raylets, two object
stores). A holder actor on node B keeps a page group (numpy, ``MIB`` MiB) in memory; the
receiver, this driver on node A, pulls it:

* ``ray``: the holder's actor method returns the group (Ray puts it in B's object store); the
  receiver awaits the ``ObjectRef`` (A's object manager pulls it from B in chunks, then reads it
  from A's store without a copy). What ``kvtier.worker.peer_fetch.RayTransport`` does.
* ``grpc``: the holder serves the same bytes on a gRPC stream of 1 MiB messages (raw bytes, no
  protobuf encode); the receiver joins them into one buffer. A worker-to-worker gRPC service
  would do this, plus its own authentication.

Each size runs ``repeats`` times per transport, interleaved; the median is reported, in MB/s
and ms. No GPU here: Ray's direct tensor transport (NCCL/NIXL between GPUs) is not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

CHUNK_BYTES = 1 << 20
OBJECT_STORE_BYTES = 400 << 20


class Holder:
    """On node B: a page group to hand out, by Ray return value or over a gRPC stream."""

    def __init__(self) -> None:
        self.groups: dict[int, np.ndarray] = {}
        self.port = 0

    def make(self, num_bytes: int) -> int:
        self.groups[num_bytes] = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
        return num_bytes

    def export(self, num_bytes: int) -> np.ndarray:
        return self.groups[num_bytes]

    def serve_grpc(self) -> int:
        from concurrent import futures

        import grpc

        def pull(request: bytes, context: Any):
            data = memoryview(self.groups[int(request.decode())])
            for start in range(0, len(data), CHUNK_BYTES):
                yield bytes(data[start:start + CHUNK_BYTES])

        handler = grpc.method_handlers_generic_handler(
            "kvtier.bench.Peer", {"Pull": grpc.unary_stream_rpc_method_handler(pull)})
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=(handler,),
                             options=[("grpc.max_send_message_length", 4 * CHUNK_BYTES)])
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server  # kept: the server serves while referenced
        return self.port


def pull_grpc(port: int, num_bytes: int) -> int:
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}",
                               options=[("grpc.max_receive_message_length", 4 * CHUNK_BYTES)]) as channel:
        call = channel.unary_stream("/kvtier.bench.Peer/Pull")
        buf = bytearray(num_bytes)
        offset = 0
        for chunk in call(str(num_bytes).encode()):
            buf[offset:offset + len(chunk)] = chunk
            offset += len(chunk)
    return offset


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, resources={"node_a": 1}, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False))
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=OBJECT_STORE_BYTES)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    try:
        holder = ray.remote(num_cpus=0, resources={"node_b": 1})(Holder).remote()
        port = ray.get(holder.serve_grpc.remote())
        results = {}
        for mib in args.mib:
            num_bytes = mib << 20
            ray.get(holder.make.remote(num_bytes))
            times: dict[str, list[float]] = {"ray": [], "grpc": []}
            for _ in range(args.repeats):
                started = time.perf_counter()
                group = ray.get(holder.export.remote(num_bytes))
                assert group.nbytes == num_bytes
                times["ray"].append(time.perf_counter() - started)
                del group
                started = time.perf_counter()
                assert pull_grpc(port, num_bytes) == num_bytes
                times["grpc"].append(time.perf_counter() - started)
            results[f"{mib}MiB"] = {
                name: {"ms": round(statistics.median(t) * 1000, 2),
                       "mb_per_s": round(num_bytes / statistics.median(t) / 1e6, 1)}
                for name, t in times.items()
            }
        report = {"results": results, "repeats": args.repeats, "load_1min": os.getloadavg()[0],
                  "cpus": os.cpu_count()}
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for size, row in report["results"].items():
            print(f"{size:>7}: ray {row['ray']['ms']:8.2f} ms {row['ray']['mb_per_s']:8.1f} MB/s   "
                  f"grpc {row['grpc']['ms']:8.2f} ms {row['grpc']['mb_per_s']:8.1f} MB/s")
    return report


if __name__ == "__main__":
    main()
