"""The chat window: pywebview in its own process (``python -m ninfer.app.window URL``), the default
browser when pywebview is missing or cannot open a window. Also opening files and choosing a model.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import webbrowser

from . import _wsl

NO_WEBVIEW = 3  # exit code: pywebview is not installed or has no GUI backend here
WEBVIEW_GRACE_S = 4.0  # a webview that dies within this is taken as "cannot open"


def open_browser(url: str) -> None:
    if not (_wsl.in_wsl() and _wsl.open_in_windows(url)):
        webbrowser.open(url)


def open_window(url: str) -> subprocess.Popen | None:
    """Start the pywebview window; fall back to the browser when it exits at once."""
    if _wsl.in_wsl():  # WSLg windows are second-class: the Windows browser is the better window
        open_browser(url)
        return None
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.app.window", url], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + WEBVIEW_GRACE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            open_browser(url)
            return None
        time.sleep(0.1)
    return proc


def open_path(path: str) -> None:
    if _wsl.in_wsl() and shutil.which("wslpath"):
        win = subprocess.run(["wslpath", "-w", path], capture_output=True, text=True).stdout.strip()
        if win and shutil.which("notepad.exe"):
            subprocess.Popen(["notepad.exe", win], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
    for opener in ("xdg-open", "open"):
        if shutil.which(opener):
            subprocess.Popen([opener, path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
    webbrowser.open("file://" + os.path.abspath(path))


def choose(kind: str) -> str | None:
    """Ask for a checkpoint folder (``kind="folder"``) or a GGUF file (``"gguf"``), in a child process."""
    try:
        out = subprocess.run([sys.executable, "-m", "ninfer.app.window", "--choose", kind], capture_output=True,
                             text=True, timeout=3600).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None


def _choose_here(kind: str) -> str:
    try:
        import tkinter as tk
        from tkinter import filedialog
    except ImportError:
        tk = None
    if tk is not None and (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        root = tk.Tk()
        root.withdraw()
        if kind == "folder":
            path = filedialog.askdirectory(title="Checkpoint folder (with config.json)")
        else:
            path = filedialog.askopenfilename(title="GGUF file", filetypes=[("GGUF", "*.gguf"), ("All", "*")])
        root.destroy()
        return path or ""
    if shutil.which("zenity"):
        args = ["--directory"] if kind == "folder" else ["--file-filter=*.gguf"]
        return subprocess.run(["zenity", "--file-selection", *args], capture_output=True, text=True).stdout.strip()
    return ""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--choose"]:
        print(_choose_here(argv[1] if len(argv) > 1 else "folder"))
        return 0
    url = argv[0] if argv else "http://127.0.0.1:8080/"
    try:
        import webview
    except ImportError:
        return NO_WEBVIEW
    try:
        webview.create_window("NInfer", url, width=1100, height=800)
        webview.start()
    except Exception:  # no GTK / Qt backend: the caller opens the browser instead
        return NO_WEBVIEW
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
