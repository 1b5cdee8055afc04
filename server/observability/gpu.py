"""GPU telemetry through NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("ninfer.stats")


class GpuTelemetry:
    """Per-GPU memory, utilisation and temperature through NVML (``nvidia-ml-py``), if present.

    Without the package, a driver or a GPU the list is empty. Readings are cached for a second."""

    TTL_S = 1.0

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] | None = None  # None: not initialised yet; []: unavailable
        self._cached: list[dict[str, Any]] = []
        self._at = 0.0
        self._lock = threading.Lock()

    def _init(self) -> None:
        self._handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # noqa: BLE001 - no package, no driver, no device: no telemetry
            log.debug("GPU telemetry unavailable: %s", exc)

    def read(self) -> list[dict[str, Any]]:
        with self._lock:
            if self._handles is None:
                self._init()
            if not self._handles:
                return []
            now = time.monotonic()
            if now - self._at >= self.TTL_S:
                self._cached = [self._read_one(i, h) for i, h in enumerate(self._handles)]
                self._at = now
            return [dict(g) for g in self._cached]

    def _read_one(self, index: int, handle: Any) -> dict[str, Any]:
        nv = self._nvml
        name = nv.nvmlDeviceGetName(handle)
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        out = {
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "memory_used_bytes": int(mem.used),
            "memory_total_bytes": int(mem.total),
            "utilization_pct": None,
            "temperature_c": None,
        }
        try:
            out["utilization_pct"] = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # noqa: BLE001 - not supported on every device (MIG, some vGPUs)
            pass
        try:
            out["temperature_c"] = float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
        except Exception:  # noqa: BLE001
            pass
        return out
