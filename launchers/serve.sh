#!/usr/bin/env bash
# Set up (first run only) and start the NInfer server.
#   ./launchers/serve.sh [options] [-- more ninfer-serve arguments]
# With no arguments it serves the embedded default model at http://127.0.0.1:8080; arguments that
# are not serve.sh's own options go to ninfer-serve unchanged.
# Options (app/console.py): --context N, --concurrency N, --drafts N, --weights FMT, --model PATH
# (settings that fit the GPU are planned for the rest), --share (all interfaces, API key),
# --print (show the resolved ninfer-serve command, run nothing), --plan (also show the memory
# plan), --supervise (restart on crashes, logs in the user's data directory), --open, --stop.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ninfer_setup serve
exec "$NINFER_VENV/bin/python" -m ninfer.app.console "$@"
