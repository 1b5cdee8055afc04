#!/usr/bin/env bash
# Set up (first run only) and start the NInfer server.
#   ./launchers/serve.sh [ninfer-serve arguments]
# With no arguments it serves the embedded default model at http://127.0.0.1:8080.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ninfer_setup serve
exec "$NINFER_VENV/bin/ninfer-serve" "$@"
