"""Running inside WSL: finding the NVML library, opening Windows' browser, Windows' own addresses."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

WSL_LIB = Path("/usr/lib/wsl/lib/libnvidia-ml.so.1")


def in_wsl() -> bool:
    if os.environ.get("WSL_DISTRO_NAME"):
        return True
    try:
        return "microsoft" in Path("/proc/sys/kernel/osrelease").read_text().lower()
    except OSError:
        return False


def preload_nvml() -> None:
    """WSL keeps the driver's libraries in /usr/lib/wsl/lib, which is not always on the loader path;
    loading it once by full path lets ``pynvml`` find it by its soname."""
    if WSL_LIB.is_file():
        try:
            ctypes.CDLL(str(WSL_LIB), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass


def open_in_windows(url: str) -> bool:
    """Open ``url`` in the Windows default browser through WSL interop; False when there is none."""
    for cmd in (["wslview", url], ["explorer.exe", url], ["cmd.exe", "/c", "start", "", url.replace("&", "^&")]):
        if shutil.which(cmd[0]):
            try:
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 cwd="/mnt/c" if os.path.isdir("/mnt/c") else None)
                return True
            except OSError:
                continue
    return False


_IPV4 = re.compile(r"IPv4[^:]*:\s*([0-9.]+)")


def windows_addresses() -> list[str]:
    """IPv4 addresses of the Windows host (from ``ipconfig.exe``), the ones other devices can use
    when WSL runs with mirrored networking or a port proxy."""
    exe = shutil.which("ipconfig.exe")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe], capture_output=True, timeout=10).stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [a for a in _IPV4.findall(out) if not a.startswith(("127.", "169.254."))]


def networking_mode() -> str:
    """"mirrored" (the Windows addresses reach this server), "nat" or "unknown"."""
    exe = shutil.which("wslinfo")
    if exe is None:
        return "unknown"
    try:
        out = subprocess.run([exe, "--networking-mode"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.strip() or "unknown"
