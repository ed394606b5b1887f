"""HBM pool sizing: the vLLM-style arithmetic with injected device numbers, the NVML
device mapping, and the fallback when there is no GPU or NVML fails."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pynvml
import pytest

from kvtier.domain.errors import ConfigError
from kvtier.worker import sizing
from kvtier.worker.sizing import DEFAULT_CPU_HBM_BYTES, GIB, DeviceMemory, hbm_budget, size_hbm_pool


def budget(memory, *, util=0.9, weights=16 * GIB, configured=None, headroom=2 * GIB):
    return hbm_budget(
        memory=memory,
        gpu_memory_utilization=util,
        weights_bytes=weights,
        configured_bytes=configured,
        headroom_bytes=headroom,
    )


def test_share_of_total_minus_weights_and_headroom():
    result = budget(DeviceMemory(total_bytes=80 * GIB, free_bytes=62 * GIB))
    assert result.kv_bytes == int(80 * GIB * 0.9) - 16 * GIB - 2 * GIB
    assert result.source == "nvml"


def test_free_memory_caps_the_share_when_others_use_the_device():
    result = budget(DeviceMemory(total_bytes=80 * GIB, free_bytes=20 * GIB))
    assert result.kv_bytes == 18 * GIB


def test_explicit_hbm_bytes_always_wins():
    result = budget(DeviceMemory(total_bytes=80 * GIB, free_bytes=62 * GIB), configured=5 * GIB)
    assert (result.kv_bytes, result.source) == (5 * GIB, "configured")


def test_no_device_information_falls_back():
    assert budget(None, configured=3 * GIB).kv_bytes == 3 * GIB
    fallback = budget(None)
    assert (fallback.kv_bytes, fallback.source) == (DEFAULT_CPU_HBM_BYTES, "cpu-default")


def test_nothing_left_names_the_setting_and_the_numbers():
    with pytest.raises(ConfigError) as caught:
        budget(DeviceMemory(total_bytes=24 * GIB, free_bytes=8 * GIB), util=0.5, weights=14 * GIB)
    assert caught.value.field == "gpu_memory_utilization"
    assert "weights 15032385536" in caught.value.message and "--hbm-bytes" in caught.value.message


def test_nvml_error_falls_back_and_logs_the_source(monkeypatch, caplog):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    monkeypatch.setattr(sizing, "_torch_device_memory", lambda: None)
    assert sizing.query_device_memory() is None
    caplog.set_level(logging.INFO, logger="kvtier.worker.sizing")
    result = size_hbm_pool(gpu_memory_utilization=0.9, weights_bytes=GIB, configured_bytes=None, use_gpu=True)
    assert result.source == "cpu-default"
    assert [r.source for r in caplog.records if r.getMessage() == "hbm pool sized"] == ["cpu-default"]


def test_this_machine_without_a_gpu_uses_the_fallback():
    result = size_hbm_pool(
        gpu_memory_utilization=0.9, weights_bytes=GIB, configured_bytes=None, use_gpu=False
    )
    assert result.source == "cpu-default"
    assert (
        size_hbm_pool(gpu_memory_utilization=0.9, weights_bytes=0, configured_bytes=7, use_gpu=True).kv_bytes
        == 7
    )


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, ("index", 0)), ("3,5", ("index", 3)), ("GPU-1a2b", ("uuid", "GPU-1a2b"))],
)
def test_nvml_device_follows_cuda_visible_devices(monkeypatch, visible, expected):
    opened = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: opened.append(("index", i)) or "h")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda u: opened.append(("uuid", u)) or "h")
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(total=80 * GIB, free=70 * GIB)
    )
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sizing.query_device_memory() == DeviceMemory(total_bytes=80 * GIB, free_bytes=70 * GIB)
    assert opened == [expected]
