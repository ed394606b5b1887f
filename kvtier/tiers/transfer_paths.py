"""The byte paths of the transfer engine, one per tier pair: HBM <-> DRAM copies (the fused copy +
checksum kernel on the CPU, a lane's CUDA stream on a GPU), and NVMe reads and writes of slot runs,
staged through pinned host pages for a GPU. Checksums are taken, carried or verified on the way
(``kvtier.tiers.transfer``'s doc)."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.domain.errors import InvalidArgument
from kvtier.domain.tiers import Tier
from kvtier.tiers import copy as page_copy
from kvtier.tiers.checksum import page_checksums
from kvtier.tiers.dram import DramPool, aligned_host_tensor
from kvtier.tiers.nvme.format import DiskFull, NvmeIOError, SlotId
from kvtier.tiers.transfer_lanes import Job


class CopyPaths:
    """The copy paths of ``TransferEngine`` (``kvtier.tiers.transfer_engine``), which holds the pools, lanes and streams."""

    @staticmethod
    def _runs(pairs: np.ndarray, limit: int, *, by: str = "both") -> list[np.ndarray]:
        """Positions into ``pairs`` grouped into runs of at most ``limit``: where src and dst
        both advance by one (``by="both"``), or dst alone (``by="dst"``)."""
        if by == "both" and len(pairs) > 1 and (np.diff(pairs, axis=0) == 1).all():
            # Already one run (the common case): no sort.
            whole = np.arange(len(pairs))
            return [whole[c : c + limit] for c in range(0, len(pairs), limit)]
        if by == "both":
            order = np.lexsort((pairs[:, 1], pairs[:, 0]))
            ordered = pairs[order]
            step = (np.diff(ordered[:, 0]) != 1) | (np.diff(ordered[:, 1]) != 1)
        else:
            order = np.argsort(pairs[:, 1], kind="stable")
            step = np.diff(pairs[order, 1]) != 1
        runs: list[np.ndarray] = []
        for segment in np.split(order, np.flatnonzero(step) + 1):
            runs.extend(segment[c : c + limit] for c in range(0, len(segment), limit))
        return runs

    def _run(self, job: Job) -> tuple[list[int], list[bool] | None]:
        if not self.is_cuda:
            return self._dispatch(job)
        stream = self._streams[job.lane.name]
        # Every device op of this job runs on the lane's stream, after the work the
        # caller had queued when it submitted (pages as of submission; a destination
        # page is not overwritten while earlier kernels still read it).
        stream.wait_event(job.ready_event)
        with torch.cuda.stream(stream):
            return self._dispatch(job)

    def _dispatch(self, job: Job) -> tuple[list[int], list[bool] | None]:
        t = job.transfer
        pairs = t.pairs
        key = (t.src_tier, t.dst_tier)
        if key == (Tier.HBM, Tier.DRAM):
            return self._hbm_to_dram(job, pairs).tolist(), None
        if key == (Tier.DRAM, Tier.HBM):
            return self._dram_to_hbm(job, pairs)
        if t.dst_tier is Tier.NVME:
            return self._to_nvme(job, pairs).tolist(), None
        if t.src_tier is Tier.NVME:
            return self._from_nvme(job, pairs)
        raise InvalidArgument(f"no transfer path from {t.src_tier.label} to {t.dst_tier.label}")

    def _memcpy_runs(
        self, job: Job, pairs: np.ndarray, src: torch.Tensor, dst: torch.Tensor, on: str
    ) -> np.ndarray:
        """Copy every run (one call each, checksummed on the way); return each pair's
        checksum (uint64) of the ``on`` side, "src" or "dst".

        On CUDA every run's copy and checksum is queued on the lane's stream and the thread
        waits once, at the end: waiting per run left the copy engine idle between runs
        (0.5x a single ``copy_`` on an H200). A cancelled or failed job still waits for what
        it queued, so no destination page is handed back while a copy may write it.
        """
        if not self.is_cuda:
            return self._memcpy_pages(job, pairs, src, dst)
        sums = np.zeros(len(pairs), dtype=np.uint64)
        queued: list[tuple[np.ndarray, torch.Tensor]] = []
        try:
            for run in self._runs(pairs, self.chunk_pages):
                self._check_cancel(job)
                s0, d0 = int(pairs[run[0], 0]), int(pairs[run[0], 1])
                k = len(run)
                queued.append((run, self._cuda_copy(src[s0 : s0 + k], dst[d0 : d0 + k], on)))
                job.moved_bytes += k * self.page_bytes
        finally:
            if queued:
                finished = torch.cuda.Event()
                finished.record()
                finished.synchronize()  # blocks this lane thread only
        if queued:
            values = torch.cat([v for _, v in queued]).cpu()
            sums[np.concatenate([r for r, _ in queued])] = values.numpy().view(np.uint64)
        return sums

    def _memcpy_pages(self, job: Job, pairs: np.ndarray, src: torch.Tensor, dst: torch.Tensor) -> np.ndarray:
        """CPU: copy and checksum every pair in one ``page_copy`` call that walks the page ids
        in C++ (no sort into runs, no per-page Python), in parts of ``chunk_pages`` pairs
        between which the job honours cancellation and the pacing budget. Each word is
        stored and summed while it is in a register, so a sum is that of both sides."""

        def before_part(num_copied: int) -> None:
            job.moved_bytes = num_copied * self.page_bytes
            self._check_cancel(job)

        sums = page_copy.copy_pages_with_checksums(
            src,
            dst,
            pairs[:, 0],
            pairs[:, 1],
            part_pages=self.chunk_pages,
            before_part=before_part,
            num_threads=self.copy_threads,
        )
        job.moved_bytes = len(pairs) * self.page_bytes
        return sums

    @staticmethod
    def _cuda_copy(src: torch.Tensor, dst: torch.Tensor, on: str) -> torch.Tensor:
        """Queue one async copy between HBM and pinned DRAM on the current (lane) stream and
        the page checksums (a device tensor, valid once the stream reaches this point)."""
        # Sum where the bytes are in HBM: before they leave, after they arrive.
        if on == "src" and src.is_cuda:
            sums = page_checksums(src)
            dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src, non_blocking=True)
            sums = page_checksums(dst if dst.is_cuda else src)
        return sums

    def _hbm_to_dram(self, job: Job, pairs: np.ndarray) -> np.ndarray:
        assert self.dram is not None
        if self.codec is not None:
            sums = self._encode_pages(job, pairs)
            self.dram.set_checksums(pairs[:, 1], sums)
            return sums
        sums = self._memcpy_runs(
            job, pairs, self.hbm.tensor, self.dram.tensor, "src" if self.is_cuda else "dst"
        )
        self.dram.set_checksums(pairs[:, 1], sums)
        return sums

    def _dram_to_hbm(self, job: Job, pairs: np.ndarray) -> tuple[list[int], list[bool]]:
        assert self.dram is not None
        expected, present = self.dram.checksum_array(pairs[:, 0])
        if self.codec is not None:
            got = self._decode_pages(job, pairs)
        else:
            got = self._memcpy_runs(job, pairs, self.dram.tensor, self.hbm.tensor, "dst")
        return expected.tolist(), ((got == expected) & present).tolist()

    # ---- a lower-tier format (kvtier.tiers.page_codec): convert on the HBM boundary -------------
    def _encode_pages(self, job: Job, pairs: np.ndarray) -> np.ndarray:
        """HBM pages ``pairs[:, 0]`` encoded into DRAM pages ``pairs[:, 1]``; the checksums of the
        encoded bytes, the ones DRAM stores."""
        assert self.dram is not None and self.codec is not None
        sums = np.zeros(len(pairs), dtype=np.uint64)
        for a in range(0, len(pairs), self.chunk_pages):
            self._check_cancel(job)
            part = pairs[a : a + self.chunk_pages]
            src = self.hbm.tensor[torch.from_numpy(part[:, 0].copy()).to(self.hbm.tensor.device)]
            encoded = torch.empty(self.lower_geometry.tensor_shape(len(part)), dtype=self.lower_geometry.storage_dtype,
                                  device=src.device)
            self.codec.encode(src, encoded)
            sums[a : a + len(part)] = page_checksums(encoded).cpu().numpy().view(np.uint64)
            self.dram.tensor[torch.from_numpy(part[:, 1].copy())] = encoded.cpu()
            job.moved_bytes += len(part) * self.page_bytes
        return sums

    def _decode_pages(self, job: Job, pairs: np.ndarray) -> np.ndarray:
        """DRAM pages ``pairs[:, 0]`` decoded into HBM pages ``pairs[:, 1]``; the checksums of the
        DRAM bytes as read (the caller compares them with the stored ones)."""
        assert self.dram is not None and self.codec is not None
        sums = np.zeros(len(pairs), dtype=np.uint64)
        for a in range(0, len(pairs), self.chunk_pages):
            self._check_cancel(job)
            part = pairs[a : a + self.chunk_pages]
            stored = self.dram.tensor[torch.from_numpy(part[:, 0].copy())]
            sums[a : a + len(part)] = page_checksums(stored).numpy().view(np.uint64)
            self._decode_into_hbm(stored, part[:, 1])
            job.moved_bytes += len(part) * self.page_bytes
        return sums

    def _decode_into_hbm(self, stored: torch.Tensor, hbm_ids: np.ndarray) -> None:
        assert self.codec is not None
        hbm = self.hbm.tensor
        decoded = torch.empty((len(hbm_ids), *hbm.shape[1:]), dtype=hbm.dtype, device=hbm.device)
        self.codec.decode(stored.to(hbm.device, non_blocking=True), decoded)
        hbm[torch.from_numpy(np.array(hbm_ids, dtype=np.int64)).to(hbm.device)] = decoded

    def _host_pages(self, num_pages: int) -> torch.Tensor:
        """Per-thread aligned (pinned on CUDA) staging pages, in the lower tiers' format, for
        NVMe <-> GPU HBM and for NVMe <-> HBM through a codec."""
        buf = getattr(self._staging, "pages", None)
        if buf is None or buf.shape[0] < num_pages:
            g = self.lower_geometry
            raw = aligned_host_tensor(num_pages * self.page_bytes, pin_memory=self.is_cuda)
            buf = raw.view(g.storage_dtype).view(g.tensor_shape(num_pages))
            self._staging.pages = buf
        return buf[:num_pages]

    def _to_nvme(self, job: Job, pairs: np.ndarray) -> np.ndarray:
        t = job.transfer
        nvme = self.nvme
        assert nvme is not None and t.keys is not None and t.namespaces is not None
        from_hbm = t.src_tier is Tier.HBM
        src = self.hbm.tensor if from_hbm else self.dram.tensor  # type: ignore[union-attr]
        if from_hbm:
            sums = np.zeros(len(pairs), dtype=np.uint64)
            encode = self.codec is not None
        else:
            encode = False
            assert self.dram is not None
            sums = self.dram.checksum_array(pairs[:, 0])[0]  # carried, not recomputed
        for group in self._runs(pairs, nvme.max_slots_per_io, by="dst"):
            self._check_cancel(job)
            ids = pairs[group, 0]
            pages, rows = src, ids
            if encode:
                assert self.codec is not None
                # Encoded into the staging pages, checksummed as stored.
                pages, rows = self._host_pages(len(ids)), None
                self.codec.encode(src[torch.from_numpy(ids.copy()).to(src.device)], pages)
                sums[group] = page_copy.checksums(pages).numpy().view(np.uint64)
            elif from_hbm:
                # Checksum per run of consecutive source pages, in HBM, before they leave.
                for part in np.split(np.arange(len(ids)), np.flatnonzero(np.diff(ids) != 1) + 1):
                    a = int(ids[part[0]])
                    values = page_copy.checksums(src[a : a + len(part)]).cpu()
                    sums[group[part]] = values.numpy().view(np.uint64)
            # Host pages go out straight from the pool (pages picked by row, no per-page
            # tensor); device pages through the staging buffer.
            if src.is_cuda and not encode:
                pages, rows = self._host_pages(len(ids)), None
                for j, i in enumerate(ids.tolist()):
                    pages[j].copy_(src[i])
            try:
                positions = group.tolist()
                nvme.write_pages(
                    pairs[group, 1],
                    pages,
                    [t.keys[i] for i in positions],
                    [t.namespaces[i] for i in positions],
                    sums[group],
                    parents=[t.parents[i] for i in positions] if t.parents else None,
                    tokens=[t.tokens[i] for i in positions] if t.tokens else None,
                    rows=rows,
                )
            except (DiskFull, NvmeIOError):
                # write_pages gave this group's slots back; give back the rest too, so a
                # failed transfer to NVMe leaves every destination slot free.
                failed = set(group.tolist())
                for i in range(len(pairs)):
                    if i not in failed:
                        nvme.free(SlotId(int(pairs[i, 1])))
                job.dst_released = True
                raise
            job.moved_bytes += len(group) * self.page_bytes
        return sums

    def _from_nvme(self, job: Job, pairs: np.ndarray) -> tuple[list[int], list[bool]]:
        nvme = self.nvme
        assert nvme is not None
        t = job.transfer
        dst_pool = self.hbm if t.dst_tier is Tier.HBM else self.dram
        assert dst_pool is not None
        sums = np.zeros(len(pairs), dtype=np.uint64)
        ok = np.zeros(len(pairs), dtype=bool)
        for group in self._runs(pairs, nvme.max_slots_per_io, by="dst"):
            self._check_cancel(job)
            d0, k = int(pairs[group[0], 1]), len(group)
            slots = pairs[group, 0]
            target = dst_pool.tensor[d0 : d0 + k]
            decode = self.codec is not None and dst_pool is self.hbm
            staged = self._host_pages(k) if target.is_cuda or decode else target
            verdicts = nvme.read_pages(slots, staged)
            if decode:
                self._decode_into_hbm(staged, pairs[group, 1])
            elif staged is not target:
                target.copy_(staged)
            sums[group] = nvme.stored_checksums(slots)
            ok[group] = [v.ok for v in verdicts]
            job.moved_bytes += k * self.page_bytes
        if isinstance(dst_pool, DramPool):
            dst_pool.set_checksums(pairs[ok, 1], sums[ok])
        return sums.tolist(), ok.tolist()

