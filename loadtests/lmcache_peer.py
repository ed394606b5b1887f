"""LMCache 0.5.6 as a peer of ``bench_tiers``: the same pages through LMCache's storage manager.

LMCache pins torch and other packages that the project's environment does not take, so it lives
in a virtual environment of its own (``make lmcache-venv`` builds ``.venv-lmcache/``). This
module has two halves:

* ``PeerProcess`` (the benchmark's side, stdlib only): finds a Python that imports ``lmcache``,
  starts this file under it with ``--serve`` and exchanges one JSON line per request over the
  child's stdin and stdout, so ``bench_tiers`` alternates kvtier and LMCache round by round.
* ``serve()`` (the child's side): one ``StorageManager`` with ``LocalCPUBackend`` and
  ``LocalDiskBackend`` (O_DIRECT on, ``use_odirect``), which runs on a CPU-only machine.

Each round of one geometry (``n`` pages of the kvtier page's bytes, shaped as LMCache's
``KV_2LTD`` chunk ``[2, layers, tokens, heads * head_dim]``), every path timed by wall clock
over the same bytes as kvtier's:

* memory write: allocate ``n`` memory objects, copy the source pages in, ``batched_put`` to
  ``LocalCPUBackend`` (what LMCache's store does after its GPU connector's copy);
* memory read: ``batched_get`` from ``LocalCPUBackend``, copy every object into the
  destination pages;
* disk write: ``batched_put`` of ``n`` filled memory objects to ``LocalDiskBackend``, until
  every key is on disk (the backend writes from its own threads);
* disk read: ``batched_get`` from ``LocalDiskBackend`` (its read thread pool, O_DIRECT, so the
  page cache plays no part; the files were written with O_DIRECT too), including LMCache's
  write-back of the read objects into ``LocalCPUBackend``.

Every put must land and every get must return the source's bytes, checked after the timed
part of each round; a refused put or a short read raises instead of counting as fast.
``LocalDiskBackend.remove()`` in 0.5.6 never returns a file's bytes to the size it admits
against (``current_cache_size``), so a backend that removes old keys refuses later puts
without an error. Each round uses fresh keys and removes them when it ends, and the disk
backend is sized for every byte the whole run stores; the round checks that size before
its put, naming the bug when it would not fit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"
PATHS = ("mem_write", "mem_read", "disk_write", "disk_read")
# Seconds one request may take before the peer is declared stuck.
REPLY_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- benchmark side (stdlib only)


def find_python(explicit: str | None) -> tuple[str | None, str]:
    """The interpreter that runs the peer and a line saying which, or ``None`` and why not.

    ``explicit`` (``--lmcache-python``) wins; else ``.venv-lmcache/bin/python`` in the
    repository; else this interpreter when it imports ``lmcache`` itself."""
    if explicit:
        if not Path(explicit).exists():
            return None, f"--lmcache-python {explicit}: no such file"
        return explicit, f"LMCache peer: {explicit}"
    if DEFAULT_VENV_PYTHON.exists():
        return str(DEFAULT_VENV_PYTHON), f"LMCache peer: {DEFAULT_VENV_PYTHON}"
    if importlib.util.find_spec("lmcache") is not None:
        return sys.executable, f"LMCache peer: {sys.executable} (imports lmcache)"
    return None, (
        "LMCache peer skipped: no .venv-lmcache/ (make lmcache-venv) and lmcache does not import here; "
        "pass --lmcache-python PATH to use another environment"
    )


class PeerError(RuntimeError):
    """The peer process failed a request; the message carries its error."""


class PeerProcess:
    """The LMCache child process: one JSON request per line in, one JSON reply per line out."""

    def __init__(self, python: str) -> None:
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={"LMCACHE_LOG_LEVEL": "WARNING", **os.environ},
        )

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=REPLY_TIMEOUT_S)
            raise PeerError(f"LMCache peer exited ({code}) during {op!r}; its stderr is above")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise PeerError(f"LMCache peer, {op!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("close")
            except (PeerError, OSError, ValueError):
                pass
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# kvtier's measurement for each LMCache path, as ``bench_tiers`` names them: NvmeBench's
# write and read, CopyBench's demote (HBM -> DRAM) and promote (DRAM -> HBM).
KVTIER_SIDE = {"mem_write": "demote_Bps", "mem_read": "promote_Bps", "disk_write": "write_Bps", "disk_read": "read_Bps"}


def round_ratios(kvtier: dict[str, float], peer: dict[str, float], num_bytes: int) -> dict[str, float]:
    """One round's LMCache throughput per path and kvtier's over it (above 1: kvtier faster)."""
    out: dict[str, float] = {}
    for path, key in KVTIER_SIDE.items():
        out[f"lmcache_{path}_Bps"] = num_bytes / peer[f"{path}_s"]
        out[f"vs_lmcache_{path}"] = kvtier[key] / out[f"lmcache_{path}_Bps"]
    return out


def summarize(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Median and range of each per-round ratio, per geometry, and the worst median."""
    import statistics

    geometries = {
        name: {
            path: {
                "median": statistics.median(r[f"vs_lmcache_{path}"] for r in rs),
                "range": [min(r[f"vs_lmcache_{path}"] for r in rs), max(r[f"vs_lmcache_{path}"] for r in rs)],
                "lmcache_median_Bps": statistics.median(r[f"lmcache_{path}_Bps"] for r in rs),
            }
            for path in PATHS
        }
        for name, rs in rounds.items()
    }
    medians = [p["median"] for g in geometries.values() for p in g.values()]
    return {"geometries": geometries, "worst_median": min(medians), "rounds": len(next(iter(rounds.values())))}


