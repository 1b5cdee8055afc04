"""serve.sh's front end (--print, pass-through), the Windows launcher's command, and the console
launcher that Start-NInfer.cmd runs inside WSL."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ninfer.app._windows import windows_args, windows_path_to_wsl
from ninfer.app.launch import parse_options
from support.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "launchers" / "serve.sh"
START_CMD = ROOT / "launchers" / "Start-NInfer.cmd"


def serve_sh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SERVE), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def setup_dry_run(tmp_path: Path, mode: str, nvidia_smi: str | None = None, venv: Path | None = None,
                  **env: str) -> str:
    """What ``launchers/setup.sh`` would do for ``mode`` (serve / test), as its stderr, with a fake
    ``nvidia-smi`` (a shell script body) first on PATH; nothing is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + nvidia_smi)
        (bin_dir / "nvidia-smi").chmod(0o755)
    run_env = {k: v for k, v in os.environ.items() if k not in ("NINFER_TORCH", "NINFER_GPU")}
    run_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", NINFER_SETUP_DRY_RUN="1",
                   NINFER_VENV=str(venv or tmp_path / "venv"), **env)
    done = subprocess.run(["bash", "-c", f'source "{ROOT}/launchers/setup.sh" && ninfer_setup {mode}'],
                          capture_output=True, text=True, timeout=120, env=run_env)
    assert done.returncode == 0, done.stderr
    return done.stderr


H200 = 'echo "NVIDIA H200"; echo "NVIDIA H200"\n'  # what --query-gpu=name prints: one line per GPU
NO_DEVICE = 'echo "No devices were found"; exit 6\n'


def flags(line: str) -> dict[str, str]:
    words = shlex.split(line)
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}


def test_print_shows_the_planned_command_and_runs_nothing(qwen_08b_dir):
    from ninfer.app.gpu_probe import host_memory

    if host_memory()[1] < 8 << 30:  # the plan reads this machine's free memory: the 0.8B at fp32 needs ~6 GiB
        pytest.skip("less than 8 GiB of RAM available: the plan would rightly refuse the 0.8B at fp32 here")
    port = free_port()
    done = serve_sh("--print", "--context", "4096", "--concurrency", "2", str(qwen_08b_dir), "--", "--port", str(port))
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    words = shlex.split(line)
    assert words[0].endswith("ninfer-serve") and str(qwen_08b_dir) in words
    f = flags(line)
    assert (f["--max-context"], f["--max-concurrency"], f["--kv-capacity"]) == ("4096", "2", "8192")
    assert f["--port"] == str(port) and f["--device"] in ("cpu", "cuda:0")
    assert "Qwen3.5-0.8B on" in done.stderr and "KV pool 8,192 tokens" in done.stderr  # the plan
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_flags_given_by_hand_come_last_and_win():
    done = serve_sh("--print", "--concurrency", "2", "--prefill-chunk", "256", "--max-context", "6144")
    words = shlex.split(done.stdout.strip())
    assert words[-4:] == ["--prefill-chunk", "256", "--max-context", "6144"]
    assert flags(done.stdout)["--kv-capacity"] == str(2 * 6144)  # planned with the hand-given context


def test_setup_on_an_nvidia_machine_takes_the_gpu_path_and_says_so(tmp_path):
    out = setup_dry_run(tmp_path, "serve", H200)
    assert "setup: GPU path (NVIDIA H200): a CUDA build of torch (torch==2.13.0) and the gpu extra" in out
    assert "would run: python3 -m venv" in out
    assert "pip install -q torch==2.13.0\n" in out and f"pip install -q -e {ROOT}[gpu]\n" in out


def test_setup_replaces_a_cpu_torch_for_the_gpu_path(tmp_path):
    """A venv made before (the tests' own, whose torch is the CPU build) gets a CUDA build."""
    venv = tmp_path / "old-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    out = setup_dry_run(tmp_path, "serve", H200, venv=venv)
    assert "replacing the CPU build of torch" in out and "pip uninstall -q -y torch" in out
    assert "creating" not in out and f"pip install -q -e {ROOT}[gpu]\n" in out


@pytest.mark.parametrize("smi,env,why", [
    (NO_DEVICE, {}, "nvidia-smi lists no GPU"),
    (H200, {"NINFER_GPU": "0"}, "NINFER_GPU=0"),
])
def test_setup_without_a_usable_gpu_takes_the_cpu_path(tmp_path, smi, env, why):
    out = setup_dry_run(tmp_path, "serve", smi, **env)
    assert f"setup: CPU path ({why}): torch==2.13.0" in out
    assert f"pip install -q -e {ROOT}\n" in out and "[gpu]" not in out


