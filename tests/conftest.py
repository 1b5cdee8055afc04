"""Suite-wide settings: fixed seeds, and no silent 'no tests ran'."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Triton's interpreter pass (launchers/test.sh) runs tests/interp alone; the main pass leaves it out.
collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interp"]
# Servers started through launchers/serve.sh keep the set-up the tests run in: on an NVIDIA machine
# too, no test starts the GPU path's install (a CUDA torch, fla-core) in the tests' .venv.
os.environ.setdefault("NINFER_GPU", "0")
# Per-install files (the Responses reasoning key) go to a data directory of the test run's own,
# not the home of whoever runs the tests; servers started as processes inherit it.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="ninfer-test-data-")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # pytest exits 5 when it collected nothing; a suite that ran nothing has failed.
    if session.testscollected == 0 or exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _few_threads():
    """Tiny tensors gain nothing from intra-op threads; on a busy 2-core machine they spin-wait."""
    torch.set_num_threads(1)


@pytest.fixture
def set_launch():
    """``set_launch(base=None, **changes)``: kernel launch settings in force for this test
    (``base``, default those in force, with ``changes``); the ones before are put back after."""
    from ninfer.engine import launch

    before = launch.current()

    def apply(base=None, **changes):
        launch.use((base or launch.current()).changed(**changes))
        return launch.current()

    yield apply
    launch.use(before)
