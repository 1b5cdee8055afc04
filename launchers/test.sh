#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite: ./launchers/test.sh [pytest arguments]
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
ninfer_setup test
cd "$NINFER_ROOT"
status=0
"$NINFER_VENV/bin/python" -m pytest tests "$@" || status=$?
whole=1  # options only (-q, -x, ...): the whole suite, so also the interpreter pass
for arg in "$@"; do [[ "$arg" == -* ]] || whole=0; done
if [ "$whole" = 1 ]; then  # the Triton kernels under Triton's CPU interpreter
    TRITON_INTERPRET=1 "$NINFER_VENV/bin/python" -m pytest tests/interp "$@" || status=$?
fi
exit "$status"
