"""foveal.server.video: sampling against transformers' rule, frame identity, every limit, hostile files, and
media.read_media_bytes(kind="video"). Clips are written here with PyAV: frame i is a solid grey of level
8*i, so a decoded frame tells its own index through lossy coding."""

from __future__ import annotations

import base64
import functools
import io
import random
import struct
import time
from fractions import Fraction

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from foveal.server import media, video
from foveal.server.media import MediaError, MediaLimits
from foveal.server.video import Video, VideoLimits, VideoMetadata, decode_video, uniform_indices, video_hash

W, H, RATE, N = 64, 48, 10, 30  # 30 frames at 10 fps: a 3 s clip
DEFAULTS = VideoLimits()


def encode(
    codec: str = "libx264",
    fmt: str = "mp4",
    n: int = N,
    *,
    pts: list[int] | None = None,
    size: tuple[int, int] = (W, H),
    color=None,
    options: dict | None = None,
) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=RATE, options=options or {})
        s.width, s.height = size
        s.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if codec == "mpeg4":
            s.bit_rate = 500_000  # the default rate blurs grey levels by up to 6
        c.start_encoding()  # header even when no frame comes
        for i in range(n):
            rgb = np.full((size[1], size[0], 3), color if color is not None else 8 * i, np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = i if pts is None else pts[i]
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@functools.cache
def clip(codec: str = "libx264", fmt: str = "mp4") -> bytes:
    return encode(codec, fmt)


CLIPS = [("libx264", "mp4"), ("mpeg4", "mp4"), ("mjpeg", "avi"), ("libvpx-vp9", "webm")]


def levels(v: Video) -> list[int]:
    """Each decoded frame's index, read back from its grey level."""
    return [round(float(f.mean()) / 8) for f in v.frames]


def assert_frames_are(v: Video, indices: list[int]) -> None:
    assert v.frames.dtype == np.uint8 and v.frames.shape == (len(indices), H, W, 3)
    assert levels(v) == indices
    want = 8 * np.asarray(indices, dtype=int)[:, None, None, None]
    assert np.abs(v.frames.astype(int) - want).max() <= 3


def refused(data: bytes, limits: VideoLimits = DEFAULTS, choose=None) -> str:
    with pytest.raises(MediaError) as e:
        decode_video(data, limits, choose)
    return str(e.value)


@pytest.fixture
def no_decode(monkeypatch):
    """Fail the test if the decode pass starts: the check under test must refuse before any frame."""

    def boom(*a, **k):
        raise AssertionError("frames were decoded")

    monkeypatch.setattr(video, "_decode_chosen", boom)


def mp4_with_durations(data: bytes, seconds: float) -> bytes:
    """Rewrite the duration fields of every mvhd, tkhd and mdhd box (version 0) to claim `seconds`."""
    b = bytearray(data)
    movie_scale = None
    for box in (b"mvhd", b"tkhd", b"mdhd"):
        i = b.find(box)
        while i >= 0:
            assert b[i + 4] == 0, "version 1 boxes not handled"
            if box == b"tkhd":  # version/flags, ctime, mtime, track id, reserved, duration (movie scale)
                off, scale = i + 24, movie_scale
            else:  # version/flags, ctime, mtime, timescale, duration
                scale = struct.unpack(">I", b[i + 16 : i + 20])[0]
                off = i + 20
                if box == b"mvhd":
                    movie_scale = scale
            b[off : off + 4] = struct.pack(">I", int(seconds * scale))
            i = b.find(box, i + 4)
    return bytes(b)


# ---- uniform_indices ----


def meta(total: int, fps: float = RATE) -> VideoMetadata:
    return VideoMetadata(total_frames=total, fps=fps, duration_s=total / fps, width=W, height=H)


def test_uniform_indices_matches_transformers():
    from transformers.video_utils import VideoMetadata as HFMeta
    from transformers.video_utils import default_sample_indices_fn

    for total in (1, 2, 7, 30, 31, 97, 600, 1799):
        for video_fps in (10.0, 24.0, 29.97, 60.0):
            hf = HFMeta(total_num_frames=total, fps=video_fps)
            for fps in (0.5, 1, 2, 3.3):
                want = default_sample_indices_fn(hf, fps=fps).tolist()
                assert uniform_indices(meta(total, video_fps), fps=fps, max_frames=10**6) == want
            for n in range(1, min(total, 40) + 1):
                want = default_sample_indices_fn(hf, num_frames=n).tolist()
                assert uniform_indices(meta(total, video_fps), num_frames=n, max_frames=10**6) == want


def test_uniform_indices_caps():
    assert uniform_indices(meta(30), fps=2, max_frames=4) == [0, 7, 15, 22]  # 6 frames asked, 4 allowed
    assert uniform_indices(meta(30), num_frames=50, max_frames=768) == list(range(30))  # capped by total
    assert uniform_indices(meta(3), fps=0.1, max_frames=768) == [0]  # at least one
    assert uniform_indices(meta(5), max_frames=768) == list(range(5))  # neither: every frame
    assert uniform_indices(meta(0), fps=2, max_frames=768) == []
    with pytest.raises(ValueError):
        uniform_indices(meta(30), fps=2, num_frames=3, max_frames=768)


# ---- decoding the right frames ----


@pytest.mark.parametrize("codec, fmt", CLIPS, ids=[c for c, _ in CLIPS])
@pytest.mark.parametrize(
    "sampler",
    [
        {"fps": 1},
        {"fps": 2},
        {"num_frames": 4},
        "custom",
    ],
    ids=["fps1", "fps2", "n4", "custom"],
)
def test_sampled_frames(codec, fmt, sampler):
    seen = []

    def choose(m: VideoMetadata) -> list[int]:
        seen.append(m)
        if sampler == "custom":
            return [1, 2, 3, 17, 29]
        return uniform_indices(m, max_frames=768, **sampler)

    v = decode_video(clip(codec, fmt), VideoLimits(), choose)
    assert seen == [VideoMetadata(total_frames=N, fps=RATE, duration_s=N / RATE, width=W, height=H)]
    assert v.metadata == seen[0]
    want = [1, 2, 3, 17, 29] if sampler == "custom" else uniform_indices(seen[0], max_frames=768, **sampler)
    assert v.indices == want
    assert v.timestamps == pytest.approx([i / RATE for i in want])
    assert_frames_are(v, want)


def test_default_sampler_is_2fps_capped_by_max_frames():
    v = decode_video(clip(), VideoLimits())
    assert v.indices == uniform_indices(v.metadata, fps=2, max_frames=768) == [0, 5, 10, 15, 20, 25]
    assert_frames_are(v, v.indices)
    v = decode_video(clip(), VideoLimits(max_frames=4))
    assert v.indices == [0, 7, 15, 22]
    assert_frames_are(v, v.indices)


def test_b_frames_come_in_presentation_order():
    data = clip("libx264", "mp4")
    with av.open(io.BytesIO(data)) as c:
        pts = [p.pts for p in c.demux(video=0) if p.size]
    assert pts != sorted(pts)  # the clip does reorder: decode order is not presentation order
    v = decode_video(data, VideoLimits(), lambda m: list(range(m.total_frames)))
    assert_frames_are(v, list(range(N)))


def test_frames_the_decoder_drops_do_not_shift_indices():
    """An H.264 stream whose first keyframe was cut out (keyframes every 5 frames): the decoder drops the
    4 frames that follow the missing one. Indices come from timestamps, so the rest keep theirs."""
    data = encode("libx264", "mp4", options={"g": "5", "bf": "0"})
    buf = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(buf, "w", format="matroska") as dst:
        out = dst.add_stream_from_template(src.streams.video[0])
        packets = [p for p in src.demux(video=0) if p.size]
        assert [p.is_keyframe for p in packets[:6]] == [True, False, False, False, False, True]
        for p in packets[1:]:
            p.stream = out
            dst.mux(p)
    cut = buf.getvalue()  # frames 1..29 of the clip: index k holds grey level 8*(k+1)
    v = decode_video(cut, VideoLimits(), lambda m: [4, 5, 17, 28])
    assert v.metadata.total_frames == N - 1
    assert levels(v) == [5, 6, 18, 29]
    assert v.timestamps == pytest.approx([0.4, 0.5, 1.7, 2.8])
    msg = refused(cut, VideoLimits(), lambda m: [0, 4])  # frame 0 never decodes: refused, not shifted
    assert "1 of the 2 chosen frames did not decode" in msg


def test_frames_are_rgb():
    red = encode("libx264", "mp4", n=3, color=(255, 0, 0))
    v = decode_video(red, VideoLimits(), lambda m: [0, 2])
    r, g, b = (v.frames[..., c].astype(int) for c in range(3))
    assert r.min() > 230 and g.max() < 30 and b.max() < 30


def test_video_hash():
    a = decode_video(clip(), VideoLimits(), lambda m: [0, 3])
    assert video_hash(a) == video_hash(decode_video(clip(), VideoLimits(), lambda m: [0, 3]))
    # the same packets in another container decode to the same pixels: equal hash
    buf = io.BytesIO()
    with av.open(io.BytesIO(clip()), "r") as src, av.open(buf, "w", format="matroska") as dst:
        out = dst.add_stream_from_template(src.streams.video[0])
        for p in src.demux(video=0):
            if p.size:
                p.stream = out
                dst.mux(p)
    remuxed = buf.getvalue()
    assert remuxed[:4] == b"\x1a\x45\xdf\xa3"  # EBML: it really is Matroska now
    assert video_hash(decode_video(remuxed, VideoLimits(), lambda m: [0, 3])) == video_hash(a)
    assert video_hash(decode_video(clip(), VideoLimits(), lambda m: [0, 4])) != video_hash(a)
    same_pixels_other_indices = Video(a.frames, [0, 4], a.timestamps, a.metadata)
    assert video_hash(same_pixels_other_indices) != video_hash(a)


def test_frame_size_change_mid_stream():
    """An AVI whose header says 64x48 while later frames are 32x24 and 128x96: frames are scaled to the
    header's size, and a frame over max_frame_pixels is refused even though the header was under it."""
    sizes = [(64, 48)] * 3 + [(32, 24)] * 3 + [(128, 96)] * 3
    buf = io.BytesIO()
    with av.open(buf, "w", format="avi") as c:
        s = c.add_stream("mjpeg", rate=RATE)
        s.width, s.height, s.pix_fmt = W, H, "yuvj420p"
        encoders = {}
        for i, (w, h) in enumerate(sizes):
            if (w, h) not in encoders:
                enc = av.CodecContext.create("mjpeg", "w")
                enc.width, enc.height, enc.pix_fmt, enc.time_base = w, h, "yuvj420p", Fraction(1, RATE)
                encoders[(w, h)] = enc
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 8 * i, np.uint8), format="rgb24")
            frame = frame.reformat(format="yuvj420p")
            frame.pts = i
            for p in encoders[(w, h)].encode(frame):
                p.stream, p.pts, p.dts = s, i, i
                c.mux(p)
    data = buf.getvalue()
    v = decode_video(data, VideoLimits(), lambda m: list(range(m.total_frames)))
    assert v.metadata.total_frames == 9
    assert_frames_are(v, list(range(9)))
    small = VideoLimits(max_frame_pixels=W * H)
    assert_frames_are(
        decode_video(data, small, lambda m: list(range(6))), list(range(6))
    )  # before the big ones
    msg = refused(data, small, lambda m: list(range(9)))
    assert f"over the limit of {W * H} pixels" in msg


