"""EngineLoop: owns THE model thread and bridges it to asyncio callers.

    caller (event loop)                       model thread
    submit() ── requests ─> commands queue ──> drained between steps -> engine.add_request
    abort()  ── _Abort  ──>                                            -> engine.abort
    RequestStream.queue <── one call_soon_threadsafe per event loop per iteration <── step() deltas

Every engine call happens on the model thread, so the engine stays single-threaded. A stream's first
item is `ADMITTED` or a `StreamError` (the HTTP layer answers 4xx before any header is sent); then
`(choice_index, TokenDelta)` pairs until every choice has a final delta, or a `StreamError` if the loop
dies or shuts down. When idle the thread blocks on the command queue. Requests arrive processed
(`EngineRequest`s from the InputProcessor, n already expanded): no input work runs here. `drain()`
stops admissions and, at its deadline, ends every open request with a final error; any exit of the
thread marks the loop dead and ends them too.
This module must not import HTTP code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from foveal.engine.factory import freeze_startup_heap
from foveal.metrics import FanoutSink, MetricsSink, RequestStats
from foveal.request import EngineRequest, FinishReason, TokenDelta

log = logging.getLogger(__name__)

ADMITTED = "admitted"


class ErrorKind(StrEnum):
    """Why a stream failed, in the engine's words; the server maps each to its protocol's status
    (server/errors.py: 400, 429, 503, 504, 500). The values are OpenAI's error types."""

    INVALID_REQUEST = "invalid_request_error"  # the request's own fault (a bad id, too long for the pool)
    QUEUE_FULL = "rate_limit"  # too many requests waiting: retry later
    UNAVAILABLE = "unavailable"  # draining, shutting down or dead
    TIMEOUT = "timeout"  # no output within the request's timeout
    SERVER = "server_error"


@dataclass(slots=True)
class StreamError:
    message: str
    kind: ErrorKind = ErrorKind.SERVER

    @property
    def type(self) -> str:
        return self.kind.value


class StreamFailed(Exception):
    def __init__(self, err: StreamError):
        super().__init__(err.message)
        self.error = err


