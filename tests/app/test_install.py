"""installers/install.sh into a temporary prefix (no model download), then its entry points run."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_install_sh_into_a_temporary_prefix(tmp_path, app_home):
    prefix, bin_dir = tmp_path / "prefix", tmp_path / "bin"
    env = {**os.environ, "HOME": str(tmp_path / "home"), "XDG_DATA_HOME": str(tmp_path / "share"),
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "NINFER_APP_HOME": str(app_home)}
    # --torch-from: share this interpreter's torch instead of downloading another
    done = subprocess.run(["bash", str(ROOT / "installers" / "install.sh"), "--prefix", str(prefix), "--bin-dir",
                           str(bin_dir), "--torch-from", sys.executable, "--autostart"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "install: done" in done.stderr

    venv_python = prefix / "venv" / "bin" / "python"
    where = subprocess.run([str(venv_python), "-c", "import ninfer, sys; print(ninfer.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert str(prefix / "venv") in where  # the installed copy, not this checkout

    app = subprocess.run([str(bin_dir / "ninfer-app"), "--help"], env=env, capture_output=True, text=True)
    assert app.returncode == 0 and "tray launcher" in app.stdout
    serve = subprocess.run([str(bin_dir / "ninfer-serve"), "--help"], env=env, capture_output=True, text=True)
    assert serve.returncode == 0 and "--max-concurrency" in serve.stdout
    printed = subprocess.run([str(bin_dir / "ninfer-app"), "--print"], env=env, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    command = shlex.split(printed.stdout.strip())
    assert command[0] == str(prefix / "venv" / "bin" / "ninfer-serve") and "--max-context" in command
    probe = subprocess.run([str(bin_dir / "ninfer-app"), "--probe"], env=env, capture_output=True, text=True)
    assert probe.returncode == 0 and '"cpu_mode"' in probe.stdout

    entry = (tmp_path / "share" / "applications" / "ninfer.desktop").read_text()
    assert f"Exec={bin_dir}/ninfer-app" in entry and f"Icon={prefix}/ninfer.png" in entry
    assert (prefix / "ninfer.png").stat().st_size > 500
    assert (tmp_path / "config" / "autostart" / "ninfer.desktop").read_text() == entry
