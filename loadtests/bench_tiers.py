"""Tier moves against what the hardware gives: kvtier's page transfers vs `dd` and memcpy.

    python -m loadtests.bench_tiers [--json] [--dir PATH] [--mib N] [--repeats N] [--busy]
                                    [--lmcache-python PATH | --no-lmcache]

Baselines, measured in the same run on the same directory:

* ``dd`` with O_DIRECT (``oflag=direct`` / ``iflag=direct``), sequential, at ``bs=1M`` and
  at ``bs=16M`` (kvtier's largest I/O); the faster of the two is the baseline, so a ratio
  never flatters kvtier. Where the directory refuses O_DIRECT (tmpfs, some overlays), dd
  writes with ``conv=fdatasync`` and the read comes from the page cache, which cannot
  be dropped without root: the read baseline is then marked ``cached``.
* memcpy: ``dst.copy_(src)`` of one large host tensor, with one thread and with torch's
  default; the faster is the baseline. ``dram_copy_vs_memcpy_1thread`` also reports the
  ratio to the one-thread memcpy (the copy lane's budget until it took a second copy
  thread, ``copy_threads`` in the output; kept so runs compare across that change).

kvtier numbers go through ``TransferEngine`` (worker threads, slot runs, checksums; the
fused C++ copy + checksum kernel when it builds): DRAM -> NVMe and NVMe -> DRAM (verified)
for page groups, HBM -> DRAM (checksummed) and DRAM -> HBM (verified) on the CPU. The
copy pairs are one list of ``(src, dst)`` tuples per direction, as a caller passes them
(turning the list into the engine's array is timed too). The headline copy ratio uses
consecutive pages; ``dram_demote_scattered_vs_memcpy`` (reported, not in the headline)
demotes the same pages to a shuffled set of DRAM pages, where every pair is its own run.
Throughput counts page bytes only (slot headers and padding are overhead the ratio pays
for). Every measurement runs once per iteration, back to back with its baseline, and
each ratio is the median of its per-iteration ratios. Two geometries: the tiny test
model (32 KiB pages) and Llama-3.1-8B (bf16, 2 MiB pages). The 1-minute load average is
recorded with every iteration: on a shared machine it explains most of the spread.

Peer: LMCache's ``StorageManager`` (``loadtests/lmcache_peer.py``, in a child process under the
Python of ``.venv-lmcache/``, built by ``make lmcache-venv``) stores and reads the same pages
in every iteration, right after kvtier's, and the ``lmcache`` key holds kvtier / LMCache per
path (memory write and read, disk write and read) with medians and ranges; without LMCache
the report says it skipped the peer in one line.

``decode_slowdown_during_demotion``: the engine's decode step (built-in tiny model, 8
sequences) while 256 MiB of cached pages demote HBM -> DRAM through the engine's own tier
manager, over the same step with no transfer running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.cache.page_pool import PagePool, PoolGeometry
from kvtier.domain.hashing import next_key, root_key
from kvtier.domain.tiers import Tier
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.model.loader import write_random_checkpoint
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import page_checksums
from kvtier.tiers.dram import DramPool, aligned_host_tensor, make_dram_pool
from kvtier.tiers.manager import TierConfig, Watermark
from kvtier.tiers.nvme.pool import NvmePool
from kvtier.tiers.transfer import TransferReason
from kvtier.tiers.transfer_engine import TransferEngine
from loadtests import lmcache_peer
from loadtests.busy import add_busy_flag, busy_core

GEOMETRIES = {
    "tiny": PoolGeometry(num_layers=4, kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32),
    "llama-3.1-8b": PoolGeometry(num_layers=32, kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16),
}
REPO = Path(__file__).resolve().parents[1]
NS = b"bench-namespace!"
_DD_RATE = re.compile(r"(\d+) bytes .* copied, ([\d.]+) s")


def direct_io_supported(directory: Path) -> bool:
    directory.mkdir(parents=True, exist_ok=True)
    fd_path = tempfile.mktemp(dir=directory, prefix=".odirect-probe-")
    try:
        fd = os.open(fd_path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = aligned_host_tensor(4096)
        buf.zero_()
        os.pwritev(fd, [memoryview(buf.numpy())], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(fd_path)


def pick_directory(explicit: str | None) -> tuple[Path, bool]:
    """The benchmark directory and whether it takes O_DIRECT. Default: the first of the
    repository's ``.state/`` and ``/tmp`` that does (tmpfs /tmp would not)."""
    if explicit:
        path = Path(explicit)
        return path, direct_io_supported(path)
    candidates = [REPO / ".state" / "bench-tiers", Path(tempfile.gettempdir()) / "kvtier-bench-tiers"]
    for path in candidates:
        if direct_io_supported(path):
            return path, True
    return candidates[0], False


