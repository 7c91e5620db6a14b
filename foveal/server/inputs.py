"""The input work of HTTP requests (chat templates, tokenizing, image processing): never on the model
thread, never on the event loop, and never unbounded. It runs in a pool of its own, each request's job
with a deadline, so one slow input fails alone instead of filling the pool or stalling the streams.

    event loop: await inputs.run(fn, ...)  ── job ──> pool thread: fn(...)
                 deadline passes ──> 400; the job, if still running, gets InputTimeout raised in it

A thread cannot be killed, but Python code in it (Jinja renders chat templates as Python) stops at
the exception raised into it (CPython's PyThreadState_SetAsyncExc). Native code (a Rust tokenizer)
is bounded by size instead: the InputProcessor refuses text that could not fit the context before
tokenizing it. This module owns the pool and the deadline; it does not know what the work is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import threading
import time

log = logging.getLogger(__name__)


class InputTimeout(BaseException):
    """Raised into a job past its deadline. A BaseException, so a library's `except Exception` around
    the work it is doing does not swallow it."""


class InputWorkTooSlow(Exception):
    def __init__(self, seconds: float):
        super().__init__(f"processing the request's input took longer than {seconds:g} s")
        self.seconds = seconds


class _Job:
    __slots__ = ("lock", "thread")

    def __init__(self):
        self.lock = threading.Lock()
        self.thread: int | None = None  # the pool thread running it; None before and after

    def interrupt(self) -> bool:
        with self.lock:
            if self.thread is None:
                return False
            n = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread), ctypes.py_object(InputTimeout)
            )
            return n == 1


class InputWork:
    def __init__(self, workers: int = 8, timeout: float = 10.0):
        self.workers, self.timeout = workers, timeout
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.num_timeouts = 0

    def start(self) -> InputWork:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="foveal-input")
        return self

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) in the pool; InputWorkTooSlow once `timeout` s have passed since the call
        (waiting for a free thread included), with the job stopped where it can be."""
        if self._pool is None:
            self.start()
        job = _Job()

        def work():
            with job.lock:
                job.thread = threading.get_ident()
            try:
                return fn(*args, **kwargs)
            finally:
                # a pending InputTimeout fires at the latest here, still inside this work item
                with job.lock:
                    job.thread = None

        fut = self._pool.submit(work)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
        except TimeoutError:
            fut.cancel()  # not started yet: it never will
            t0 = time.perf_counter()
            stopped = job.interrupt()
            self.num_timeouts += 1
            log.warning(
                "input work past its %g s deadline: %s (%.3f ms)",
                self.timeout,
                "interrupted" if stopped else "not running",
                (time.perf_counter() - t0) * 1e3,
            )
            raise InputWorkTooSlow(self.timeout) from None
