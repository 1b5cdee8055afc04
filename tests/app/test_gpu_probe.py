"""GPU probe against a stand-in NVML: a normal driver, WSL's partial one, no driver, no GPU."""
from __future__ import annotations

import types
from dataclasses import dataclass

from ninfer.app import gpu_probe
from ninfer.app.gpu_probe import plan_device, probe


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's names
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    pass


@dataclass
class Mem:
    total: int
    free: int
    used: int


def fake_nvml(gpus: list[dict], unsupported: set[str] = frozenset(), init_error: type | None = None):
    def query(name, fn):
        def call(*args):
            if name in unsupported:
                raise NVMLError_NotSupported("Not Supported")
            return fn(*args)
        call.__name__ = name
        return call

    def init():
        if init_error is not None:
            raise init_error("NVML Shared Library Not Found")

    m = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=lambda: None)
    table = {
        "nvmlSystemGetDriverVersion": lambda: "580.65",
        "nvmlSystemGetCudaDriverVersion": lambda: 13000,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: gpus[i],
        "nvmlDeviceGetName": lambda h: h["name"].encode(),  # older bindings return bytes
        "nvmlDeviceGetMemoryInfo": lambda h: Mem(h["total"], h["free"], h["total"] - h["free"]),
        "nvmlDeviceGetCudaComputeCapability": lambda h: h["cc"],
        "nvmlDeviceGetUUID": lambda h: "GPU-" + h["name"][-4:],
    }
    for name, fn in table.items():
        setattr(m, name, query(name, fn))
    return m


GIB = 1 << 30
TWO = [{"name": "NVIDIA RTX 4090", "total": 24 * GIB, "free": 20 * GIB, "cc": (8, 9)},
       {"name": "NVIDIA RTX 5060 Ti", "total": 16 * GIB, "free": 15 * GIB, "cc": (12, 0)}]


def test_every_gpu_with_memory_driver_and_compute_capability():
    result = probe(fake_nvml(TWO))
    assert not result.cpu_mode and [g.name for g in result.gpus] == ["NVIDIA RTX 4090", "NVIDIA RTX 5060 Ti"]
    assert result.gpus[0].compute_capability == "8.9" and result.gpus[1].total == 16 * GIB
    assert result.driver == "580.65" and result.cuda_driver == "13.0"
    device = plan_device(result)
    assert device.index == 0 and device.free == 20 * GIB  # the most free memory
    assert "GPU 1: NVIDIA RTX 5060 Ti, 15.0 of 16.0 GiB free, compute 12.0" in result.summary()


def test_wsl_unsupported_queries_do_not_hide_the_gpu(monkeypatch):
    monkeypatch.setattr(gpu_probe._wsl, "in_wsl", lambda: True)
    monkeypatch.setattr(gpu_probe._wsl, "preload_nvml", lambda: None)
    nvml = fake_nvml(TWO[:1], unsupported={"nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetUUID",
                                           "nvmlSystemGetCudaDriverVersion"})
    result = probe(nvml)
    g = result.gpus[0]
    assert not result.cpu_mode and g.total == 24 * GIB and g.free == 20 * GIB
    assert g.compute_capability is None and g.uuid is None
    assert any("NotSupported" in u or "Not Supported" in u for u in g.unsupported)
    assert result.wsl and result.summary().endswith("under WSL")


def test_no_driver_is_cpu_mode_said_plainly():
    result = probe(fake_nvml([], init_error=NVMLError_LibraryNotFound))
    assert result.cpu_mode
    said = result.summary()
    assert "no NVIDIA driver is installed" in said and "CPU mode with the embedded model" in said
    assert plan_device(result).index is None and plan_device(result).name == "CPU"


def test_driver_without_gpu_and_gpu_without_memory_are_cpu_mode():
    assert "reports no GPU" in probe(fake_nvml([])).summary()
    result = probe(fake_nvml(TWO[:1], unsupported={"nvmlDeviceGetMemoryInfo"}))
    assert result.cpu_mode and "memory could not be read" in result.summary()


def test_real_probe_runs_here():
    """On this machine (no NVIDIA driver in CI) the real pynvml path ends in CPU mode, without raising."""
    result = probe()
    assert result.summary()
    assert result.to_json().startswith("{")