def _dd(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    match = _DD_RATE.search(out.stderr)
    if not match:
        raise RuntimeError(f"cannot parse dd output: {out.stderr.strip()}")
    return int(match.group(1)) / float(match.group(2))


def dd_once(directory: Path, total_mib: int, direct: bool) -> dict:
    """One sequential write and read of ``total_mib`` at bs=1M and bs=16M; the faster of
    the two block sizes is the baseline."""
    path = directory / "dd-baseline.bin"
    result: dict = {}
    try:
        for bs_mib in (1, 16):
            count = max(1, total_mib // bs_mib)
            w_flags = ["oflag=direct"] if direct else ["conv=fdatasync"]
            r_flags = ["iflag=direct"] if direct else []
            result[f"write_{bs_mib}M_Bps"] = _dd(
                ["if=/dev/zero", f"of={path}", f"bs={bs_mib}M", f"count={count}", *w_flags]
            )
            result[f"read_{bs_mib}M_Bps"] = _dd([f"if={path}", "of=/dev/null", f"bs={bs_mib}M", *r_flags])
    finally:
        path.unlink(missing_ok=True)
    result["write_Bps"] = max(result["write_1M_Bps"], result["write_16M_Bps"])
    result["read_Bps"] = max(result["read_1M_Bps"], result["read_16M_Bps"])
    return result


class Memcpy:
    """``dst.copy_(src)`` of one large host tensor, with torch's default intra-op threads and
    with one (what a transfer lane uses); the faster is the baseline, never flattering kvtier."""

    def __init__(self, num_bytes: int) -> None:
        self.src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # fault the pages in before timing

    def once(self) -> dict:
        default_threads = torch.get_num_threads()
        result: dict = {}
        try:
            for threads in sorted({default_threads, 1}):
                torch.set_num_threads(threads)
                start = time.perf_counter()
                self.dst.copy_(self.src)
                result[f"{threads}_threads_Bps"] = self.src.numel() / (time.perf_counter() - start)
        finally:
            torch.set_num_threads(default_threads)
        result["Bps"] = max(result.values())
        return result


def _fill(pool: PagePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=g).to(pool.tensor.dtype))


def _claim_all(pool: PagePool) -> None:
    while pool.allocate() is not None:
        pass


def _timed_transfers(engine: TransferEngine, submit: Callable[[], None]) -> float:
    start = time.perf_counter()
    submit()
    if not engine.wait_idle(timeout_s=120):
        raise RuntimeError("transfers did not finish within 120 s")
    elapsed = time.perf_counter() - start
    done = engine.poll_completed()
    bad = [d for d in done if not d.is_ok]
    if bad:
        raise RuntimeError(f"{len(bad)} benchmark transfers failed: {bad[0].status} {bad[0].error}")
    return elapsed


class NvmeBench:
    """DRAM -> NVMe and NVMe -> DRAM through the engine, in transfers of ~16 MiB page groups."""

    def __init__(self, directory: Path, geometry: PoolGeometry, total_bytes: int) -> None:
        self.geometry = g = geometry
        self.n = n = max(1, total_bytes // g.page_bytes)
        self.group = max(1, (16 << 20) // g.page_bytes)
        self.pool_dir = directory / f"nvme-{g.num_layers}x{g.kv_heads}x{g.head_dim}"
        shutil.rmtree(self.pool_dir, ignore_errors=True)
        self.dram = make_dram_pool(n, g)
        _fill(self.dram, 1)
        _claim_all(self.dram)
        self.sums = page_checksums(self.dram.tensor).numpy()
        self.nvme = NvmePool(self.pool_dir, n, g)
        self.engine = TransferEngine(PagePool(1, g), self.dram, self.nvme)
        self.keys = [i.to_bytes(16, "little") for i in range(n)]
        self.once()  # the first round also converts the preallocated extents to written ones

    def once(self) -> dict:
        n, group, engine = self.n, self.group, self.engine
        self.dram.set_checksums(range(n), self.sums)  # as if the pages had just left HBM
        slots = self.nvme.allocate_many(n)
        assert slots is not None

        def write() -> None:
            for g0 in range(0, n, group):
                pairs = [(i, slots[i]) for i in range(g0, min(n, g0 + group))]
                engine.submit(
                    Tier.DRAM,
                    Tier.NVME,
                    pairs,
                    TransferReason.WATERMARK,
                    keys=[self.keys[i] for i, _ in pairs],
                    namespaces=[NS] * len(pairs),
                )

        def read() -> None:
            for g0 in range(0, n, group):
                pairs = [(slots[i], i) for i in range(g0, min(n, g0 + group))]
                engine.submit(Tier.NVME, Tier.DRAM, pairs, TransferReason.PREFETCH)

        page_bytes = n * self.geometry.page_bytes
        result = {
            "write_Bps": page_bytes / _timed_transfers(engine, write),
            "read_Bps": page_bytes / _timed_transfers(engine, read),
        }
        # Freed, not flushed: the next round's allocation takes the releasing slots back
        # with no header rewrite, as a full tier does. Flushing 8192 of them here (one
        # synchronous 4 KiB write each) kept the virtual disk busy into the next
        # measurement.
        for s in slots:
            self.nvme.free(s)
        return result

    def close(self) -> None:
        self.engine.close()
        self.nvme.close()
        shutil.rmtree(self.pool_dir, ignore_errors=True)


@dataclass
class PoolPair:
    hbm: PagePool
    dram: DramPool
    engine: TransferEngine


def make_pool_pair(geometry: PoolGeometry, total_bytes: int) -> PoolPair:
    n = max(1, total_bytes // geometry.page_bytes)
    hbm, dram = PagePool(n, geometry), make_dram_pool(n, geometry)
    _fill(hbm, 2)
    _claim_all(hbm)
    _claim_all(dram)
    return PoolPair(hbm, dram, TransferEngine(hbm, dram))


class CopyBench:
    """HBM -> DRAM (checksummed) and DRAM -> HBM (verified) through the engine's copy lane."""

    def __init__(self, geometry: PoolGeometry, total_bytes: int) -> None:
        self.pair = make_pool_pair(geometry, total_bytes)
        n = self.pair.hbm.num_pages
        self.pairs = [(i, i) for i in range(n)]
        shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        self.scattered = list(zip(range(n), shuffled, strict=True))
        self.once()  # the first round faults the DRAM pages in

    def once(self) -> dict:
        engine, pairs = self.pair.engine, self.pairs
        num_bytes = len(pairs) * self.pair.hbm.geometry.page_bytes
        demote = _timed_transfers(
            engine, lambda: engine.submit(Tier.HBM, Tier.DRAM, pairs, TransferReason.WATERMARK)
        )
        promote = _timed_transfers(
            engine, lambda: engine.submit(Tier.DRAM, Tier.HBM, pairs, TransferReason.PROMOTION_ON_HIT)
        )
        scattered = _timed_transfers(
            engine, lambda: engine.submit(Tier.HBM, Tier.DRAM, self.scattered, TransferReason.WATERMARK)
        )
        return {
            "demote_Bps": num_bytes / demote,
            "promote_Bps": num_bytes / promote,
            "demote_scattered_Bps": num_bytes / scattered,
        }

    def close(self) -> None:
        self.pair.engine.close()


def decode_slowdown_during_demotion(n_bytes: int = 256 << 20, steps: int = 10, batch: int = 8) -> dict:
    """Median engine decode step time while ``n_bytes`` of cached HBM pages demote to DRAM
    in the background (the engine's own tier manager and transfer engine) over the median
    step time with no transfer running. The engine benchmark's model, ``batch`` sequences
    decoding (a tiny model's step is all Python overhead and would measure the GIL)."""
    from loadtests.bench_engine import BENCH_CONFIG

    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "bench-model", BENCH_CONFIG, seed=0)
        geometry_probe = Engine.from_pretrained(path, page_size=16, num_pages=1)
        page_bytes = geometry_probe.geometry.page_bytes
        num_cached = max(1, n_bytes // page_bytes)
        num_pages = num_cached + 256
        engine = Engine.from_pretrained(
            path, page_size=16, num_pages=num_pages,
            tier_config=TierConfig(dram_pages=num_cached, hbm_watermark=Watermark(1.0, 1.0)),
        )
    # Cached pages to demote: chains of 64 pages with random bytes, idle (as a busy
    # cache would leave them after its requests finished).
    index, pool = engine.index, engine.pool
    gen = torch.Generator().manual_seed(0)
    digest = engine.digest_for(None)
    held = []
    for chain in range(0, num_cached, 64):
        parent = None
        for depth in range(min(64, num_cached - chain)):
            page = pool.allocate()
            pool.tensor[page].normal_(generator=gen)
            key = next_key(parent or root_key(digest), [chain, depth] + [0] * 14)
            index.insert(key, parent, page, [chain, depth] + [0] * 14, digest)
            held.append(page)
            parent = key
    for page in held:
        pool.release(page)
    vocab = BENCH_CONFIG["vocab_size"]
    for _ in range(batch):
        prompt = torch.randint(0, vocab, (128,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=100_000, ignore_eos=True))
    engine.step()  # prefill
    for _ in range(3):
        engine.step()
    idle = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        idle.append(time.perf_counter() - start)
    t0 = time.perf_counter()
    engine.tiers.demote(Tier.HBM, Tier.DRAM, num_cached, TransferReason.WATERMARK)
    busy: list[float] = []
    while engine.tiers.transfers.num_pending and len(busy) < 10 * steps:
        start = time.perf_counter()
        engine.step()
        busy.append(time.perf_counter() - start)
    engine.tiers.wait_idle()
    demote_s = time.perf_counter() - t0
    moved = engine.tiers.counters.bytes_moved.get((Tier.HBM, Tier.DRAM), 0)
    engine.close()
    return {
        "ratio": statistics.median(busy) / statistics.median(idle) if busy else None,
        "idle_step_ms": statistics.median(idle) * 1e3,
        "busy_step_ms": statistics.median(busy) * 1e3 if busy else None,
        "steps_during_demotion": len(busy),
        "demoted_bytes": moved,
        "demote_s": demote_s,
    }


def start_peer(python: str, directory: Path, total: int, repeats: int) -> tuple[lmcache_peer.PeerProcess, dict]:
    """The LMCache child with this run's pages, after one warm-up round per geometry (as
    kvtier's benches take one in their constructors)."""
    peer = lmcache_peer.PeerProcess(python)
    try:
        info = peer.call("setup", directory=str(directory / "lmcache"), rounds=repeats, threads=None, geometries={
            name: {
                "shape": [2, g.num_layers, g.page_size, g.kv_heads * g.head_dim],
                "dtype": str(g.dtype).removeprefix("torch."),
                "num_pages": max(1, total // g.page_bytes),
            }
            for name, g in GEOMETRIES.items()
        })
        for name in GEOMETRIES:
            peer.call("round", geometry=name)
    except BaseException:
        peer.close()
        raise
    return peer, info


def run(directory: Path, direct: bool, total_mib: int, repeats: int, peer_python: str | None = None) -> dict:
    """Every measurement once per iteration, back to back, so noise from other processes
    on a shared machine lands on baseline and kvtier alike; each ratio is the median of
    its per-iteration ratios."""
    total = total_mib << 20
    started = time.perf_counter()
    memcpy = Memcpy(total)
    benches = {name: (NvmeBench(directory, g, total), CopyBench(g, total)) for name, g in GEOMETRIES.items()}
    copy_threads = next(iter(benches.values()))[1].pair.engine.copy_threads
    iterations: list[dict] = []
    peer, peer_info = start_peer(peer_python, directory, total, repeats) if peer_python else (None, {})
    peer_rounds: dict[str, list[dict]] = {name: [] for name in GEOMETRIES}
    try:
        for _ in range(repeats):
            it: dict = {
                "load_avg_1m": os.getloadavg()[0],
                "dd": dd_once(directory, total_mib, direct),
                "memcpy": memcpy.once(),
                "geometries": {},
            }
            for name, (nvme, copy) in benches.items():
                n, c = nvme.once(), copy.once()
                it["geometries"][name] = {
                    **n,
                    **c,
                    "nvme_write_vs_direct": n["write_Bps"] / it["dd"]["write_Bps"],
                    "nvme_read_vs_direct": n["read_Bps"] / it["dd"]["read_Bps"],
                    "dram_demote_vs_memcpy": c["demote_Bps"] / it["memcpy"]["Bps"],
                    "dram_promote_vs_memcpy": c["promote_Bps"] / it["memcpy"]["Bps"],
                    "dram_demote_scattered_vs_memcpy": c["demote_scattered_Bps"] / it["memcpy"]["Bps"],
                    "dram_copy_vs_memcpy_1thread": min(c["demote_Bps"], c["promote_Bps"])
                    / it["memcpy"]["1_threads_Bps"],
                }
                if peer is not None:
                    num_bytes = nvme.n * nvme.geometry.page_bytes
                    peer_rounds[name].append(
                        lmcache_peer.round_ratios({**n, **c}, peer.call("round", geometry=name), num_bytes)
                    )
                    it["geometries"][name]["lmcache"] = peer_rounds[name][-1]
            iterations.append(it)
    finally:
        for nvme, copy in benches.values():
            nvme.close()
            copy.close()
        if peer is not None:
            peer.close()
    slowdown = decode_slowdown_during_demotion(256 << 20)
    ratio_names = (
        "nvme_write_vs_direct",
        "nvme_read_vs_direct",
        "dram_demote_vs_memcpy",
        "dram_promote_vs_memcpy",
        "dram_copy_vs_memcpy_1thread",
        "dram_demote_scattered_vs_memcpy",
    )
    per_geometry = {
        name: {
            "page_bytes": g.page_bytes,
            **{r: statistics.median(it["geometries"][name][r] for it in iterations) for r in ratio_names},
            # Lowest and highest per-iteration value of each ratio: the spread the median hides.
            "ranges": {
                r: [min(it["geometries"][name][r] for it in iterations), max(it["geometries"][name][r] for it in iterations)]
                for r in ratio_names
            },
        }
        for name, g in GEOMETRIES.items()
    }
    per = per_geometry.values()
    return {
        # Headline ratios: the worse geometry (and direction), so nothing is flattered.
        "nvme_write_vs_direct": min(p["nvme_write_vs_direct"] for p in per),
        "nvme_read_vs_direct": min(p["nvme_read_vs_direct"] for p in per),
        "dram_copy_vs_memcpy": min(min(p["dram_demote_vs_memcpy"], p["dram_promote_vs_memcpy"]) for p in per),
        "dram_copy_vs_memcpy_1thread": min(p["dram_copy_vs_memcpy_1thread"] for p in per),
        "decode_slowdown_during_demotion": slowdown["ratio"],
        "decode_during_demotion": slowdown,
        "geometries": per_geometry,
        "dir": str(directory),
        "o_direct": direct,
        "dd_read_cached": not direct,
        "copy_kernel": "fused C++" if page_copy.kernel_enabled() else "torch (copy, then checksum)",
        "copy_threads": copy_threads,
        "lmcache": {"info": peer_info, **lmcache_peer.summarize(peer_rounds)} if peer is not None
        else {"skipped": "LMCache peer not run"},
        "load_avg_1m": [it["load_avg_1m"] for it in iterations] + [os.getloadavg()[0]],
        "iterations": iterations,
        "elapsed_s": time.perf_counter() - started,
    }


def _gbps(bps: float) -> str:
    return f"{bps / 1e9:6.2f} GB/s"


def print_report(r: dict) -> None:
    ratio = r["decode_slowdown_during_demotion"]
    slowdown = "n/a (no step ran during the demotion)" if ratio is None else f"{ratio:.2f}"
    print(
        f"directory {r['dir']}  O_DIRECT {'yes' if r['o_direct'] else 'NO (buffered dd, cached read)'}"
        f"  copy kernel {r['copy_kernel']} ({r['copy_threads']} threads)"
    )
    for i, it in enumerate(r["iterations"]):
        dd, mc = it["dd"], it["memcpy"]
        print(
            f"iteration {i} (load {it['load_avg_1m']:.2f}): "
            f"dd write {_gbps(dd['write_1M_Bps'])} (1M) {_gbps(dd['write_16M_Bps'])} (16M)"
            f"  read {_gbps(dd['read_1M_Bps'])} (1M) {_gbps(dd['read_16M_Bps'])} (16M)"
            f"  memcpy {_gbps(mc['Bps'])} (1 thread {_gbps(mc['1_threads_Bps'])})"
        )
        for name, p in it["geometries"].items():
            print(
                f"  {name:13s} DRAM->NVMe {_gbps(p['write_Bps'])} x{p['nvme_write_vs_direct']:.2f}"
                f"  NVMe->DRAM {_gbps(p['read_Bps'])} x{p['nvme_read_vs_direct']:.2f}"
                f"  HBM->DRAM {_gbps(p['demote_Bps'])} x{p['dram_demote_vs_memcpy']:.2f}"
                f"  DRAM->HBM {_gbps(p['promote_Bps'])} x{p['dram_promote_vs_memcpy']:.2f}"
                f"  HBM->DRAM scattered {_gbps(p['demote_scattered_Bps'])} x{p['dram_demote_scattered_vs_memcpy']:.2f}"
            )
    for name, p in r["geometries"].items():
        print(
            f"median [range] of {len(r['iterations'])} iterations, {name} ({p['page_bytes'] // 1024} KiB pages): "
            + "  ".join(
                f"{k} {v:.2f} [{p['ranges'][k][0]:.2f}-{p['ranges'][k][1]:.2f}]"
                for k, v in p.items()
                if k not in ("page_bytes", "ranges")
            )
        )
    print(
        f"nvme_write_vs_direct {r['nvme_write_vs_direct']:.2f}  "
        f"nvme_read_vs_direct {r['nvme_read_vs_direct']:.2f}"
        f"  dram_copy_vs_memcpy {r['dram_copy_vs_memcpy']:.2f}"
        f" (1 thread {r['dram_copy_vs_memcpy_1thread']:.2f})"
        f"  decode_slowdown_during_demotion {slowdown}  ({r['elapsed_s']:.0f} s)"
    )
    for line in lmcache_peer.report_lines(r["lmcache"]):
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--dir", help="directory for the files (default: .state/ or /tmp, whichever takes O_DIRECT)"
    )
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per measurement, in MiB")
    parser.add_argument("--repeats", type=int, default=3, help="iterations; ratios are per-iteration medians")
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument(
        "--lmcache-python",
        help="Python that imports lmcache, for the LMCache peer (default: .venv-lmcache/bin/python, "
        "else this one if it imports lmcache)",
    )
    peer.add_argument("--no-lmcache", action="store_true", help="leave the LMCache peer out")
    add_busy_flag(parser)
    args = parser.parse_args(argv)
    peer_python, peer_line = (None, "LMCache peer left out (--no-lmcache)") if args.no_lmcache else (
        lmcache_peer.find_python(args.lmcache_python)
    )
    if args.lmcache_python and peer_python is None:
        parser.error(peer_line)
    print(peer_line, file=sys.stderr, flush=True)
    directory, direct = pick_directory(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    with busy_core(args.busy):
        result = run(directory, direct, args.mib, args.repeats, peer_python)
    if peer_python is None:
        result["lmcache"] = {"skipped": peer_line}
    result["busy"] = args.busy
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print_report(result)


if __name__ == "__main__":
    main()
