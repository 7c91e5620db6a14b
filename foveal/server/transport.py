"""Connection-level limits for `foveal serve` that uvicorn lacks: a deadline for a request's headers, a cap
on header bytes and a hard cap on open connections. They live in a small subclass of uvicorn's HTTP
protocol (httptools, or h11 where httptools is absent), handed to uvicorn as `Config(http=cls)`.

What uvicorn 0.54 does by itself (uvicorn/protocols/http/httptools_impl.py): its only timer is the
keep-alive one, armed after a response (on_response_complete) and cancelled by any byte received
(data_received), so a connection that sends nothing, or a partial header, is held forever. Its
`limit_concurrency` is checked only once headers are complete (on_headers_complete) and answers 503, so
connections that never finish their headers are never refused. llhttp has no header size limit.
The body's deadline is the app's (foveal.server.body.read_json): headers complete means the app runs."""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # request line + headers; nginx allows 4 x 8 KiB, node 16 KiB


def _canned(status: bytes, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        b"content-length: " + str(len(text)).encode() + b"\r\n\r\n" + text
    )


_REFUSED = _canned(b"503 Service Unavailable", b"server at its connection limit")
_HEADER_TIMEOUT = _canned(b"408 Request Timeout", b"request headers not received in time")
_HEADERS_TOO_LARGE = _canned(b"431 Request Header Fields Too Large", b"request headers too large")


class _Throttled:
    """A warning logged at most once per `every` seconds with the count since the last one: a flood of
    refused connections must not become a flood of log lines."""

    def __init__(self, msg: str, every: float = 10.0):
        self.msg, self.every, self.count, self.last = msg, every, 0, -every

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.warning(self.msg, self.count)
            self.count, self.last = 0, now


_refused = _Throttled("connection limit reached: %d connection(s) refused")


class _Guard:
    """Mixin over a uvicorn HTTP protocol: the connection cap, and the header timer, which runs from
    connection_made and again from each response's end until the next request's headers are complete
    (the subclass calls _disarm() where its parser completes headers). While a request runs it is off."""

    header_timeout: float = 10.0
    max_connections: int | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _in_headers = False  # a request has begun and its headers are not complete (httptools only)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            _refused()
            transport.write(_REFUSED)  # best effort: a client whose request is already sent may see a reset
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.transport.is_closing():  # refused or timed out: ignore what was still in flight
            super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # idle again (no pipelined request started): the next request's headers are on the clock. This
        # also bounds how long uvicorn reads and drops the rest of a body answered early (a 413)
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        self._close(_HEADER_TIMEOUT, f"request headers not complete in {self.header_timeout:g} s")

    def _close(self, response: bytes, why: str) -> None:
        self._disarm()
        if self.transport.is_closing() or self.transport.get_protocol() is not self:  # closed or upgraded
            return
        log.debug("%s: closing connection: %s", self.client, why)  # debug: a slowloris flood is no log flood
        # answer a request whose headers are under way, unless another's response is (pipelining); an
        # idle keep-alive connection gets no stray 408 that its next request could take for its answer
        if self._in_headers and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(response)
        self.transport.close()


def protocol_class(
    header_timeout: float, max_connections: int | None, max_header_bytes: int = MAX_HEADER_BYTES
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol (h11 where httptools is not installed) with the limits above."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class Guarded(_Guard, H11Protocol):
            # h11 caps header size itself (h11_max_incomplete_event_size, 16 KiB: a 400)
            def handle_events(self) -> None:
                scope = self.scope
                super().handle_events()
                if self.scope is not scope:  # an h11.Request event: a new request's headers are complete
                    self._disarm()

    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        class Guarded(_Guard, HttpToolsProtocol):
            _header_bytes = 0

            def on_message_begin(self) -> None:  # a request's first byte (not a dropped body's rest)
                super().on_message_begin()
                self._in_headers, self._header_bytes = True, 0

            def on_headers_complete(self) -> None:
                self._in_headers = False
                self._disarm()
                super().on_headers_complete()

            def data_received(self, data: bytes) -> None:
                counting = self._in_headers  # a chunk that starts a request is not counted: cap + one read
                super().data_received(data)
                if counting and self._in_headers:
                    self._header_bytes += len(data)
                    if self._header_bytes > self.max_header_bytes:
                        self._close(_HEADERS_TOO_LARGE, f"request headers over {self.max_header_bytes} bytes")

    attrs = dict(
        header_timeout=header_timeout, max_connections=max_connections, max_header_bytes=max_header_bytes
    )
    return type("Foveal" + Guarded.__mro__[2].__name__, (Guarded,), attrs)


def uvicorn_config_kwargs(
    header_timeout: float = 10.0,
    keep_alive_timeout: float = 5.0,
    max_connections: int | None = 1024,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> dict:
    """Keyword arguments for uvicorn.run / uvicorn.Config that apply these limits."""
    return dict(
        http=protocol_class(header_timeout, max_connections, max_header_bytes),
        timeout_keep_alive=keep_alive_timeout,
        # uvicorn answers 503 once requests in flight (tasks, which can outlive their connection) reach
        # this; +1 because its check is `>=` and counts this connection, which our cap already allowed
        limit_concurrency=None if max_connections is None else max_connections + 1,
    )
