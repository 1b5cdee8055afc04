"""The ``NINFER_PDL`` switch of the decode kernels' programmatic dependent launch."""
import os
import subprocess
import sys

import pytest


def _mode(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NINFER_PDL"}
    if value is not None:
        env["NINFER_PDL"] = value
    return subprocess.run([sys.executable, "-c", "from ninfer.engine.layers import pdl; print(pdl.MODE)"],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value, mode", [(None, 2), ("", 2), ("late", 2), ("LATE", 2), ("1", 1), ("0", 0),
                                         ("off", 0)])
def test_pdl_setting(value, mode):
    """Late release unless told otherwise; 1 releases first; 0 / off turns it off."""
    run = _mode(value)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(mode)


def test_pdl_setting_rejects_unknown_values():
    run = _mode("yes")
    assert run.returncode != 0
    assert "NINFER_PDL='yes': expected late (the default), 1, or 0 / off" in run.stderr
