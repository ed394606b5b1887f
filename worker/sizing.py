"""How many bytes the HBM page pool gets (vLLM's ``--gpu-memory-utilization`` rule).

With a GPU and no explicit ``hbm_bytes``, NVML (else ``torch.cuda.mem_get_info``) reports the device's total and free
memory after the weights are loaded, and

    kv_bytes = min(total × gpu_memory_utilization − weights − headroom,   # our share
                   free − headroom)                                      # what is left

where the headroom covers activations, the CUDA context and allocator slack. An explicit
``hbm_bytes`` always wins. Without a GPU (or when NVML fails) the configured
``hbm_bytes`` is used, else ``DEFAULT_CPU_HBM_BYTES``; the chosen source is logged.

The pools are counted in whole pages of their exact bytes (``pool_geometries``): an FP8 page is
its codes plus one fp32 scale per (layer, plane, kv head), as ``kvtier plan`` counts it, and
with ``lower_tier_dtype = fp8`` DRAM and NVMe are counted in FP8 pages while HBM holds float ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvtier.cache.page_pool import PoolGeometry
from kvtier.domain.errors import ConfigError, InvalidArgument
from kvtier.domain.kv_dtype import KvCacheDtype, resolve
from kvtier.engine.engine import page_dtype
from kvtier.runtime.log import get_logger

log = get_logger("kvtier.worker.sizing")

GIB = 1 << 30
MIB = 1 << 20
DEFAULT_HEADROOM_BYTES = 2 * GIB
DEFAULT_CPU_HBM_BYTES = 256 * MIB


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    total_bytes: int
    free_bytes: int
    source: str = "nvml"  # or "torch" (torch.cuda.mem_get_info when NVML fails)


@dataclass(frozen=True, slots=True)
class HbmBudget:
    """Bytes for the HBM page pool and where the number came from."""

    kv_bytes: int
    source: str  # "configured" | "nvml" | "torch" | "cpu-default"
    detail: str


def query_device_memory(device_index: int = 0) -> DeviceMemory | None:
    """Total and free bytes of the visible CUDA device ``device_index``, or None without NVML.

    NVML numbers devices physically; ``CUDA_VISIBLE_DEVICES`` (which Ray sets per actor)
    maps the visible index to an NVML index or a GPU UUID.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        name = visible[device_index] if device_index < len(visible) else str(device_index)
        if name.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(name)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(name))
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return DeviceMemory(total_bytes=int(info.total), free_bytes=int(info.free))
    except (pynvml.NVMLError, ValueError):
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _torch_device_memory() -> DeviceMemory | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return DeviceMemory(total_bytes=int(total), free_bytes=int(free), source="torch")


def hbm_budget(
    *,
    memory: DeviceMemory | None,
    gpu_memory_utilization: float,
    weights_bytes: int,
    configured_bytes: int | None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> HbmBudget:
    """The HBM pool budget; pure arithmetic, so tests inject ``memory``."""
    if configured_bytes is not None:
        return HbmBudget(configured_bytes, "configured", f"hbm_bytes={configured_bytes}")
    if memory is None:
        return HbmBudget(
            DEFAULT_CPU_HBM_BYTES,
            "cpu-default",
            f"no GPU memory information (no GPU or NVML failed) and hbm_bytes unset; using {DEFAULT_CPU_HBM_BYTES}",
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}",
            field="gpu_memory_utilization",
        )
    by_share = int(memory.total_bytes * gpu_memory_utilization) - weights_bytes - headroom_bytes
    by_free = memory.free_bytes - headroom_bytes
    kv_bytes = min(by_share, by_free)
    detail = (
        f"total {memory.total_bytes} x {gpu_memory_utilization:g} - weights {weights_bytes} - headroom "
        f"{headroom_bytes} = {by_share}; free {memory.free_bytes} - headroom = {by_free}"
    )
    if kv_bytes <= 0:
        raise ConfigError(
            f"no device memory is left for the KV cache ({detail}); raise --gpu-memory-utilization, "
            "use a smaller model, or set --hbm-bytes",
            field="gpu_memory_utilization",
        )
    return HbmBudget(kv_bytes, memory.source, detail)


def size_hbm_pool(
    *,
    gpu_memory_utilization: float,
    weights_bytes: int,
    configured_bytes: int | None,
    use_gpu: bool,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> HbmBudget:
    """``hbm_budget`` with NVML's numbers when ``use_gpu``; logs the outcome and its source."""
    memory = None
    if use_gpu and configured_bytes is None:
        memory = query_device_memory() or _torch_device_memory()
    budget = hbm_budget(
        memory=memory,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights_bytes,
        configured_bytes=configured_bytes,
        headroom_bytes=headroom_bytes,
    )
    log.info(
        "hbm pool sized",
        extra={"kv_bytes": budget.kv_bytes, "source": budget.source, "detail": budget.detail},
    )
    return budget


_FLOAT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def cache_format(kv_cache_dtype: str, lower_tier_dtype: str, *, use_cuda: bool) -> KvCacheDtype:
    """The worker's cache format (``auto``: fp32 on a CPU, bf16 on a GPU); errors name the setting."""
    if kv_cache_dtype == "auto":
        kv_cache_dtype = "bf16" if use_cuda else "fp32"
    try:
        return resolve(kv_cache_dtype, lower_tier_dtype=lower_tier_dtype)
    except InvalidArgument as err:
        raise ConfigError(err.message, field=err.field or "kv_cache_dtype") from None


def model_dtype(kv_format: KvCacheDtype, *, use_cuda: bool) -> torch.dtype:
    """The dtype the model runs in: a float cache's own (the pool follows the model), else the
    device's usual one; FP8 K/V are quantized as they are written."""
    base = kv_format.hbm.base if kv_format.hbm.is_float else ("bf16" if use_cuda else "fp32")
    return getattr(torch, _FLOAT_DTYPES[base])


def pool_geometries(
    kv_geometry: tuple[int, int, int], page_size: int, dtype: torch.dtype, kv_format: KvCacheDtype
) -> tuple[PoolGeometry, PoolGeometry]:
    """``(hbm, lower)``: the geometry of an HBM page and of a DRAM / NVMe page."""
    num_layers, kv_heads, head_dim = kv_geometry
    return (
        PoolGeometry(num_layers, kv_heads, head_dim, page_size, page_dtype(dtype, kv_format.hbm)),
        PoolGeometry(num_layers, kv_heads, head_dim, page_size, page_dtype(dtype, kv_format.lower)),
    )
