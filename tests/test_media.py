"""foveal.server.media: every URL form, every refusal, and decoding edge cases. Network tests use a
ThreadingHTTPServer on 127.0.0.1 (random port); host resolution is faked where a test needs a name."""

from __future__ import annotations

import base64
import datetime
import io
import ipaddress
import random
import socket
import ssl
import struct
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image

from foveal.server import media
from foveal.server.media import MediaError, MediaLimits, image_hash, load_image

OPEN = MediaLimits(allow_private_urls=True)


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def header_only_png(w: int, h: int) -> bytes:
    """A ~60-byte PNG whose IHDR claims w x h: decoding it for real would allocate w*h*3 bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 16))
        + chunk(b"IEND", b"")
    )


RED = Image.new("RGB", (8, 6), (255, 0, 0))
RED_PNG = encode(RED)


def refused(url: str, limits: MediaLimits = OPEN) -> str:
    with pytest.raises(MediaError) as e:
        load_image(url, limits)
    return str(e.value)


# ---- data: URLs and decoding ----


def test_png_data_url():
    img = load_image(data_url(RED_PNG), MediaLimits())
    assert (img.size, img.mode, img.getpixel((0, 0))) == ((8, 6), "RGB", (255, 0, 0))


def test_jpeg_data_url():
    img = load_image(data_url(encode(RED, "JPEG"), "image/jpeg"), MediaLimits())
    assert (img.size, img.mode) == ((8, 6), "RGB")
    r, g, b = img.getpixel((3, 3))
    assert r > 240 and g < 15 and b < 15


@pytest.mark.parametrize(
    "url",
    [
        "data:;base64," + base64.b64encode(RED_PNG).decode(),
        "data:application/octet-stream;base64," + base64.b64encode(RED_PNG).decode(),
        "DATA:IMAGE/PNG;BASE64," + base64.b64encode(RED_PNG).decode(),
        "data:image/png;base64," + base64.encodebytes(RED_PNG).decode(),  # line breaks every 76 chars
        "data:image/png;base64," + base64.b64encode(RED_PNG).decode().rstrip("="),  # stripped padding
        "data:image/png;base64," + base64.urlsafe_b64encode(RED_PNG).decode(),
        "data:image/png;base64," + base64.b64encode(RED_PNG).decode().replace("+", "%2B").replace("/", "%2F"),
    ],
    ids=["no-mime", "octet-stream", "upper-case", "line-breaks", "no-padding", "urlsafe", "percent-encoded"],
)
def test_data_url_variants(url):
    assert image_hash(load_image(url, MediaLimits())) == image_hash(RED)


@pytest.mark.parametrize(
    "url, expect",
    [
        ("data:image/png," + "x" * 20, "base64"),
        ("data:text/plain;base64," + base64.b64encode(RED_PNG).decode(), "not an image"),
        ("data:image/png;base64,!!!not*base64!!!", "not valid base64"),
        ("data:image/png;base64,", "no data"),
        ("data:" + "x" * 1000, "malformed data URL"),
    ],
    ids=["not-base64", "text-mime", "bad-base64", "empty", "no-comma"],
)
def test_bad_data_urls(url, expect):
    assert expect in refused(url, MediaLimits())


def test_not_an_image():
    assert "not a valid image" in refused(data_url(b"hello"))


def test_eps_is_not_decoded():
    # EPS decoding shells out to Ghostscript: outside the format allow-list, so "not a valid image"
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"
    assert "not a valid image" in refused(data_url(eps, "image/eps"))


def test_truncated_png():
    noise = Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3))
    png = encode(noise)
    assert len(png) > 10_000
    assert "corrupt or truncated" in refused(data_url(png[: len(png) // 2]))


@pytest.mark.alone
def test_decompression_bomb_refused_from_header():
    bomb = header_only_png(8000, 8000)  # 64 Mpx > 32 Mpx default, below PIL's own 89 Mpx guard
    t = time.perf_counter()
    msg = refused(data_url(bomb), MediaLimits())
    # the message comes from the header check: had load() run, it would say "corrupt or truncated"
    assert "8000x8000" in msg and "over the limit" in msg
    assert time.perf_counter() - t < 0.5
    assert "over the limit" in refused(data_url(RED_PNG), MediaLimits(max_pixels=47))


def test_pil_decompression_bomb_guards_become_media_errors():
    huge = MediaLimits(max_pixels=10**12)  # our check out of the way: PIL's own guard must still map
    assert "decompression bomb" in refused(data_url(header_only_png(30000, 30000)), huge)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        assert "decompression bomb" in refused(data_url(header_only_png(10000, 10000)), huge)


@pytest.mark.alone
def test_over_max_bytes():
    limits = MediaLimits(max_bytes=len(RED_PNG) - 1)
    assert "size limit" in refused(data_url(RED_PNG), limits)
    assert load_image(data_url(RED_PNG), MediaLimits(max_bytes=len(RED_PNG))).size == (8, 6)
    # a huge payload is refused on its length, without decoding, and the message does not echo it
    payload = "A" * 30_000_000
    t = time.perf_counter()
    msg = refused("data:image/png;base64," + payload, MediaLimits())
    assert "size limit" in msg and len(msg) < 200 and time.perf_counter() - t < 0.5


def test_transparency_composited_on_white():
    rgba = Image.new("RGBA", (2, 1), (255, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 0, 128))
    img = load_image(data_url(encode(rgba)), OPEN)
    assert img.mode == "RGB" and img.getpixel((0, 0)) == (255, 255, 255)
    assert all(120 <= c <= 135 for c in img.getpixel((1, 0)))

    la = Image.new("LA", (1, 1), (0, 0))
    assert load_image(data_url(encode(la)), OPEN).getpixel((0, 0)) == (255, 255, 255)

    pal = Image.new("P", (2, 1), 0)
    pal.putpalette([0, 0, 255, 0, 255, 0])
    pal.putpixel((1, 0), 1)
    img = load_image(data_url(encode(pal, transparency=0)), OPEN)
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((1, 0)) == (0, 255, 0)


def test_other_modes_become_rgb():
    grey = load_image(data_url(encode(Image.new("L", (3, 3), 77))), OPEN)
    assert (grey.mode, grey.getpixel((0, 0))) == ("RGB", (77, 77, 77))

    deep = Image.new("I;16", (2, 1), 0)
    deep.putpixel((1, 0), 65535)
    img = load_image(data_url(encode(deep)), OPEN)
    assert img.getpixel((0, 0)) == (0, 0, 0) and img.getpixel((1, 0)) == (255, 255, 255)

    cmyk = load_image(data_url(encode(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG")), OPEN)
    r, g, b = cmyk.getpixel((1, 1))
    assert cmyk.mode == "RGB" and r > 230 and g < 30 and b < 30

    frames = [Image.new("RGB", (4, 4), c) for c in [(255, 0, 0), (0, 0, 255)]]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert load_image(data_url(gif, "image/gif"), OPEN).getpixel((0, 0)) == (255, 0, 0)


def test_image_hash_depends_on_pixels_only(tmp_path):
    (tmp_path / "red.bmp").write_bytes(encode(RED, "BMP"))
    via_file = load_image(str(tmp_path / "red.bmp"), MediaLimits(allowed_local_path=str(tmp_path)))
    via_data = load_image(data_url(RED_PNG), MediaLimits())
    assert image_hash(via_file) == image_hash(via_data) == image_hash(RED)
    other = RED.copy()
    other.putpixel((7, 5), (255, 0, 1))
    assert image_hash(load_image(data_url(encode(other)), MediaLimits())) != image_hash(RED)


def test_unsupported_scheme_and_truncated_messages():
    msg = refused("ftp://example.com/a.png")
    assert "'ftp'" in msg and "data:" in msg and "http" in msg
    assert len(refused("gopher://" + "x" * 10_000)) < 200
    assert "unsupported" in refused("relative/path.png")


# ---- http(s) ----


@dataclass
class Served:
    url: str
    port: int
    hosts: list[str]  # the Host header of each request, to check pinned connections keep the name


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send(self, status: int, body: bytes = b"", **headers: str):
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.hosts.append(self.headers.get("Host"))
        path = urlsplit(self.path)
        try:
            if path.path == "/red.png":
                self.send(200, RED_PNG, Content_Type="image/png")
            elif path.path == "/slow":
                self.server.stop.wait(5)
                self.send(200, RED_PNG)
            elif path.path == "/redirect":
                self.send(302, Location=parse_qs(path.query)["to"][0])
            elif path.path == "/loop":
                self.send(302, Location="/loop")
            elif path.path == "/endless":  # no Content-Length, bytes until the client gives up
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                for _ in range(800):  # 50 MiB at most
                    self.wfile.write(b"\0" * 65536)
            elif path.path == "/declared-huge":
                self.send_response(200)
                self.send_header("Content-Length", str(10**10))
                self.end_headers()
                self.close_connection = True
                self.wfile.write(RED_PNG)
            else:
                self.send(404, b"not found")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client aborted, as it should


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.hosts, srv.stop = [], threading.Event()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    port = srv.server_address[1]
    yield Served(f"http://127.0.0.1:{port}", port, srv.hosts)
    srv.stop.set()  # release /slow handlers
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture
def fake_dns(monkeypatch):
    """Map made-up host names to addresses; other names resolve for real (127.0.0.1 included)."""
    table: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in table:
            return real(host, port, *args, **kwargs)
        return [
            (socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
            for ip in table[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return table


def only_127_0_0_1_is_public(monkeypatch):
    monkeypatch.setattr(media, "is_public_address", lambda ip: ip == ipaddress.ip_address("127.0.0.1"))


def test_http_fetch_when_private_urls_allowed(server):
    img = load_image(f"{server.url}/red.png", OPEN)
    assert image_hash(img) == image_hash(RED)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0"])
def test_http_private_refused_by_default(server, host):
    msg = refused(f"http://{host}:{server.port}/red.png", MediaLimits())
    assert "private, loopback" in msg and "--allow-private-media-urls" in msg


def test_any_private_address_refuses(fake_dns):
    fake_dns["mixed.test"] = ["93.184.216.34", "10.0.0.7"]  # refused before any connection is made
    assert "private" in refused("http://mixed.test/a.png", MediaLimits())


def test_unresolvable_host(fake_dns, monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    assert "could not fetch" in refused("https://nowhere.invalid/a.png", MediaLimits())


def test_pinned_connection_keeps_host_name(server, fake_dns, monkeypatch):
    only_127_0_0_1_is_public(monkeypatch)
    fake_dns["images.test"] = ["127.0.0.1"]
    img = load_image(f"http://images.test:{server.port}/red.png", MediaLimits())
    assert image_hash(img) == image_hash(RED)
    assert server.hosts[-1] == f"images.test:{server.port}"


def test_redirect_target_is_checked_again(server, monkeypatch):
    only_127_0_0_1_is_public(monkeypatch)  # the first hop passes; 127.0.0.2 is still loopback
    assert load_image(f"{server.url}/red.png", MediaLimits()).size == (8, 6)
    target = f"http://127.0.0.2:{server.port}/red.png"
    msg = refused(f"{server.url}/redirect?to={target}", MediaLimits())
    assert "refusing to fetch http://127.0.0.2" in msg and "private" in msg


def test_redirects_followed_and_bounded(server):
    assert load_image(f"{server.url}/redirect?to=/red.png", OPEN).size == (8, 6)
    assert "too many redirects" in refused(f"{server.url}/loop")
    assert "unsupported scheme 'file'" in refused(f"{server.url}/redirect?to=file:///etc/passwd")


def test_http_404(server):
    assert "HTTP 404" in refused(f"{server.url}/missing.png")


def test_http_timeout(server):
    t = time.perf_counter()
    msg = refused(f"{server.url}/slow", MediaLimits(allow_private_urls=True, fetch_timeout_s=0.5))
    assert "timed out" in msg and time.perf_counter() - t < 2.5


def test_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    assert "could not fetch" in refused(f"http://127.0.0.1:{port}/a.png")


def test_http_body_over_cap(server):
    limits = MediaLimits(allow_private_urls=True, max_bytes=100_000)
    t = time.perf_counter()
    assert "size limit" in refused(f"{server.url}/endless", limits)
    assert "size limit" in refused(f"{server.url}/declared-huge", limits)
    assert time.perf_counter() - t < 2


def self_signed(host: str) -> tuple[bytes, bytes]:
    """(cert PEM, key PEM) for `host`, valid for a day."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_https_pinned_to_checked_address_keeps_sni_and_verifies(tmp_path, fake_dns, monkeypatch):
    # the connection goes to the checked IP; TLS must still send SNI and verify the certificate by name
    cert, key = self_signed("images.test")
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    sni: list[str | None] = []
    server_ctx.sni_callback = lambda sock, name, ctx: sni.append(name)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.hosts, srv.stop = [], threading.Event()
    srv.socket = server_ctx.wrap_socket(srv.socket, server_side=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        port = srv.server_address[1]
        only_127_0_0_1_is_public(monkeypatch)
        monkeypatch.setattr(media, "_ssl_context", lambda: ssl.create_default_context(cadata=cert.decode()))
        fake_dns.update({"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
        img = load_image(f"https://images.test:{port}/red.png", MediaLimits())
        assert image_hash(img) == image_hash(RED)
        assert sni == ["images.test"] and srv.hosts == [f"images.test:{port}"]
        # same address, a name the certificate does not cover: verification must fail
        assert "could not fetch" in refused(f"https://other.test:{port}/red.png", MediaLimits())
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)


# ---- local files ----


@pytest.fixture
def media_dir(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (inside / "red.png").write_bytes(RED_PNG)
    (tmp_path / "secret.png").write_bytes(RED_PNG)
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    return inside


def test_local_files_off_by_default(media_dir):
    msg = refused(str(media_dir / "red.png"), MediaLimits())
    assert "disabled" in msg and "--allowed-local-media-path" in msg


def test_local_file_inside_allowed_dir(media_dir):
    limits = MediaLimits(allowed_local_path=str(media_dir))
    assert load_image(str(media_dir / "red.png"), limits).size == (8, 6)
    assert load_image(f"file://{media_dir}/red.png", limits).size == (8, 6)
    assert load_image(f"file://localhost{media_dir}/red.png", limits).size == (8, 6)


@pytest.mark.parametrize("name", ["../secret.png", "link.png", "/etc/hostname"])
def test_local_file_outside_allowed_dir(media_dir, name):
    path = name if name.startswith("/") else f"{media_dir}/{name}"
    assert "outside the allowed" in refused(path, MediaLimits(allowed_local_path=str(media_dir)))


def test_local_file_errors(media_dir):
    limits = MediaLimits(allowed_local_path=str(media_dir))
    assert "not found" in refused(f"{media_dir}/nope.png", limits)
    assert "not a regular file" in refused(str(media_dir), limits)
    assert "must not name a host" in refused(f"file://otherhost{media_dir}/red.png", limits)
    small = MediaLimits(allowed_local_path=str(media_dir), max_bytes=10)
    assert "size limit" in refused(f"{media_dir}/red.png", small)


@pytest.mark.parametrize(
    "ip, public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("::ffff:8.8.8.8", True),
        ("64:ff9b::808:808", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("2002:7f00:1::", False),  # 6to4 wrapping 127.0.0.1
        ("64:ff9b::a00:1", False),  # NAT64 wrapping 10.0.0.1
    ],
)
def test_is_public_address(ip, public):
    assert media.is_public_address(ipaddress.ip_address(ip)) is public