# ---- limits ----


def test_max_bytes():
    data = clip()
    msg = refused(data, VideoLimits(max_bytes=len(data) - 1))
    assert f"over the {len(data) - 1} bytes size limit" in msg
    assert "no data" in refused(b"")


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_frame_pixels_refused_from_header(codec, no_decode):
    limit = W * H - 1
    t = time.perf_counter()
    msg = refused(clip(codec, "mp4"), VideoLimits(max_frame_pixels=limit))
    assert time.perf_counter() - t < 1
    assert f"limit of {limit} pixels" in msg
    if codec == "libx264":  # the size is in the SPS; mpeg4's probe decode is refused, so size reads 0
        assert f"{W}x{H} = {W * H} pixels" in msg
    else:
        assert "unknown" in msg


def gap_clip() -> bytes:
    """Five frames whose last two come 10 hours after the first three: a 10-hour video in ~1 KB."""
    ten_hours = 36000 * RATE
    return encode("mpeg4", "mp4", n=5, pts=[0, 1, 2, ten_hours, ten_hours + 1])


def test_duration_refused_from_header(no_decode):
    t = time.perf_counter()
    msg = refused(gap_clip())
    assert time.perf_counter() - t < 1
    assert "from its header" in msg and "36000" in msg and "duration limit of 600 s" in msg
    assert "duration limit of 2 s" in refused(clip(), VideoLimits(max_duration_s=2.0))


