"""What GPUs this machine has, through NVML (``nvidia-ml-py``), without loading CUDA or torch.

Each query is made on its own: under WSL memory queries work while others (PCI info, some clocks)
raise ``NVMLError_NotSupported``, and one unsupported query must not hide the GPU. No driver, no
NVML library or no GPU gives CPU mode, with a sentence that says why.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import _wsl
from .plan import Device

CPU_MODE = "CPU mode with the embedded model"


@dataclass
class GpuInfo:
    index: int
    name: str
    total: int | None  # bytes
    free: int | None
    compute_capability: str | None  # "9.0"
    uuid: str | None = None
    unsupported: list[str] = field(default_factory=list)  # queries the driver refused


@dataclass
class Probe:
    gpus: list[GpuInfo]
    driver: str | None = None
    cuda_driver: str | None = None  # "12.8": the newest CUDA the driver supports
    wsl: bool = False
    note: str = ""  # said plainly to the user; empty when GPUs were found

    @property
    def cpu_mode(self) -> bool:
        return not any(g.total for g in self.gpus)

    def best(self) -> GpuInfo | None:
        usable = [g for g in self.gpus if g.total]
        return max(usable, key=lambda g: g.free or 0) if usable else None

    def summary(self) -> str:
        if self.cpu_mode:
            return self.note or f"No GPU found: {CPU_MODE}."
        parts = []
        for g in self.gpus:
            mem = (f"{(g.free or 0) / 2**30:.1f} of {(g.total or 0) / 2**30:.1f} GiB free" if g.total
                   else "memory unknown")
            cc = f", compute {g.compute_capability}" if g.compute_capability else ""
            parts.append(f"GPU {g.index}: {g.name}, {mem}{cc}")
        drv = f"driver {self.driver}" + (f" (CUDA {self.cuda_driver})" if self.cuda_driver else "")
        return "; ".join(parts) + f"; {drv}" + (" under WSL" if self.wsl else "")

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"cpu_mode": self.cpu_mode, "summary": self.summary()}, indent=2)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def probe(nvml: Any = None) -> Probe:
    """``nvml``: the ``pynvml`` module (tests pass a stand-in)."""
    wsl = _wsl.in_wsl()
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return Probe([], wsl=wsl, note=f"nvidia-ml-py is not installed, so no GPU can be seen: {CPU_MODE}.")
    if wsl:
        _wsl.preload_nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        why = {
            "NVMLError_LibraryNotFound": "no NVIDIA driver is installed (the NVML library is missing)",
            "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
            "NVMLError_NoPermission": "this user may not query the NVIDIA driver",
        }.get(type(exc).__name__, f"the NVIDIA driver did not answer ({_text(exc)})")
        return Probe([], wsl=wsl, note=f"No usable GPU: {why}. {CPU_MODE}.")
    try:
        return _probe_devices(nvml, wsl)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _probe_devices(nvml: Any, wsl: bool) -> Probe:
    def ask(fn: Callable[..., Any], *args: Any, log: list[str] | None = None) -> Any:
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if log is not None:
                log.append(f"{fn.__name__}: {_text(exc)}")
            return None

    driver = ask(nvml.nvmlSystemGetDriverVersion)
    cuda = ask(nvml.nvmlSystemGetCudaDriverVersion)
    count = ask(nvml.nvmlDeviceGetCount) or 0
    gpus = []
    for i in range(count):
        refused: list[str] = []
        handle = ask(nvml.nvmlDeviceGetHandleByIndex, i, log=refused)
        if handle is None:
            gpus.append(GpuInfo(i, "unknown GPU", None, None, None, unsupported=refused))
            continue
        mem = ask(nvml.nvmlDeviceGetMemoryInfo, handle, log=refused)
        cc = ask(nvml.nvmlDeviceGetCudaComputeCapability, handle, log=refused)
        gpus.append(GpuInfo(
            index=i,
            name=_text(ask(nvml.nvmlDeviceGetName, handle, log=refused) or f"GPU {i}"),
            total=int(mem.total) if mem is not None else None,
            free=int(mem.free) if mem is not None else None,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
            uuid=_text(u) if (u := ask(nvml.nvmlDeviceGetUUID, handle, log=refused)) else None,
            unsupported=refused,
        ))
    cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
    result = Probe(gpus, _text(driver) if driver else None, cuda_text, wsl)
    if not gpus:
        result.note = f"The NVIDIA driver {result.driver or ''} reports no GPU: {CPU_MODE}.".replace("  ", " ")
    elif result.cpu_mode:
        result.note = f"The GPU's memory could not be read: {CPU_MODE}."
    return result


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of system RAM."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return total, info.get("MemAvailable", total // 2)


def plan_device(result: Probe) -> Device:
    """The GPU with the most free memory, or the CPU with the available RAM."""
    gpu = result.best()
    if gpu is None:
        total, avail = host_memory()
        return Device("CPU", total, avail, None)
    return Device(gpu.name, gpu.total or 0, gpu.free or 0, gpu.index)


def main() -> int:
    print(probe().to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
