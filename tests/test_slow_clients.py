"""Slow and misbehaving clients against a real uvicorn server (in a thread, on 127.0.0.1) that runs with
foveal.server.transport's limits and a tiny app reading bodies with foveal.server.body.read_json. No model.
Every wait is bounded and generous (a slow 2-core CI box); nothing asserts how fast anything is."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import select
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from foveal.server.body import MAX_DEPTH, ClientLeft, read_json
from foveal.server.errors import APIError, error_response
from foveal.server.protocol import ChatCompletionRequest
from foveal.server.transport import uvicorn_config_kwargs

HEADER_T, BODY_T = 0.5, 1.0
SLACK = 6.0  # on top of any server-side timeout, before a test gives up waiting
log = logging.getLogger("test.slow_clients")


def make_app() -> FastAPI:
    app = FastAPI()

    @app.exception_handler(ClientLeft)
    async def _left(request: Request, e: ClientLeft):
        log.info("client left: %s", e.message)  # what the real app should do: one line, no traceback
        return error_response(e)  # nobody reads it

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.post("/echo")
    async def echo(request: Request):
        data = await read_json(request, max_bytes=1 << 20, timeout=BODY_T)
        if isinstance(data, dict) and "messages" in data:  # validation of what read_json let through
            ChatCompletionRequest.model_validate(data)
        return JSONResponse({"ok": True})

    @app.get("/ping")
    async def ping():
        return {"pong": True}

    @app.get("/sleep")
    async def sleep():
        await asyncio.sleep(HEADER_T * 3)  # a request running past the header timeout must not be cut
        return {"slept": True}

    return app


class Server:
    def __init__(self, **limits):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            make_app(),
            log_config=None,
            lifespan="off",
            timeout_graceful_shutdown=2,
            **uvicorn_config_kwargs(**limits),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=SLACK)

    def get(self, path: str = "/ping") -> tuple[int, dict]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=SLACK)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()

    def post(self, body: bytes) -> tuple[int, dict]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=SLACK)
        try:
            c.request("POST", "/echo", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()


@pytest.fixture(scope="module")
def srv():
    s = Server(header_timeout=HEADER_T, keep_alive_timeout=5.0, max_connections=200)
    yield s
    s.stop()


def read_until_closed(sock: socket.socket, timeout: float) -> bytes | None:
    """Everything the server sends until it closes (EOF or reset); None if still open at `timeout`."""
    deadline, data = time.monotonic() + timeout, b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return data
        except TimeoutError:
            return None
        if not chunk:
            return data
        data += chunk
    return None


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def partial_body(srv: Server, sent: bytes = b'{"a": "xxx', length: int = 1000) -> socket.socket:
    s = srv.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    s.sendall(b"Content-Length: %d\r\n\r\n" % length + sent)
    return s


def test_partial_headers_are_closed_while_others_are_served(srv):
    socks = [srv.connect() for _ in range(50)]
    for s in socks:
        s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and then nothing
    idle = srv.connect()  # connects and never sends a byte
    assert srv.get() == (200, {"pong": True})  # a fresh, well-behaved connection is served meanwhile
    assert srv.post(b'{"x": [1, 2, 3]}') == (200, {"ok": True})
    for s in socks:
        got = read_until_closed(s, HEADER_T + SLACK)
        assert got is not None, "a partial-header connection was still open"
        assert got == b"" or got.startswith(b"HTTP/1.1 408 ")  # best-effort 408 for a first request
        s.close()
    assert read_until_closed(idle, HEADER_T + SLACK) == b""  # closed, and no unsolicited answer
    idle.close()


def test_header_clock_restarts_after_each_response_not_while_a_request_runs(srv):
    s = srv.connect()
    s.sendall(b"GET /sleep HTTP/1.1\r\nHost: x\r\n\r\n")  # runs 3x the header timeout: not cut
    s.settimeout(HEADER_T * 3 + SLACK)
    first = b""
    while b'{"slept":true}' not in first:
        chunk = s.recv(65536)
        assert chunk, "the connection closed while its request was running"
        first += chunk
    assert first.startswith(b"HTTP/1.1 200 ")
    # keep-alive (5 s) would hold this connection; one partial header must not: the header clock runs
    s.sendall(b"GET /ping HTTP/1.1\r\nHo")
    got = read_until_closed(s, HEADER_T + SLACK)
    assert got is not None and (got == b"" or got.startswith(b"HTTP/1.1 408 "))
    s.close()
    # idle after a response: closed too, with no stray 408 a client could take for its next answer
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=SLACK)
    c.request("GET", "/ping")
    assert c.getresponse().read() == b'{"pong":true}'
    assert read_until_closed(c.sock, HEADER_T + SLACK) == b""
    c.close()


def test_header_bytes_are_capped(srv):
    s = srv.connect()
    s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
    try:
        for i in range(200):  # 200 x 1 KiB > 64 KiB, never finishing the headers
            s.sendall(b"X-Pad-%d: %s\r\n" % (i, b"v" * 1000))
    except (ConnectionResetError, BrokenPipeError):
        pass
    got = read_until_closed(s, SLACK)
    assert got is not None and (
        got == b"" or got.startswith((b"HTTP/1.1 431 ", b"HTTP/1.1 400 "))
    )  # 400: h11
    s.close()


def test_partial_bodies_get_408_at_the_body_deadline(srv):
    socks = [partial_body(srv) for _ in range(10)]
    for s in socks:
        got = read_until_closed(s, BODY_T + SLACK)
        assert got is not None, "a partial-body connection was still open"
        status, body = status_and_body(got)
        assert status == 408 and body["error"]["code"] == "body_timeout"
        s.close()


def test_trickled_body_is_cut_at_the_deadline(srv):
    s = partial_body(srv, sent=b"", length=1000)
    deadline, sent = time.monotonic() + BODY_T + SLACK, 0
    while not select.select([s], [], [], 0.2)[0]:  # 1 byte per 0.2 s until the server answers
        assert time.monotonic() < deadline, "the server kept accepting a trickled body"
        s.sendall(b" ")
        sent += 1
    got = read_until_closed(s, SLACK)
    assert got is not None and sent < 1000
    status, body = status_and_body(got)
    assert status == 408 and body["error"]["code"] == "body_timeout"
    s.close()


def test_client_leaving_mid_body_is_one_info_line(srv, caplog):
    caplog.set_level(logging.INFO)
    n = 5
    for _ in range(n):
        partial_body(srv).close()
    deadline = time.monotonic() + SLACK
    while sum("client left" in r.getMessage() for r in caplog.records) < n:
        assert time.monotonic() < deadline, "the app did not notice the clients leaving"
        time.sleep(0.05)
    assert srv.get() == (200, {"pong": True})  # a later request: anything logged for those is in by now
    left = [r for r in caplog.records if "client left" in r.getMessage()]
    assert len(left) == n and all(r.levelno == logging.INFO for r in left)
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.parametrize("open_, close", [("[", "]"), ('{"a":', "}")])
def test_deep_nesting_is_a_400(srv, open_, close):
    for depth in (10_000, MAX_DEPTH + 1):  # past the interpreter's recursion limit, and just past ours
        status, body = srv.post((open_ * depth + "1" * (open_ != "[") + close * depth).encode())
        assert status == 400, body
        assert body["error"]["code"] == "invalid_json" and "nested too deeply" in body["error"]["message"]
    ok = open_ * MAX_DEPTH + "1" * (open_ != "[") + close * MAX_DEPTH
    assert srv.post(ok.encode()) == (200, {"ok": True})


def test_accepted_depth_validates_without_recursion(srv):
    inner = "1"
    for _ in range(MAX_DEPTH - 2):  # + the body's object + chat_template_kwargs: exactly MAX_DEPTH deep
        inner = '{"a":' + inner + "}"
    body = '{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"k":' + inner + "}}"
    assert srv.post(body.encode()) == (200, {"ok": True})
    status, err = srv.post(b'{"a": 1,')
    assert status == 400 and err["error"]["code"] == "invalid_json"
    status, err = srv.post(b"\xff\xfe{")
    assert status == 400 and err["error"]["code"] == "invalid_json"


def test_body_size_cap(srv):
    status, err = srv.post(b"[" + b"1," * (1 << 20) + b"1]")
    assert status == 413 and err["error"]["code"] == "body_too_large"


def test_connections_over_the_cap_are_refused_then_served_again(caplog):
    caplog.set_level(logging.WARNING)
    cap = 4
    srv = Server(header_timeout=30.0, keep_alive_timeout=30.0, max_connections=cap)
    try:
        held = []
        for _ in range(cap):  # a full request each, so the server has surely counted the connection
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=SLACK)
            c.request("GET", "/ping")
            assert c.getresponse().read() == b'{"pong":true}'
            held.append(c)  # kept alive
        for _ in range(3):
            s = srv.connect()
            try:
                s.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            except (ConnectionResetError, BrokenPipeError):
                pass
            got = read_until_closed(s, SLACK)
            assert got is not None and (got == b"" or got.startswith(b"HTTP/1.1 503 "))
            s.close()
        warnings = [r for r in caplog.records if "connection limit" in r.getMessage()]
        assert len(warnings) == 1  # throttled: not one line per refused connection
        for c in held:
            c.close()
        deadline = time.monotonic() + SLACK
        while True:  # the server forgets the closed ones soon after; then it serves again
            try:
                if srv.get() == (200, {"pong": True}):
                    break
            except (ConnectionError, http.client.HTTPException):
                pass
            assert time.monotonic() < deadline, "the server did not serve again after connections closed"
            time.sleep(0.05)
    finally:
        srv.stop()
