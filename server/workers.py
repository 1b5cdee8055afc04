"""Bounded worker threads for the per-request work too heavy for the event loop.

Parsing and validating a large JSON body, rendering a chat template and tokenizing a prompt take
time in proportion to the request (a 30 MiB prompt: seconds). Run on the event loop, they stall
every other request, ``/health`` included; here they run on a few threads owned by the server
state (``--prepare-threads``) while the loop goes on serving. Tokenizers release the GIL while they
encode, and long prompts' ids are made in slices that let others take it, so the engine keeps its
pace too. On Linux the threads run at a lower priority (``PRIORITY_DROP``): on a machine of few
cores a long preparation takes the cores the engine and the event loop leave idle, not theirs. A request waiting for a thread that is cancelled
(its client left) is dropped from the queue; one already running finishes and its result is
dropped.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from fastapi.exceptions import RequestValidationError

from .errors import APIError

T = TypeVar("T")
DEFAULT_THREADS = 4  # two long requests (a large /tokenize, say) leave two for the rest
PRIORITY_DROP = 10  # the workers' nice value above the process's: about a tenth of a core's share under contention


class PrepareWorkers:
    def __init__(self, threads: int = DEFAULT_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"--prepare-threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ninfer-prepare", initializer=_lower_priority)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread, in the caller's context (its context variables)."""
        call = functools.partial(contextvars.copy_context().run, _refusing_lightly, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        """Start no more work; what runs finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """This worker thread's scheduling priority lowered by ``PRIORITY_DROP`` (Linux, where a
    thread has a nice value of its own; elsewhere it would be the whole process's)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           min(19, os.getpriority(os.PRIO_PROCESS, 0) + PRIORITY_DROP))
        except OSError:  # a sandbox that refuses it: the thread runs as before
            pass


def _refusing_lightly(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``; a refusal leaves without its traceback, whose frames may hold what a large
    request was made into (a prompt's millions of token ids): freed here, not on the event loop."""
    try:
        return fn(*args)
    except (APIError, RequestValidationError) as exc:
        raise exc.with_traceback(None) from exc.__cause__
