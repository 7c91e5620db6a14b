"""Image inputs: an OpenAI `image_url` content-part URL in, a fully decoded RGB `PIL.Image.Image` out.

Owns the four URL forms (data:, http(s):, file:, bare absolute path), the limits that stop a request from
making the server fetch internal URLs (SSRF), read files outside one directory, or allocate a
decompression bomb, and `MediaError`, whose short message is shown to the API user as a 400.
`read_media_bytes(..., kind="video" | "audio")` is the same reader for video.py and audio.py's bytes.
Synchronous on purpose: callers run it on a thread pool. It must not import torch or foveal.engine.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import ipaddress
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

MAX_REDIRECTS = 5
# Formats a chat client sends (JPEG covers phone cameras' MPO). The rest stay out of reach of untrusted
# bytes: EPS runs Ghostscript, and exotic decoders are attack surface no user needs.
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
SUPPORTED_URLS = "data:, http://, https://, file:// URLs or an absolute path"

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DATA_HEADER_MAX = 256  # `data:<mime>;base64,` is short: never scan a 20 MB payload for the comma
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_USER_AGENT = "foveal-media/1"
# ask for what we decode: a CDN negotiating on Accept would otherwise send AVIF or JPEG XL
_ACCEPT = "image/png,image/jpeg,image/webp,image/gif,image/bmp,image/tiff;q=0.9,*/*;q=0.5"
# read_media_bytes' `kind`: what messages call the input, the data: media types taken, the Accept header
_KINDS = {
    "image": ("an image", ("image/",), _ACCEPT),
    "video": ("a video", ("video/",), "video/mp4,video/webm,video/*;q=0.9,*/*;q=0.5"),
    "audio": ("audio", ("audio/",), "audio/*;q=0.9,*/*;q=0.5"),
}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaError(ValueError):
    """Bad or refused media; the message is shown to the API user (becomes a 400)."""


@dataclass(frozen=True, slots=True)
class MediaLimits:
    allow_private_urls: bool = False  # --allow-private-media-urls
    allowed_local_path: str | None = None  # --allowed-local-media-path: local files only under this dir
    fetch_timeout_s: float = 10.0  # whole fetch, redirects included
    max_bytes: int = 20 * 2**20  # encoded bytes (download, file or base64 payload)
    max_pixels: int = 32 * 2**20  # width*height, checked from the header BEFORE decoding


def load_image(url: str, limits: MediaLimits) -> Image.Image:
    """data: URL (base64), http(s) URL, file:// URL or absolute local path -> decoded RGB image."""
    return decode_image(read_media_bytes(url, limits), limits)


