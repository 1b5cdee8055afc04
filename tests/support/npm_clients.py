"""Real agent CLIs from the npm registry, installed once per test session into a temporary prefix,
and the README's server on the embedded model for them to talk to."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .server_process import ROOT, ServerProcess

# the versions the client tests were written against; newer ones may send new fields
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.197"
CODEX = "@openai/codex@0.171.0"


@dataclass
class NpmTool:
    prefix: Path
    bin: Path  # the executable

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        """The process environment for a run: a fresh HOME, the prefix's bin first on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
        env.update(HOME=str(home), PATH=f"{self.bin.parent}{os.pathsep}{env.get('PATH', '')}", **extra)
        return env


def npm_install(spec: str, command: str, prefix: Path, timeout: float = 600.0) -> NpmTool:
    """``npm install spec`` into ``prefix``; skips (with the reason) only when npm is absent."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed on this machine")
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(prefix),
                           spec], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"npm install {spec} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    exe = prefix / "node_modules" / ".bin" / command
    if not exe.exists():
        raise RuntimeError(f"npm install {spec} gave no {command} executable under {prefix}")
    return NpmTool(prefix, exe)


def readme_server(log_path: Path, *flags: str, timeout: float = 600.0) -> ServerProcess:
    """The README's serve command (``./launchers/serve.sh``) on the embedded model, on a free port."""
    return ServerProcess([str(ROOT / "launchers" / "serve.sh"), *flags], log_path, timeout=timeout)