def test_duration_refused_from_packets_when_the_header_lies(no_decode):
    lying = mp4_with_durations(gap_clip(), 1.0)
    with av.open(io.BytesIO(lying)) as c:  # the header now claims one second
        s = c.streams.video[0]
        assert c.duration <= 2 * av.time_base and s.duration * s.time_base <= 2
    t = time.perf_counter()
    msg = refused(lying)
    assert time.perf_counter() - t < 1
    assert "frames run past 600 s" in msg and "header said 1.0 s" in msg


def test_max_frames():
    msg = refused(clip(), VideoLimits(max_frames=4), lambda m: [0, 1, 2, 3, 4])
    assert "chose 5 frames" in msg and "limit of 4 frames" in msg


def test_max_decoded_bytes():
    limit = 5 * W * H * 3
    assert (
        len(decode_video(clip(), VideoLimits(max_decoded_bytes=limit), lambda m: [0, 1, 2, 3, 4]).indices)
        == 5
    )
    msg = refused(clip(), VideoLimits(max_decoded_bytes=limit), lambda m: [0, 1, 2, 3, 4, 5])
    assert f"over the limit of {limit} bytes" in msg and f"6 frames of {W}x{H}" in msg


@pytest.mark.parametrize(
    "chosen, expect",
    [
        ([], "no frames"),
        ([3, 1], "increasing"),
        ([1, 1], "increasing"),
        ([0, N], "out of range"),
        ([-1, 2], "out of range"),
    ],
    ids=["empty", "unsorted", "duplicate", "past-end", "negative"],
)
def test_bad_indices(chosen, expect, no_decode):
    assert expect in refused(clip(), VideoLimits(), lambda m: chosen)