def image_hash(img: Image.Image) -> str:
    """sha256 hex over (mode, size, raw pixel bytes) of the decoded image: identical pixels give the same
    hash whatever the URL or encoding (e.g. the same PNG sent as data: URL and via http)."""
    h = hashlib.sha256(f"{img.mode}|{img.width}x{img.height}|".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def read_media_bytes(url: str, limits: MediaLimits, *, kind: str = "image") -> bytes:
    """The encoded bytes behind `url`, at most `limits.max_bytes`, after every access check.

    `kind` ("image", "video" or "audio") names the input in messages and picks the data: media types
    taken (`<kind>/*`, or application/octet-stream) and the Accept header sent."""
    if kind not in _KINDS:
        raise ValueError(f"unknown media kind {kind!r}; expected one of {sorted(_KINDS)}")
    if not url:
        raise MediaError(f"empty {kind} URL")
    head = url[:16].lower()
    if head.startswith("data:"):
        return _read_data_url(url, limits, kind)
    if head.startswith(("http://", "https://")):
        return _fetch_http(url, limits, kind)
    if head.startswith("file:") or url.startswith("/"):
        return _read_local(url, limits, kind)
    scheme = urlsplit(url[:100]).scheme
    what = f"scheme {scheme!r}" if scheme else f"URL {_short(url)!r}"
    raise MediaError(f"unsupported {kind} {what}; use {SUPPORTED_URLS}")


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Decode the first frame to RGB, refusing oversized images from their header alone."""
    return decode_opened(open_image(data, limits))


def open_image(data: bytes, limits: MediaLimits) -> Image.Image:
    """Read the image's header only (no pixels decoded): its size is known, and refused over the limit."""
    try:
        img = Image.open(io.BytesIO(data), formats=_open_formats())
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError("image has too many pixels (decompression bomb check)") from e
    except UnidentifiedImageError as e:
        raise MediaError(f"not a valid image (supported formats: {', '.join(_open_formats())})") from e
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, EOFError, struct.error ...
        raise MediaError(f"corrupt or truncated image: {_short(str(e) or type(e).__name__)}") from e
    w, h = img.size
    if w * h > limits.max_pixels:
        raise MediaError(f"image is {w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels}")
    return img


def decode_opened(img: Image.Image) -> Image.Image:
    """An opened image's first frame, decoded, as RGB."""
    try:
        img.load()  # Image.open leaves frame 0 current, so animations decode their first frame only
    # PIL's own guard (its MAX_IMAGE_PIXELS) fires only when max_pixels is set above it. The warning is
    # an exception only where warnings are errors; we do not set a filter here because warning filters
    # are process-global and this runs on many threads at once.
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaError("image has too many pixels (decompression bomb check)") from e
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, EOFError, struct.error ...
        raise MediaError(f"corrupt or truncated image: {_short(str(e) or type(e).__name__)}") from e
    try:
        return _to_rgb(img)
    except Exception as e:
        raise MediaError(f"cannot convert a {img.mode} image to RGB") from e


def is_public_address(ip: IPAddress) -> bool:
    """True for an address a media URL may reach without --allow-private-media-urls."""
    if isinstance(ip, ipaddress.IPv6Address):
        # judge an IPv4 address embedded in IPv6 by the IPv4 rules: ::ffff:127.0.0.1 is loopback
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip.sixtofour is not None:
            ip = ip.sixtofour
        elif ip in _NAT64:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    bad = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
    return ip.is_global and not (bad or ip.is_reserved or ip.is_unspecified)


# ---- data: URLs ----


def _read_data_url(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    noun, mime_prefixes, _ = _KINDS[kind]
    comma = url.find(",", 0, _DATA_HEADER_MAX)
    if comma < 0:
        raise MediaError(f"malformed data URL: expected data:{kind}/<type>;base64,<data>")
    params = [p.strip().lower() for p in url[5:comma].split(";")]
    mime = params[0]
    if "base64" not in params[1:]:
        raise MediaError(f"data URL must be base64-encoded: data:{kind}/<type>;base64,<data>")
    if mime and not (mime.startswith(mime_prefixes) or mime == "application/octet-stream"):
        raise MediaError(f"data URL media type {_short(mime)!r} is not {noun}")
    payload = url[comma + 1 :]
    limit = 4 * ((limits.max_bytes + 2) // 3)  # base64 length of max_bytes
    # refuse by length before any copy or decode; line breaks are the only legitimate slack
    if len(payload) > 2 * limit + 1024:
        raise _too_big(limits, kind)
    if "%" in payload:  # percent-encoded by some clients; '%' is never a base64 character
        payload = unquote(payload)
    payload = "".join(payload.split())  # no copy when there is no whitespace
    if len(payload) > limit:
        raise _too_big(limits, kind)
    if "-" in payload or "_" in payload:  # the URL-safe alphabet
        payload = payload.replace("-", "+").replace("_", "/")
    payload += "=" * (-len(payload) % 4)  # tolerate stripped padding
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError("data URL is not valid base64") from e
    if not data:
        raise MediaError("data URL has no data")
    if len(data) > limits.max_bytes:
        raise _too_big(limits, kind)
    return data


# ---- http(s) ----


def _fetch_http(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    deadline = time.monotonic() + limits.fetch_timeout_s
    current = _parse_http_url(url, url, kind)
    # trust_env=False: no proxy from the environment, so the address we checked is the one we connect to
    with httpx.Client(verify=_ssl_context(), trust_env=False, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            result = _get(client, current, limits, deadline, kind)
            if isinstance(result, bytes):
                return result
            current = result  # redirects are followed by hand so each hop's host is checked again
    raise MediaError(f"too many redirects fetching {_short(url)} (at most {MAX_REDIRECTS})")


def _get(
    client: httpx.Client, url: httpx.URL, limits: MediaLimits, deadline: float, kind: str = "image"
) -> bytes | httpx.URL:
    """One hop: the body, or the URL a redirect points to."""
    name = _short(str(url))
    last: Exception | None = None
    for target, headers, extensions in _connect_targets(url, limits, kind):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(name, limits)
        try:
            with client.stream(
                "GET", target, headers=headers, extensions=extensions, timeout=remaining
            ) as resp:
                if resp.status_code in _REDIRECT_STATUSES:
                    location = resp.headers.get("location")
                    if not location:
                        raise MediaError(f"{name} redirected (HTTP {resp.status_code}) without a Location")
                    return _parse_http_url(url.join(location), str(url), kind)
                if not 200 <= resp.status_code < 300:
                    raise MediaError(f"fetching {name} failed: HTTP {resp.status_code}")
                return _read_capped(resp, name, limits, deadline)
        except httpx.ConnectError as e:
            last = e  # try the host's next address, as a browser would
        except httpx.TimeoutException as e:
            raise _timed_out(name, limits) from e
        except httpx.HTTPError as e:
            raise MediaError(f"could not fetch {name}: {_short(str(e) or type(e).__name__)}") from e
    raise MediaError(f"could not fetch {name}: {_short(str(last) or 'connection failed')}") from last


def _connect_targets(
    url: httpx.URL, limits: MediaLimits, kind: str = "image"
) -> list[tuple[httpx.URL, dict, dict]]:
    """(URL to connect to, headers, httpcore extensions) per address to try, in order.

    Without --allow-private-media-urls the host is resolved here, every address is checked, and the
    connection is pinned to a checked address (Host header and TLS SNI keep the name). Letting httpx
    resolve again would let a DNS answer that changes between check and connect (rebinding) through."""
    headers = {"User-Agent": _USER_AGENT, "Accept": _KINDS[kind][2]}
    if limits.allow_private_urls:
        return [(url, headers, {})]
    host = url.raw_host.decode("ascii")
    ips = _resolve_public(host, url.port or (443 if url.scheme == "https" else 80), _short(str(url)))
    if _is_ip_literal(host):
        return [(url, headers, {})]
    pinned = {**headers, "Host": url.netloc.decode("ascii")}
    return [(url.copy_with(host=str(ip)), pinned, {"sni_hostname": host}) for ip in ips]


def _resolve_public(host: str, port: int, name: str) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise MediaError(f"could not fetch {name}: cannot resolve host {_short(host)!r}") from e
    families = (socket.AF_INET, socket.AF_INET6)
    ips = list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos if i[0] in families))
    if not ips:
        raise MediaError(f"could not fetch {name}: no address for host {_short(host)!r}")
    # one private answer is enough to refuse: the client might connect to any of them
    if not all(is_public_address(ip) for ip in ips):
        raise MediaError(
            f"refusing to fetch {name}: the host is a private, loopback or otherwise non-public address "
            "(the server allows those only with --allow-private-media-urls)"
        )
    return ips


def _read_capped(resp: httpx.Response, name: str, limits: MediaLimits, deadline: float) -> bytes:
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise _too_big(limits, name)
    buf = bytearray()
    # Content-Length may lie or be absent: count what actually arrives and stop at the cap
    for chunk in resp.iter_bytes():
        buf += chunk
        if len(buf) > limits.max_bytes:
            raise _too_big(limits, name)
        if time.monotonic() > deadline:  # a server dripping bytes never trips the per-read timeout
            raise _timed_out(name, limits)
    return bytes(buf)


def _parse_http_url(url: str | httpx.URL, shown: str, kind: str = "image") -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise MediaError(f"invalid {kind} URL {_short(str(url))!r}") from e
    if parsed.scheme not in ("http", "https"):
        raise MediaError(f"{_short(shown)} redirected to an unsupported scheme {parsed.scheme!r}")
    if not parsed.raw_host:
        raise MediaError(f"{kind} URL {_short(str(url))!r} has no host")
    return parsed


@functools.cache
def _open_formats() -> tuple[str, ...]:
    # a Pillow built without e.g. libwebp lacks that opener; Image.open would raise KeyError for it
    Image.init()
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


@functools.cache
def _ssl_context():
    return httpx.create_ssl_context()  # ~30 ms to build (CA bundle): once per process, not per image


# ---- local files ----


def _read_local(url: str, limits: MediaLimits, kind: str = "image") -> bytes:
    name = _short(url)
    if url.startswith("/"):
        raw = url
    else:
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {name!r} must not name a host")
        raw = unquote(parts.path)
    if limits.allowed_local_path is None:
        raise MediaError(
            f"local {kind} files are disabled on this server (refusing {name!r}); "
            "the server allows them only under --allowed-local-media-path"
        )
    try:
        root = Path(limits.allowed_local_path).resolve()
        path = Path(raw).resolve()  # symlinks resolved, so a link inside cannot point outside
    except (OSError, RuntimeError, ValueError) as e:
        raise MediaError(f"invalid local path {name!r}") from e
    if not Path(raw).is_absolute():
        raise MediaError(f"local path {name!r} must be absolute")
    # checked before existence, so a caller cannot probe which files exist elsewhere
    if not path.is_relative_to(root):
        raise MediaError(f"refusing {name!r}: outside the allowed local media directory")
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise MediaError(f"{name!r} is not a regular file")
        if st.st_size > limits.max_bytes:
            raise _too_big(limits, name)
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)  # the file may grow after stat()
    except FileNotFoundError as e:
        raise MediaError(f"local {kind} file not found: {name!r}") from e
    except OSError as e:
        raise MediaError(f"cannot read local {kind} {name!r}: {e.strerror or type(e).__name__}") from e
    if len(data) > limits.max_bytes:
        raise _too_big(limits, name)
    return data


# ---- helpers ----


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I") or img.mode == "F":
        img = _to_8bit(img)
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        # models see no alpha: composite on white, as a browser shows a transparent PNG on a page
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def _to_8bit(img: Image.Image) -> Image.Image:
    """16/32-bit and float grey to L. A plain convert() clips everything above 255 to white."""
    if img.mode.startswith("I;16"):
        img, lo, hi = img.convert("I"), 0.0, 65535.0
    else:
        lo, hi = img.getextrema()
        if img.mode == "F" and 0 <= lo and hi <= 1:
            lo, hi = 0.0, 1.0
        elif 0 <= lo and hi <= 255:
            return img.convert("L")
        elif 0 <= lo and hi <= 65535:
            lo, hi = 0.0, 65535.0
    scale = 255.0 / (hi - lo) if hi > lo else 1.0
    return img.point(lambda v: v * scale - lo * scale).convert("L")


def _short(s: str, n: int = 100) -> str:
    """Truncate for messages: a data URL or long query string must not be echoed whole."""
    return s if len(s) <= n else s[: n - 3] + "..."


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _too_big(limits: MediaLimits, name: str = "image") -> MediaError:
    return MediaError(f"{name} is over the {_fmt_bytes(limits.max_bytes)} size limit")


def _timed_out(name: str, limits: MediaLimits) -> MediaError:
    return MediaError(f"timed out fetching {name} (limit {limits.fetch_timeout_s:g} s)")


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n} bytes"