def report_lines(peer: dict[str, Any]) -> list[str]:
    if "skipped" in peer:
        return [peer["skipped"]]
    info = peer["info"]
    lines = [
        f"LMCache {info['lmcache_version']} (torch {info['torch_version']}, {info['torch_threads']} thread) StorageManager, LocalCPUBackend + "
        f"LocalDiskBackend, O_DIRECT {'yes' if info['o_direct'] else 'NO'}, {info['disk_io_threads']} disk threads: "
        f"kvtier / LMCache, median [range] of {peer['rounds']} alternating rounds"
    ]
    for name, paths in peer["geometries"].items():
        lines.append(f"  {name:13s} " + "  ".join(
            f"{path} {p['median']:.2f} [{p['range'][0]:.2f}-{p['range'][1]:.2f}]"
            f" (LMCache {p['lmcache_median_Bps'] / 1e9:.2f} GB/s)"
            for path, p in paths.items()
        ))
    return lines


# ---------------------------------------------------------------- the child: LMCache itself


class _Geometry:
    """One geometry's pages: the source pages every path stores, the destination every read
    fills (compared with the source after each timed read), and the round count for fresh keys."""

    def __init__(self, name: str, shape: list[int], dtype: Any, num_pages: int, seed: int) -> None:
        import torch

        self.name, self.shape, self.dtype, self.n = name, torch.Size(shape), dtype, num_pages
        g = torch.Generator().manual_seed(seed)
        self.src = torch.randn((num_pages, *shape), generator=g).to(dtype)
        self.dst = torch.empty_like(self.src)
        self.page_bytes = self.src[0].numel() * self.src.element_size()
        self.round = 0