class RequestStream:
    """The caller's side of one request: an asyncio.Queue owned by the caller's event loop."""

    def __init__(
        self, request_id: str, num_choices: int, loop: asyncio.AbstractEventLoop, timeout: float | None
    ):
        self.request_id = request_id
        self.num_choices = num_choices
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = loop
        self.timeout = timeout
        self.finished = False
        self.model: str | None = None  # the served name its responses carry (a LoRA adapter's), or None

    async def _get(self):
        try:
            return await asyncio.wait_for(self.queue.get(), self.timeout)
        except TimeoutError:
            raise StreamFailed(
                StreamError(f"request timed out after {self.timeout} s without output", ErrorKind.TIMEOUT)
            ) from None

    async def admitted(self) -> None:
        """Wait for admission; raises StreamFailed carrying the 4xx/5xx error."""
        item = await self._get()
        if isinstance(item, StreamError):
            self.finished = True
            raise StreamFailed(item)

    async def deltas(self):
        """Yield (choice index, TokenDelta) until every choice finished; StreamFailed on a loop error.
        Deltas that queued up while the caller was busy come merged, one per choice: a slow consumer
        (many streams on one event loop) does work per wake-up, not per token, and never falls behind."""
        left = self.num_choices
        while left:
            items = [await self._get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            merged: dict[int, TokenDelta] = {}
            failed = None
            for item in items:
                if isinstance(item, StreamError):
                    failed = item
                    break
                index, delta = item
                prev = merged.get(index)
                merged[index] = prev.then(delta) if prev is not None else delta
            for index, delta in merged.items():
                if delta.finished:
                    left -= 1
                yield index, delta
            if failed is not None:
                self.finished = True
                raise StreamFailed(failed)
        self.finished = True


@dataclass(slots=True)
class _Open:
    stream: RequestStream
    sub_ids: list[str]
    stats: RequestStats
    left: int
    reasons: list[str] = field(default_factory=list)
    error: str | None = None


class EngineLoop:
    """The one thread that calls the engine. `start()` starts it; the constructor does no work."""

    def __init__(self, engine, max_queued_requests: int | None = None, sink: MetricsSink | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.sink = sink or FanoutSink()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._open: dict[str, _Open] = {}  # HTTP request id -> state (model thread only)
        self._sub: dict[str, tuple[str, int]] = {}  # engine request id -> (HTTP id, choice index)
        self.state = "loading"  # loading | ready | draining | dead | stopped
        self.dead_reason: str | None = None
        self._stop = False
        # items for the callers' queues, gathered over one loop iteration and handed to each event
        # loop in one call_soon_threadsafe (one wake-up per step, not one per token per stream)
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}

    # -- caller side (any thread) -----------------------------------------------------------------
    def start(self) -> EngineLoop:
        from foveal import native

        native.release_openmp_threads()  # the model was built on this thread; it runs on the new one
        freeze_startup_heap()  # the server's own start-up objects too
        self._thread = threading.Thread(target=self._run, name="foveal-engine", daemon=True)
        self.state = "ready"
        self._thread.start()
        return self

    def submit(
        self,
        request_id: str,
        choices: list[EngineRequest],
        *,
        streaming: bool = False,
        timeout: float | None = None,
        tenant: str | None = None,
    ) -> RequestStream:
        """Queue one request of one or more choices (sequences, each its own EngineRequest; choice i of
        the stream is choices[i]). Must be called from a running event loop; the stream belongs to it."""
        stream = RequestStream(request_id, len(choices), asyncio.get_running_loop(), timeout)
        if self.state == "ready" and self._thread is not None and not self._thread.is_alive():
            self._died("the model thread exited")
        limit = self.max_queued_requests
        if limit is not None and len(choices) > limit:  # can never fit the queue: not a retry-later
            why = f"{len(choices)} sequences (prompts x n) in one request; this server queues at most {limit}"
            stream.queue.put_nowait(StreamError(why, ErrorKind.INVALID_REQUEST))
            return stream
        if self.state != "ready":
            why = self.dead_reason if self.state == "dead" else f"the server is {self.state}"
            stream.queue.put_nowait(StreamError(f"not accepting requests: {why}", ErrorKind.UNAVAILABLE))
            return stream
        adapter = choices[0].lora.name if choices and choices[0].lora is not None else None
        stream.model = adapter
        stats = RequestStats(request_id, streaming=streaming, tenant=tenant, adapter=adapter)
        self._cmds.put(("submit", stream, list(choices), stats))
        return stream

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn(engine)` on the model thread between steps (e.g. a cache reset); a Future holds the
        result or the exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.state not in ("ready", "draining"):
            fut.set_exception(RuntimeError(f"the engine is {self.state}"))
        else:
            self._cmds.put(("call", fn, fut))
        return fut

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its choices). Idempotent; safe before admission and after finish."""
        self._cmds.put(("abort", request_id))

    @property
    def num_open(self) -> int:
        return len(self._open)

    def drain(self, timeout: float) -> int:
        """Stop admitting (state "draining"); let open requests finish for up to `timeout` s; then end
        every one still open with a final error (503) and free its blocks. Returns how many were cut.
        Blocks the calling thread (not the model thread)."""
        if self.state == "ready":
            self.state = "draining"
        if self._thread is None:
            return 0
        deadline = time.monotonic() + timeout
        while self._open and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        if not self._open or not self._thread.is_alive():
            return 0
        done = threading.Event()
        cut = [0]
        err = StreamError(
            f"the server is shutting down (drain timeout of {timeout:g} s)", ErrorKind.UNAVAILABLE
        )
        self._cmds.put(("cut", err, cut, done))
        done.wait(10)
        return cut[0]

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting; let running requests finish for up to drain_timeout s; end the rest with an
        error; stop the model thread."""
        if self._thread is None:
            self.state = "stopped"
            return
        self.drain(drain_timeout)
        self._cmds.put(("stop",))
        self._thread.join(timeout=10)
        if self.state != "dead":
            self.state = "stopped"
        if not self._thread.is_alive():
            # let the engine (weights, KV pool) go with its thread: the app's route functions close over
            # this loop, and FastAPI keeps route functions in module-level caches past the app's life
            self.engine = None
        gc.unfreeze()  # what start() froze may be garbage now (a process that starts another engine)

    # -- model thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                busy = eng.has_unfinished()
                cmds = []
                if not busy:
                    cmds.append(self._cmds.get())  # idle: block, no busy spin
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                for c in cmds:
                    self._handle(c)
                if self._stop:
                    break
                if eng.has_unfinished():
                    self._flush()  # admissions and rejections go out before the step runs
                    deltas = eng.step()
                    now = time.perf_counter()
                    for d in deltas:
                        self._deliver(d, now)
                    self._report_step()
                self._flush()
        except BaseException as e:  # the engine isolates per-request faults; reaching here is fatal
            # (a BaseException too: a Rust panic in a tokenizer is one, and a thread that dies quietly
            # leaves /health "ready" and every stream waiting forever)
            log.exception("engine loop died")
            self._died(f"engine failed: {type(e).__name__}: {e}")
        try:
            why = self.dead_reason or "the server is shutting down"
            self._close_all(StreamError(why, ErrorKind.UNAVAILABLE))
        except BaseException:
            log.exception("closing the open requests failed")
            self._died(self.dead_reason or "closing the open requests failed")

    def _died(self, reason: str) -> None:
        self.dead_reason = reason
        self.state = "dead"

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "submit":
            self._admit(*cmd[1:])
        elif kind == "abort":
            o = self._open.get(cmd[1])
            if o is not None:
                for sid in o.sub_ids:
                    self.engine.abort(sid)  # its final ABORT delta comes from the next step
        elif kind == "stop":
            self._stop = True
        elif kind == "cut":  # the drain deadline: end every open request now
            err, cut, done = cmd[1:]
            cut[0] = len(self._open)
            self._end_open(err)
            done.set()
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:
                fut.set_exception(e)

    def _admit(self, stream: RequestStream, choices: list[EngineRequest], stats: RequestStats) -> None:
        rid = stream.request_id
        if rid in self._open:
            return self._push(
                stream, StreamError(f"request id {rid!r} is already in use", ErrorKind.INVALID_REQUEST)
            )
        eng = self.engine
        limit = self.max_queued_requests
        if limit is not None and eng.num_waiting + len(choices) > max(limit, 1):
            self._push(stream, StreamError("too many queued requests; retry later", ErrorKind.QUEUE_FULL))
            log.info("%s rejected: queue full (%d waiting)", rid, eng.num_waiting)
            return
        sub_ids: list[str] = []
        try:
            for ch in choices:
                sub_ids.append(eng.add_request(ch))
        except Exception as e:  # an id in use: 400, nothing stays admitted
            for sid in sub_ids:
                eng.abort(sid)
            self._flush_aborted(sub_ids)
            msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            log.info("%s rejected: %s", rid, msg)
            return self._push(stream, StreamError(msg, ErrorKind.INVALID_REQUEST))
        for i, sid in enumerate(sub_ids):
            self._sub[sid] = (rid, i)
        self._open[rid] = _Open(stream, sub_ids, stats, len(sub_ids))
        log.info("%s admitted: %d choice(s)", rid, len(sub_ids))
        self._safe(self.sink.request_started, stats)
        self._push(stream, ADMITTED)

    def _flush_aborted(self, sub_ids: list[str]) -> None:
        # Aborted-at-admission sequences produce final deltas on the next step; mark them as orphans.
        for sid in sub_ids:
            self._sub[sid] = ("", -1)

    def _deliver(self, d: TokenDelta, now: float) -> None:
        rid, index = self._sub.get(d.request_id, ("", -1))
        o = self._open.get(rid)
        if o is None:
            if d.finished:
                self._sub.pop(d.request_id, None)
            return
        st = o.stats
        if d.token_ids:
            if st.first_token is None:
                st.first_token = now
            st.last_token = now
            st.token_times.append(now)
            self._safe(self.sink.token, st, now, len(d.token_ids))
        self._push(o.stream, (index, d))
        if not d.finished:
            return
        self._sub.pop(d.request_id, None)
        o.left -= 1
        st.num_prompt_tokens += d.num_prompt_tokens
        st.num_output_tokens += d.num_output_tokens
        st.num_images += d.num_images
        st.num_cached_tokens += d.num_cached_tokens
        st.encoder_time_s += d.encoder_time_s
        o.reasons.append(d.finish_reason.value)
        if d.error:
            o.error = d.error
            log.warning("%s: choice %d failed: %s", rid, index, d.error)
        if o.left == 0:
            del self._open[rid]
            st.finished = now
            st.error = o.error
            bad = [r for r in o.reasons if r in (FinishReason.ERROR.value, FinishReason.ABORT.value)]
            st.finish_reason = bad[0] if bad else o.reasons[0]
            outcome = {"error": "failed", "abort": "aborted"}.get(st.finish_reason, "completed")
            log.info(
                "%s finished: %s, %d prompt + %d completion tokens, %.3f s",
                rid,
                st.finish_reason,
                st.num_prompt_tokens,
                st.num_output_tokens,
                st.request_time,
            )
            self._safe(self.sink.request_finished, st, outcome)

    def _report_step(self) -> None:
        self._safe(self.sink.step, self.engine.report())

    def _close_all(self, err: StreamError) -> None:
        """No stream is ever left without a final event."""
        self._end_open(err)
        try:  # drain the queued ABORT deltas so the engine holds nothing
            if self.state != "dead":
                self.engine.step() if self.engine.has_unfinished() else None
        except Exception:
            log.exception("final step failed")
        while True:  # submissions that raced with the stop get a final error too
            try:
                c = self._cmds.get_nowait()
            except queue.Empty:
                break
            if c[0] == "submit":
                self._push(c[1], err)
            elif c[0] == "cut":
                c[3].set()
            elif c[0] == "call":
                c[2].set_exception(RuntimeError(f"the engine stopped: {err.message}"))
        self._flush()

    def _end_open(self, err: StreamError) -> None:
        """Abort every open request and give each stream `err` as its final item (model thread)."""
        for rid, o in list(self._open.items()):
            for sid in o.sub_ids:
                try:
                    self.engine.abort(sid)
                except Exception:
                    log.exception("%s: abort during close failed", rid)
                self._sub.pop(sid, None)
            o.stats.finished = time.perf_counter()
            o.stats.error = err.message
            o.stats.finish_reason = "error"
            self._safe(self.sink.request_finished, o.stats, "failed")
            self._push(o.stream, err)
            log.info("%s ended: %s", rid, err.message)
        self._open.clear()
        self._flush()

    def _push(self, stream: RequestStream, item) -> None:
        self._outbox.setdefault(stream.loop, []).append((stream.queue, item))

    def _flush(self) -> None:
        box, self._outbox = self._outbox, {}
        for loop, items in box.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass

    @staticmethod
    def _safe(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("metrics sink failed")


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