def test_ninfer_torch_overrides_the_torch_of_either_path(tmp_path):
    out = setup_dry_run(tmp_path, "serve", H200, NINFER_TORCH="torch==2.11.0")
    assert "GPU path (NVIDIA H200): a CUDA build of torch (torch==2.11.0)" in out
    assert "pip install -q torch==2.11.0\n" in out and "torch==2.13.0" not in out


def test_the_test_setup_is_what_ci_runs_even_beside_a_gpu(tmp_path):
    out = setup_dry_run(tmp_path, "test", H200)
    assert "GPU path" not in out and "[gpu]" not in out
    assert "pip install -q torch==2.13.0\n" in out and f"pip install -q -e {ROOT}[test]\n" in out


def test_a_plan_that_does_not_fit_is_refused(qwen_08b_dir):
    done = serve_sh("--print", "--context", "999999999", str(qwen_08b_dir))
    assert done.returncode == 1 and "does not fit" in done.stderr and done.stdout == ""


def test_plain_ninfer_serve_arguments_pass_through_unchanged():
    ours = serve_sh("--help")
    direct = subprocess.run([sys.executable, "-m", "ninfer.server.cli", "--help"], capture_output=True, text=True)
    assert ours.returncode == 0 and ours.stdout == direct.stdout and "--max-concurrency" in ours.stdout
    opts = parse_options(["--port", "9000", "/models/x", "--tokenizer", "qwen3.6"])
    assert not opts.wants_plan and opts.serve_args == ["--port", "9000", "/models/x", "--tokenizer", "qwen3.6"]


def test_windows_parameters_become_serve_sh_options():
    args, browser = windows_args(["-Context", "65536", "-concurrency", "2", "-DraftTokens", "3", "-Port", "9000",
                                  "-Model", r"C:\models\q.gguf", "-Share", "-NoBrowser", "-LocalOnly"])
    assert args == ["--context", "65536", "--concurrency", "2", "--drafts", "3", "--port", "9000",
                    "--model", "/mnt/c/models/q.gguf", "--share"]
    assert browser is False
    assert windows_args([])[1] is True
    with pytest.raises(SystemExit, match="unknown parameter '-Bogus'"):
        windows_args(["-Bogus"])
    assert windows_path_to_wsl("/home/me/m") == "/home/me/m"


def test_the_command_the_windows_launcher_builds():
    """Start-NInfer.cmd runs `serve.sh --windows PARAMS` inside WSL; with -Print that resolves to
    the ninfer-serve command it would start."""
    text = START_CMD.read_bytes().decode("ascii")
    assert "\r\n" in text and "\n" not in text.replace("\r\n", "")  # cmd.exe wants CRLF
    assert '!NINFER_WSL! --cd "!NINFER_DIR!" -- ./launchers/serve.sh --windows!NINFER_ARGS!' in text
    assert '-- ./launchers/serve.sh --stop' in text  # stops by pid files
    assert "wsl.exe -d !NINFER_DISTRO!" in text
    for banned in ("taskkill", "pkill", "killall", "/IM "):
        assert banned.lower() not in text.lower()
    port = free_port()
    done = serve_sh("--windows", "-Context", "4096", "-Concurrency", "2", "-Port", str(port), "-Print")
    assert done.returncode == 0, done.stderr
    f = flags(done.stdout)
    assert (f["--max-context"], f["--max-concurrency"], f["--port"]) == ("4096", "2", str(port))


@pytest.mark.slow
def test_supervised_console_launcher_serves_refuses_a_second_and_stops(app_home):
    """What Start-NInfer.cmd runs in WSL: the supervised server, addresses printed, one instance,
    and `serve.sh --stop` stopping it through the pid files."""
    port = free_port()
    env = {**os.environ, "NINFER_APP_HOME": str(app_home), "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen([sys.executable, "-m", "ninfer.app.console", "--supervise", "--concurrency", "1",
                              "--", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = first.stdout.readline()
            assert line, "launcher ended:\n" + "".join(lines)
            lines.append(line)
            if "Close this window" in line:
                break
        text = "".join(lines)
        assert "NInfer is ready." in text and f"This computer: http://127.0.0.1:{port}/" in text
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert (app_home / "ninfer-serve.pid").exists() and (app_home / "logs" / "server.log").exists()

        second = subprocess.run([sys.executable, "-m", "ninfer.app.console", "--supervise", "--", "--port",
                                 str(free_port())], env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "already running" in second.stderr

        stop = subprocess.run([sys.executable, "-m", "ninfer.app.console", "--stop"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0 and "NInfer: stopped" in stop.stdout
        assert first.wait(30) == 0
        assert "NInfer: stopping the server" in first.stdout.read()
        assert not (app_home / "ninfer-serve.pid").exists()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