def test_numpy_indices_are_taken():
    v = decode_video(clip(), VideoLimits(), lambda m: np.array([2, 9]))
    assert v.indices == [2, 9] and all(type(i) is int for i in v.indices)


def test_deadline():
    assert "took longer than 0 s" in refused(clip(), VideoLimits(deadline_s=0))

    def slow(m):
        time.sleep(0.3)
        return [0, 1]

    assert "took longer than 0.2 s" in refused(clip(), VideoLimits(deadline_s=0.2), slow)


def test_decoded_in_one_thread(monkeypatch):
    """The input pool is the parallelism: FFmpeg's default would start a thread per core per decode."""
    threads = []
    real = video._decode_chosen

    def spy(container, stream, *args):
        out = real(container, stream, *args)
        threads.append(stream.codec_context.thread_count)
        return out

    monkeypatch.setattr(video, "_decode_chosen", spy)
    decode_video(clip(), VideoLimits())
    assert threads == [1]


def test_sampler_bug_is_not_a_media_error():
    def buggy(m):
        raise KeyError("sampler bug")

    with pytest.raises(KeyError):
        decode_video(clip(), VideoLimits(), buggy)


# ---- hostile and odd inputs ----


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "data, expect",
    [
        (random.Random(0).randbytes(5000), "not a valid video"),
        (b"just some text\n" * 40, "not a valid video"),
        (png(), "not a supported container"),
        (
            b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nhttp://127.0.0.1:9/x.ts\n#EXT-X-ENDLIST\n",
            "not a valid",
        ),
    ],
    ids=["random", "text", "png", "hls-playlist"],
)
def test_not_a_video(data, expect):
    assert expect in refused(data)


@pytest.mark.parametrize("codec, fmt", CLIPS, ids=[c for c, _ in CLIPS])
@pytest.mark.parametrize("frac", [0.5, 0.9])
def test_truncated(codec, fmt, frac):
    """A cut file either gives the frames it still holds (each the right one) or a MediaError."""
    data = clip(codec, fmt)
    cut = data[: int(len(data) * frac)]
    try:
        v = decode_video(cut, VideoLimits(), lambda m: list(range(m.total_frames)))
    except MediaError:
        return
    assert 0 < v.metadata.total_frames < N
    assert_frames_are(v, v.indices)


def test_truncated_mp4_with_index_first(tmp_path):
    """moov before mdat (faststart): the index lists 30 frames, the cut file holds fewer. Frames are
    counted by demuxing, so sampling sees what is there; a chosen frame in the broken tail is refused."""
    path = tmp_path / "fast.mp4"
    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as c:
        s = c.add_stream("mjpeg", rate=RATE)  # intra-only: every frame before the cut decodes
        s.width, s.height, s.pix_fmt = W, H, "yuvj420p"
        for i in range(N):
            frame = av.VideoFrame.from_ndarray(np.full((H, W, 3), 8 * i, np.uint8), format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    data = path.read_bytes()
    assert data.find(b"moov") < data.find(b"mdat")
    cut = data[: int(len(data) * 0.6)]
    v = decode_video(cut, VideoLimits())
    assert 0 < v.metadata.total_frames < N
    assert v.indices == uniform_indices(v.metadata, fps=2, max_frames=768)
    assert_frames_are(v, v.indices)
    # the last demuxed packet is cut short: choosing it is refused, never returned as garbage
    try:
        last = decode_video(cut, VideoLimits(), lambda m: [m.total_frames - 1])
    except MediaError as e:
        assert "corrupt or truncated" in str(e)
    else:
        assert_frames_are(last, last.indices)


@pytest.mark.parametrize("codec, fmt", [("mjpeg", "avi"), ("libx264", "mp4"), ("libx264", "matroska")])
def test_zero_frames(codec, fmt):
    assert refused(encode(codec, fmt, n=0))


def test_audio_only_file():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("aac", rate=16000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 16000), np.float32), format="fltp", layout="mono")
        frame.sample_rate, frame.pts = 16000, 0
        for p in list(s.encode(frame)) + list(s.encode()):
            c.mux(p)
    assert "no video stream" in refused(buf.getvalue())


