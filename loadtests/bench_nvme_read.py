"""Where an NVMe page read's time goes, and disk-lane thread counts against each other.

    python -m loadtests.bench_nvme_read [--mib N] [--rounds N] [--threads 2,4] [--busy] [--json]

Per geometry (``bench_tiers.GEOMETRIES``) the same stored pages are read back, in one process,
by every side below, in rounds whose order alternates (forward, then reversed):

* ``engine<T>``: ``TransferEngine`` NVMe -> DRAM with ``T`` disk threads, 16 MiB transfers, as
  ``bench_tiers`` reads (verified: header records and payload checksums).
* ``raw_slots``: bare ``preadv`` of the same runs with the reader's iovecs (each group's header
  block, then its payloads), on two threads, nothing checked: the disk with kvtier's layout.
* ``raw_contiguous``: the same file range in one iovec per run (what a layout with no header
  blocks between payloads would ask of the device), on two threads, nothing checked.
* ``dd``: ``dd iflag=direct`` of a file of the same size at ``bs=1M`` and ``bs=16M`` (its own
  reported rate, the faster of the two), the ``bench_tiers`` baseline.

Each side reports GB/s and its ratio to the round's ``dd`` (median and range over rounds), CPU
seconds per GB (this process and its children, so ``dd`` pays its own process start), and for
the engine the thread-seconds spent inside ``preadv`` and in payload checksums.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.domain.tiers import Tier
from kvtier.tiers.checksum import page_checksums
from kvtier.tiers.dram import aligned_host_tensor, make_dram_pool
from kvtier.tiers.nvme import io as nvme_io
from kvtier.tiers.nvme import reader as nvme_reader
from kvtier.tiers.nvme.format import HEADER_BYTES
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.transfer import TransferReason
from kvtier.tiers.transfer_engine import TransferEngine
from loadtests.bench_tiers import GEOMETRIES, NS, _dd, _fill, _timed_transfers, pick_directory
from loadtests.busy import add_busy_flag, busy_core


class StepClock:
    """Thread-seconds inside ``preadv`` and payload checksums while installed (wraps the
    reader's module functions; the wrappers add two clock reads per call)."""

    def __init__(self) -> None:
        self.preadv_s = self.checksum_s = 0.0
        self._lock = threading.Lock()
        self._orig = (nvme_io.preadv_all, nvme_reader._payload_checksums)

    def install(self) -> None:
        preadv, sums = self._orig
        nvme_io.preadv_all = self._timed(preadv, "preadv_s")  # type: ignore[assignment]
        nvme_reader._payload_checksums = self._timed(sums, "checksum_s")  # type: ignore[assignment]

    def _timed(self, fn: Callable, name: str) -> Callable:
        def timed(*args):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._add(name, time.perf_counter() - t0)

        return timed

    def uninstall(self) -> None:
        nvme_io.preadv_all, nvme_reader._payload_checksums = self._orig  # type: ignore[assignment]

    def _add(self, name: str, dt: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + dt)


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class ReadSides:
    """One geometry's stored pages and every way of reading them back."""

    def __init__(self, directory: Path, geometry: PoolGeometry, total_bytes: int, threads: list[int]) -> None:
        self.n = n = max(1, total_bytes // geometry.page_bytes)
        self.per = max(1, (16 << 20) // geometry.page_bytes)
        self.page_bytes = geometry.page_bytes
        self.pool_dir = directory / f"nvme-read-{geometry.num_layers}x{geometry.kv_heads}x{geometry.head_dim}"
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        self.dram = make_dram_pool(n, geometry)
        _fill(self.dram, 1)
        while self.dram.allocate() is not None:
            pass
        self.dram.set_checksums(range(n), page_checksums(self.dram.tensor).numpy())  # as if just left HBM
        self.nvme = NvmePool(self.pool_dir, n, geometry)
        self.engines = {t: TransferEngine(PagePool(1, geometry), self.dram, self.nvme, num_disk_threads=t) for t in threads}
        slots = self.nvme.allocate_many(n)
        assert slots is not None and slots == list(range(slots[0], slots[0] + n)), "expected consecutive slots"
        self.slots = slots
        first = next(iter(self.engines.values()))
        for g0 in range(0, n, self.per):
            pairs = [(i, slots[i]) for i in range(g0, min(n, g0 + self.per))]
            first.submit(Tier.DRAM, Tier.NVME, pairs, TransferReason.WATERMARK,
                         keys=[i.to_bytes(16, "little") for i, _ in pairs], namespaces=[NS] * len(pairs))
        first.wait_idle(timeout_s=120)
        first.poll_completed()
        self.blocks = memoryview(aligned_host_tensor(HEADER_BYTES * max(1, self.per)).numpy())
        self.dst = memoryview(self.dram.tensor.reshape(-1).view(torch.uint8).numpy())
        self.dd_path = directory / "dd-nvme-read.bin"
        _dd(["if=/dev/zero", f"of={self.dd_path}", "bs=1M", f"count={max(1, total_bytes >> 20)}", "oflag=direct"])

    def engine_read(self, threads: int) -> float:
        engine, slots = self.engines[threads], self.slots

        def submit() -> None:
            for g0 in range(0, self.n, self.per):
                pairs = [(slots[i], i) for i in range(g0, min(self.n, g0 + self.per))]
                engine.submit(Tier.NVME, Tier.DRAM, pairs, TransferReason.PREFETCH)

        return _timed_transfers(engine, submit)

    def raw_read(self, with_headers: bool) -> float:
        files, pb = self.nvme.files, self.page_bytes

        def run(g0: int) -> None:
            k = min(self.per, self.n - g0)
            first = self.slots[g0]
            span = files.span(first, k)
            if with_headers:
                iov: list[memoryview] = []
                for j in range(k):
                    if (first + j) % files.slots_per_group == 0:
                        iov.append(self.blocks[j * HEADER_BYTES : (j + 1) * HEADER_BYTES])
                    iov.append(self.dst[(g0 + j) * pb : (g0 + j + 1) * pb])
                offset = files.header_offset(span.first)
            else:
                iov = [self.dst[g0 * pb : (g0 + k) * pb]]
                offset = files.payload_offset(span.first)
            nvme_io.preadv_all(span.fd, iov, offset)

        start = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(run, range(0, self.n, self.per)))
        return time.perf_counter() - start

    def dd_read(self) -> float:
        """Seconds ``dd`` reports for the whole file at its faster block size."""
        rate = max(_dd([f"if={self.dd_path}", "of=/dev/null", f"bs={bs}", "iflag=direct"]) for bs in ("1M", "16M"))
        return self.n * self.page_bytes / rate

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.nvme.close()
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        self.dd_path.unlink(missing_ok=True)


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(sides: ReadSides, threads: list[int], rounds: int) -> dict:
    clock = StepClock()
    plan: dict[str, Callable[[], float]] = {f"engine{t}": (lambda t=t: sides.engine_read(t)) for t in threads}
    plan |= {"raw_slots": lambda: sides.raw_read(True), "raw_contiguous": lambda: sides.raw_read(False),
             "dd": sides.dd_read}
    num_bytes = sides.n * sides.page_bytes
    rows: dict[str, list[dict]] = {name: [] for name in plan}
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        for name in list(plan) if r % 2 == 0 else list(reversed(plan)):
            clock.preadv_s = clock.checksum_s = 0.0
            if name.startswith("engine"):
                clock.install()
            cpu0 = _cpu_s()
            try:
                seconds = plan[name]()
            finally:
                clock.uninstall()
            rows[name].append({"GBps": num_bytes / seconds / 1e9, "cpu_s_per_GB": (_cpu_s() - cpu0) / (num_bytes / 1e9),
                               "preadv_thread_s": clock.preadv_s, "checksum_thread_s": clock.checksum_s})
    result: dict = {"load_avg_1m": _summary(loads), "bytes": num_bytes, "rounds": rounds, "sides": {}}
    for name, rs in rows.items():
        result["sides"][name] = {
            "GBps": _summary([x["GBps"] for x in rs]),
            "vs_dd": _summary([x["GBps"] / d["GBps"] for x, d in zip(rs, rows["dd"], strict=True)]),
            **{k: statistics.median(x[k] for x in rs) for k in ("cpu_s_per_GB", "preadv_thread_s", "checksum_thread_s")},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes read per measurement, in MiB")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of every side, order alternating")
    parser.add_argument("--threads", default="2,4", help="disk-lane thread counts to compare, comma separated")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_busy_flag(parser)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    directory, direct = pick_directory(None)
    if not direct:
        raise SystemExit(f"{directory} refuses O_DIRECT: the read baseline would come from the page cache")
    out: dict = {"busy": args.busy, "geometries": {}}
    with busy_core(args.busy):
        for name, geometry in GEOMETRIES.items():
            sides = ReadSides(directory, geometry, args.mib << 20, threads)
            try:
                out["geometries"][name] = measure(sides, threads, args.rounds)
            finally:
                sides.close()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for name, g in out["geometries"].items():
        load = g["load_avg_1m"]
        print(f"{name}: {g['bytes'] >> 20} MiB, {g['rounds']} rounds, busy={args.busy}, load {load['min']:.1f}-{load['max']:.1f}")
        for side, s in g["sides"].items():
            print(f"  {side:15s} {s['GBps']['median']:5.2f} GB/s ({s['GBps']['min']:.2f}-{s['GBps']['max']:.2f})"
                  f"  /dd {s['vs_dd']['median']:.2f} ({s['vs_dd']['min']:.2f}-{s['vs_dd']['max']:.2f})"
                  f"  cpu {s['cpu_s_per_GB']:.3f} s/GB  preadv {s['preadv_thread_s']:.3f} s  checksum {s['checksum_thread_s']:.3f} s")


if __name__ == "__main__":
    main()
