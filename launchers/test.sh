#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite: ./launchers/test.sh [pytest arguments]
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ninfer_setup test
cd "$NINFER_ROOT"
exec "$NINFER_VENV/bin/python" -m pytest tests "$@"
