"""The launcher's options and the ninfer-serve command they resolve to.

``serve.sh [options] [-- more ninfer-serve args]`` and ``ninfer-app`` share these options. An
argument that is not one of them goes to ninfer-serve unchanged, after the planned flags, so a
flag given by hand wins over the plan (argparse keeps the last value). With none of these
options, serve.sh runs ninfer-serve with exactly the arguments it was given.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .settings import AppSettings

# option -> (dest, takes a value)
OPTIONS = {
    "--context": ("context", True), "--concurrency": ("concurrency", True), "--drafts": ("drafts", True),
    "--weights": ("weights", True), "--model": ("model", True), "--share": ("share", False),
    "--print": ("print", False), "--plan": ("plan", False), "--supervise": ("supervise", False),
    "--open": ("open", False), "--stop": ("stop", False), "--stdin-lifetime": ("stdin_lifetime", False),
    "--windows": ("windows", False),
}
PLANNING = {"context", "concurrency", "drafts", "weights", "model", "share", "print", "plan", "supervise"}


@dataclass
class LaunchOptions:
    context: int | None = None
    concurrency: int | None = None
    drafts: int | None = None
    weights: str | None = None
    model: str | None = None
    share: bool = False
    print: bool = False
    plan: bool = False
    supervise: bool = False
    open: bool = False
    stop: bool = False
    stdin_lifetime: bool = False
    windows: bool = False
    given: set[str] = field(default_factory=set)  # which options appeared
    serve_args: list[str] = field(default_factory=list)  # everything else, for ninfer-serve

    @property
    def wants_plan(self) -> bool:
        return bool(self.given & PLANNING)


def _auto_int(name: str, value: str) -> int | None:
    if value == "auto":
        return None
    try:
        n = int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise SystemExit(f"serve.sh: {name} takes a number or 'auto', got {value!r}") from None
    if n < 0:
        raise SystemExit(f"serve.sh: {name} must be >= 0, got {n}")
    return n


def parse_options(argv: list[str]) -> LaunchOptions:
    opts = LaunchOptions()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            opts.serve_args += argv[i + 1:]
            break
        name, eq, inline = arg.partition("=")
        if name not in OPTIONS:
            opts.serve_args.append(arg)
            i += 1
            continue
        dest, takes_value = OPTIONS[name]
        opts.given.add(dest)
        if takes_value:
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise SystemExit(f"serve.sh: {name} needs a value")
            if dest in ("model", "weights"):
                setattr(opts, dest, value)
            else:
                setattr(opts, dest, _auto_int(name, value))
        else:
            setattr(opts, dest, True)
        i += 1
    if opts.weights is not None:
        from .footprint import WEIGHT_BITS

        if opts.weights not in WEIGHT_BITS:
            raise SystemExit(f"serve.sh: --weights must be one of {', '.join(WEIGHT_BITS)}, got {opts.weights!r}")
    return opts


def serve_executable() -> list[str]:
    exe = Path(sys.executable).with_name("ninfer-serve")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("ninfer-serve")
    return [found] if found else [sys.executable, "-m", "ninfer.server.cli"]


def read_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """The flags given by hand, parsed by ninfer-serve's own parser; None where not given."""
    if not serve_args:  # nothing to parse: spare the tray the parser's torch import
        return argparse.Namespace(model=None, device=None, max_context=None, max_concurrency=None,
                                  prefill_chunk=None, host=None, port=None, api_key=None, gpu_memory_gib=None)
    from ..server.cli import build_parser

    parser = build_parser()
    for action in parser._actions:  # noqa: SLF001 - tell given flags from defaults
        action.default = None
    return parser.parse_args(serve_args)


@dataclass
class Resolved:
    command: list[str]
    plan: object | None  # plan.Plan
    base_url: str
    api_key: str | None
    host: str
    port: int


def resolve(opts: LaunchOptions, settings: AppSettings | None = None, probe_result=None) -> Resolved:
    """The full ninfer-serve command: planned flags, then the share flags, then the hand-given ones."""
    from .gpu_probe import plan_device, probe
    from .model_info import load_shape
    from .plan import Want, make_plan
    from .presets import load_presets

    given = read_serve_args(opts.serve_args)
    model = opts.model if "model" in opts.given else (given.model or (settings.model if settings else None))
    result = probe_result if probe_result is not None else probe()
    device = plan_device(result)
    if given.device == "cpu" and device.cuda:
        device = plan_device(type(result)([]))
    elif given.device and given.device.startswith("cuda:") and result.gpus:
        wanted = int(given.device.split(":", 1)[1])
        gpu = next((g for g in result.gpus if g.index == wanted and g.total), None)
        if gpu is not None:
            from .plan import Device

            device = Device(gpu.name, gpu.total, gpu.free or 0, gpu.index)
    if given.gpu_memory_gib is not None and device.cuda:  # planned for the cap the server is held to
        device = device.held_to(given.gpu_memory_gib)
    want = Want(
        lanes=given.max_concurrency or opts.concurrency or (settings.concurrency if settings else None),
        context=given.max_context or opts.context or (settings.context if settings else None),
        drafts=opts.drafts if "drafts" in opts.given else (settings.drafts if settings else None),
        prefill_chunk=given.prefill_chunk, weights=opts.weights, vision=bool(getattr(given, "vision", None)),
    )
    shape = load_shape(model)
    plan = make_plan(shape, device, want, load_presets())
    command = serve_executable()
    if model is not None and given.model is None:
        command.append(str(model))
    command += plan.server_args()
    share = opts.share or bool(settings and settings.share)
    api_key = given.api_key
    if share:
        host = given.host or "0.0.0.0"
        if api_key is None:
            if settings is None:
                raise SystemExit("serve.sh: --share needs an API key: pass -- --api-key KEY")
            api_key = settings.ensure_api_key()
        command += ["--host", host, "--api-key", api_key]
    port = given.port or (settings.port if settings else 8080)
    if settings is not None and given.port is None:
        command += ["--port", str(port)]
    command += opts.serve_args
    host = given.host or ("0.0.0.0" if share else "127.0.0.1")
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return Resolved(command, plan, f"http://{shown}:{port}", api_key, host, port)


def child_env() -> dict[str, str]:
    """CUDA numbers GPUs in NVML's (PCI bus) order, so the probe's index is the server's."""
    return {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTHONUNBUFFERED": "1"}


def shell_line(command: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in command)