class _Peer:
    """One ``StorageManager`` over all geometries; ``round`` runs the four paths of one."""

    def __init__(self, directory: str, geometries: dict[str, dict[str, Any]], rounds: int, threads: int | None) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        # One intra-op thread, as each of kvtier's transfer lanes uses: with the other core
        # busy, a second OpenMP thread makes every per-page copy_ wait for it, and LMCache's
        # memory path lost most of its speed to that (docs/benchmarks.md, "kvtier against LMCache").
        torch.set_num_threads(1)
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        self.geometries = {
            name: _Geometry(name, g["shape"], dtypes[g["dtype"]], g["num_pages"], seed=i)
            for i, (name, g) in enumerate(geometries.items())
        }
        round_bytes = sum(g.n * g.page_bytes for g in self.geometries.values())
        # CPU: one round's memory-path objects, one round's disk reads (written back to
        # LocalCPUBackend) and one round's disk-write sources, all at once, with slack.
        cpu_gib = 4 * round_bytes / 2**30 + 0.25
        # Disk: every byte of every round (removes do not return bytes to the count), the
        # warm-up round and one spare.
        disk_gib = ((rounds + 2) * round_bytes + (64 << 20)) / 2**30
        Path(directory).mkdir(parents=True, exist_ok=True)
        extra: dict[str, Any] = {"use_odirect": True}
        if threads:
            extra["disk_io_threads"] = threads
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=True,
            max_local_cpu_size=cpu_gib,
            local_disk=f"file://{directory}/",
            max_local_disk_size=disk_gib,
            extra_config=extra,
        )
        first = next(iter(self.geometries.values()))
        metadata = LMCacheMetadata(
            model_name="kvtier-bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=first.dtype,
            kv_shape=(first.shape[1], 2, first.shape[2], 1, first.shape[3]),
        )
        self.manager = StorageManager(self.config, metadata, EventManager())
        self.cpu = self.manager.storage_backends["LocalCPUBackend"]
        self.disk = self.manager.storage_backends["LocalDiskBackend"]
        self.directory = directory

    def _keys(self, geo: _Geometry, tag: int) -> list[Any]:
        from lmcache.utils import CacheEngineKey

        return [CacheEngineKey(f"{geo.name}-{tag}", 1, 0, i, geo.dtype) for i in range(geo.n)]

    def _allocate(self, geo: _Geometry) -> list[Any]:
        from lmcache.v1.memory_management import MemoryFormat

        objs = self.manager.batched_allocate(geo.shape, geo.dtype, geo.n, MemoryFormat.KV_2LTD)
        if objs is None or len(objs) != geo.n:
            raise RuntimeError(f"{geo.name}: LocalCPUBackend could not allocate {geo.n} objects")
        return list(objs)

    def _require_landed(self, geo: _Geometry, backend: Any, keys: list[Any], what: str) -> None:
        missing = sum(not backend.contains(k) for k in keys)
        if missing:
            raise RuntimeError(f"{geo.name} {what}: {missing} of {geo.n} puts did not land in {backend} (refused or failed)")

    def _get(self, geo: _Geometry, keys: list[Any], location: str, what: str) -> list[Any]:
        got = self.manager.batched_get(keys, location=location)
        missing = sum(obj is None for obj in got)
        if missing:
            raise RuntimeError(f"{geo.name} {what}: {missing} of {geo.n} pages did not come back from {location}")
        return list(got)

    def _check(self, geo: _Geometry, what: str) -> None:
        import torch

        if not torch.equal(geo.dst.view(torch.uint8), geo.src.view(torch.uint8)):
            bad = sum(not torch.equal(geo.dst[i], geo.src[i]) for i in range(geo.n))
            raise RuntimeError(f"{geo.name} {what}: {bad} of {geo.n} pages came back with other bytes")

    def round(self, name: str) -> dict[str, float]:
        geo = self.geometries[name]
        geo.round += 1
        mem_keys, disk_keys = self._keys(geo, 2 * geo.round), self._keys(geo, 2 * geo.round + 1)
        return {**self._memory(geo, mem_keys), **self._disk(geo, disk_keys)}

    def _memory(self, geo: _Geometry, keys: list[Any]) -> dict[str, float]:
        start = time.perf_counter()
        objs = self._allocate(geo)
        for i, obj in enumerate(objs):
            obj.tensor.copy_(geo.src[i])
        self.manager.batched_put(keys, objs, location="LocalCPUBackend")
        write_s = time.perf_counter() - start
        self._require_landed(geo, self.cpu, keys, "memory write")
        geo.dst.zero_()
        start = time.perf_counter()
        got = self._get(geo, keys, "LocalCPUBackend", "memory read")
        for i, obj in enumerate(got):
            geo.dst[i].copy_(obj.tensor)
        read_s = time.perf_counter() - start
        self._check(geo, "memory read")
        for obj in got:
            obj.ref_count_down()
        self.manager.batched_remove(keys, locations=["LocalCPUBackend"])
        return {"mem_write_s": write_s, "mem_read_s": read_s}

    def _disk(self, geo: _Geometry, keys: list[Any]) -> dict[str, float]:
        need = geo.n * geo.page_bytes
        if self.disk.current_cache_size + need > self.disk.max_cache_size:
            raise RuntimeError(
                f"{geo.name} disk write: LocalDiskBackend counts {self.disk.current_cache_size:.0f} of "
                f"{self.disk.max_cache_size} bytes used and would refuse {need} more (LMCache 0.5.6's "
                "remove() does not return bytes to that count); the peer was sized for fewer rounds"
            )
        objs = self._allocate(geo)
        for i, obj in enumerate(objs):
            obj.tensor.copy_(geo.src[i])
        start = time.perf_counter()
        self.manager.batched_put(keys, objs, location="LocalDiskBackend")
        worker = self.disk.disk_worker
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while True:
            with worker.put_lock:
                pending = len(worker.put_tasks)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{geo.name} disk write: {pending} puts still pending after {REPLY_TIMEOUT_S} s")
            time.sleep(0.0005)
        write_s = time.perf_counter() - start
        self._require_landed(geo, self.disk, keys, "disk write")
        self._drop_cache(keys)
        geo.dst.zero_()
        start = time.perf_counter()
        got = self._get(geo, keys, "LocalDiskBackend", "disk read")
        read_s = time.perf_counter() - start
        for i, obj in enumerate(got):
            geo.dst[i].copy_(obj.tensor)
        self._check(geo, "disk read")
        for obj in got:
            obj.ref_count_down()
        self.manager.batched_remove(keys, locations=["LocalCPUBackend", "LocalDiskBackend"])
        return {"disk_write_s": write_s, "disk_read_s": read_s}

    def _drop_cache(self, keys: list[Any]) -> None:
        """O_DIRECT already keeps the files out of the page cache; drop whatever a fallback to
        buffered I/O (an unaligned size) would have left, so no read comes from memory."""
        for key in keys:
            fd = os.open(self.disk._key_to_path(key), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def info(self) -> dict[str, Any]:
        import lmcache
        import torch

        return {
            "lmcache_version": getattr(lmcache, "__version__", "unknown"),
            "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "o_direct": bool(self.disk.use_odirect),
            "disk_io_threads": self.disk._read_thread_pool._max_workers,
            "disk_dir": self.disk.path,
            "disk_max_bytes": self.disk.max_cache_size,
        }

    def close(self) -> None:
        self.manager.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _reply(out: IO[str], value: dict[str, Any]) -> None:
    out.write(json.dumps(value) + "\n")
    out.flush()


def serve() -> None:
    """Answer JSON requests from stdin on stdout until ``close`` or end of input. LMCache's
    own logging goes to stderr, so stdout stays the reply channel."""
    # Replies go to a duplicate of the original stdout; file descriptor 1 and sys.stdout point
    # at stderr, so nothing LMCache prints (Python or native code) can break a reply line.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    peer: _Peer | None = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "setup":
                peer = _Peer(**request)
                _reply(out, peer.info())
            elif op == "round":
                assert peer is not None, "setup first"
                _reply(out, peer.round(request["geometry"]))
            elif op == "close":
                if peer is not None:
                    peer.close()
                _reply(out, {})
                return
            else:
                _reply(out, {"error": f"unknown op {op!r}"})
        except Exception as exc:  # the benchmark side raises it with the op's name
            _reply(out, {"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: python loadtests/lmcache_peer.py --serve (started by loadtests.bench_tiers)")
    serve()