def test_corrupted_bytes_give_video_or_media_error():
    """Seeded byte flips in each clip: decoding returns a Video or a MediaError, nothing else."""
    rng = random.Random(1)
    for codec, fmt in CLIPS:
        data = clip(codec, fmt)
        for _ in range(12):
            b = bytearray(data)
            for _ in range(8):
                b[rng.randrange(len(b))] = rng.randrange(256)
            try:
                v = decode_video(bytes(b), VideoLimits(), lambda m: list(range(m.total_frames)))
            except MediaError:
                continue
            assert v.frames.dtype == np.uint8 and v.frames.ndim == 4 and len(v.indices) == len(v.frames)


# ---- media.read_media_bytes(kind=...) ----


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_video_data_url():
    data = clip()
    assert media.read_media_bytes(data_url(data, "video/mp4"), MediaLimits(), kind="video") == data
    assert (
        media.read_media_bytes(data_url(data, "application/octet-stream"), MediaLimits(), kind="video")
        == data
    )
    with pytest.raises(MediaError, match=r"^data URL media type 'video/mp4' is not an image$"):
        media.read_media_bytes(data_url(data, "video/mp4"), MediaLimits())
    with pytest.raises(MediaError, match=r"^data URL media type 'image/png' is not a video$"):
        media.read_media_bytes(data_url(png(), "image/png"), MediaLimits(), kind="video")
    with pytest.raises(MediaError, match=r"^data URL media type 'video/mp4' is not audio$"):
        media.read_media_bytes(data_url(data, "video/mp4"), MediaLimits(), kind="audio")
    assert media.read_media_bytes(data_url(b"RIFF", "audio/wav"), MediaLimits(), kind="audio") == b"RIFF"


def test_media_messages_name_the_kind():
    def msg(url: str, kind: str, limits: MediaLimits | None = None) -> str:
        with pytest.raises(MediaError) as e:
            media.read_media_bytes(url, limits or MediaLimits(), kind=kind)
        return str(e.value)

    assert msg("", "video") == "empty video URL"
    assert msg("", "image") == "empty image URL"
    assert msg("ftp://x/a.mp4", "audio").startswith("unsupported audio scheme 'ftp'")
    assert (
        msg("data:video/mp4,abc", "video")
        == "data URL must be base64-encoded: data:video/<type>;base64,<data>"
    )
    assert msg("data:" + "x" * 300, "audio") == "malformed data URL: expected data:audio/<type>;base64,<data>"
    big = data_url(b"x" * 100, "video/mp4")
    assert msg(big, "video", MediaLimits(max_bytes=50)) == "video is over the 50 bytes size limit"
    assert msg("/tmp/a.mp4", "video").startswith("local video files are disabled on this server")
    assert msg("http://", "audio") == "audio URL 'http://' has no host"
    with pytest.raises(ValueError, match="unknown media kind"):
        media.read_media_bytes("data:,", MediaLimits(), kind="text")


def test_video_from_local_file_and_accept_header(tmp_path):
    (tmp_path / "a.mp4").write_bytes(clip())
    local = MediaLimits(allowed_local_path=str(tmp_path))
    assert media.read_media_bytes(str(tmp_path / "a.mp4"), local, kind="video") == clip()
    with pytest.raises(MediaError, match="^local video file not found"):
        media.read_media_bytes(str(tmp_path / "b.mp4"), local, kind="video")
    open_net = MediaLimits(allow_private_urls=True)
    accept = {
        kind: media._connect_targets(httpx.URL("http://127.0.0.1/x"), open_net, kind)[0][1]["Accept"]
        for kind in ("image", "video", "audio")
    }
    assert accept["image"] == media._ACCEPT
    assert accept["video"].startswith("video/") and accept["audio"].startswith("audio/")
