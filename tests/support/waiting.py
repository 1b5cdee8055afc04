"""Polling until something a test started has happened."""
from __future__ import annotations

import time
from typing import Callable


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Whether ``predicate()`` turned true within ``timeout`` seconds, asked every ``interval``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "the condition") -> None:
    """Like :func:`wait_for`, failing the test with ``what`` on a timeout."""
    if not wait_for(predicate, timeout):
        raise AssertionError(f"timed out waiting for {what}")
