"""foveal.server.audio: decoding every container we take to mono float32 at the model's rate (length,
pitch, level), the downmix, every limit, and hostile files. Sounds are written here with PyAV."""

from __future__ import annotations

import functools
import io
import random
import struct
import time

import av
import numpy as np
import pytest

from foveal.server import audio
from foveal.server.audio import AudioLimits, audio_hash, decode_audio
from foveal.server.media import MediaError

SR = 16000  # the rate the models take
DEFAULTS = AudioLimits()


def tone(freq: float, seconds: float, rate: int, amp: float = 0.5) -> np.ndarray:
    return amp * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)


def encode(
    codec: str,
    fmt: str,
    channels: list[np.ndarray],
    rate: int,
    options: dict | None = None,
) -> bytes:
    """Encode one float signal per channel (mono or stereo) in the codec's own sample format."""
    layout = "mono" if len(channels) == 1 else "stereo"
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt, options=options or {}) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        step = s.codec_context.frame_size or 1024
        sfmt = s.codec_context.format
        c.start_encoding()  # header even when no sample comes
        x = np.stack(channels)
        for start in range(0, x.shape[1], step):
            chunk = x[:, start : start + step]
            if sfmt.name.startswith("s16"):
                chunk = np.round(chunk * 32767).astype(np.int16)
            elif sfmt.name.startswith("s32"):
                chunk = np.round(chunk * (2**31 - 1)).astype(np.int32)
            else:
                chunk = chunk.astype(np.float32)
            if not sfmt.is_planar:
                chunk = chunk.T.reshape(1, -1)  # interleaved
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format=sfmt.name, layout=layout)
            frame.sample_rate, frame.pts = rate, start
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@functools.cache
def sine(codec: str = "pcm_s16le", fmt: str = "wav", rate: int = 44100, seconds: float = 1.0) -> bytes:
    """440 Hz at half scale, the same in both channels."""
    x = tone(440, seconds, rate)
    return encode(codec, fmt, [x, x], rate)


def peak_hz(x: np.ndarray, rate: int = SR) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * rate / len(x)


def refused(data: bytes, limits: AudioLimits = DEFAULTS) -> str:
    with pytest.raises(MediaError) as e:
        decode_audio(data, limits, SR)
    return str(e.value)


def assert_is_the_tone(x: np.ndarray, seconds: float, slack: int) -> None:
    assert x.dtype == np.float32 and x.ndim == 1
    assert abs(len(x) - round(seconds * SR)) <= slack
    assert -1.0 <= x.min() and x.max() <= 1.0
    assert abs(peak_hz(x) - 440) < 2
    mid = x[len(x) // 4 : 3 * len(x) // 4]  # away from codec onsets and tails
    assert 0.44 < np.abs(mid).max() < 0.56  # half scale: the downmix of equal channels keeps the level


# (codec, container, source rate, slack in output samples): lossy codecs pad to whole frames
FORMATS = [
    ("pcm_s16le", "wav", 44100, 2),
    ("flac", "flac", 44100, 2),
    ("libmp3lame", "mp3", 44100, 2),  # LAME's gapless header trims the encoder delay and padding
    ("libopus", "ogg", 48000, 2),
    ("libopus", "webm", 48000, 2),
    ("aac", "mp4", 44100, 1024),  # m4a: the last AAC frame's padding stays
    ("aac", "adts", 44100, 1024),
]


@pytest.mark.parametrize("codec, fmt, rate, slack", FORMATS, ids=[f"{c}-{f}" for c, f, _, _ in FORMATS])
def test_decodes_to_mono_16k(codec, fmt, rate, slack):
    assert_is_the_tone(decode_audio(sine(codec, fmt, rate), AudioLimits(), SR), 1.0, slack)


def test_other_output_rate():
    x = decode_audio(sine(), AudioLimits(), 24000)
    assert len(x) == 24000 and abs(peak_hz(x, 24000) - 440) < 2


def test_stereo_downmix_is_the_mean():
    """Left 440 Hz, right 1000 Hz, each at half scale: both are heard, each at a quarter scale."""
    rate = 44100
    data = encode("pcm_s16le", "wav", [tone(440, 1, rate), tone(1000, 1, rate)], rate)
    x = decode_audio(data, AudioLimits(), SR)
    want = 0.25 * (
        np.sin(2 * np.pi * 440 * np.arange(SR) / SR) + np.sin(2 * np.pi * 1000 * np.arange(SR) / SR)
    )
    assert len(x) == SR
    mid = slice(1000, SR - 1000)  # the resampler's filter settles at the ends
    assert np.abs(x[mid] - want[mid]).max() < 0.01
    # and a mono file of the same tone gives the same samples as its dual-mono stereo version
    mono = decode_audio(encode("pcm_s16le", "wav", [tone(440, 1, rate)], rate), AudioLimits(), SR)
    np.testing.assert_allclose(mono, decode_audio(sine(), AudioLimits(), SR), atol=1e-6)


def test_sample_rate_change_mid_stream():
    """Two ADTS AAC streams back to back, 44.1 kHz then 22.05 kHz: both decode, nothing lost at the seam
    (each resampler is flushed before the next takes over)."""
    a = encode("aac", "adts", [tone(440, 0.5, 44100)], 44100)
    b = encode("aac", "adts", [tone(880, 0.5, 22050)], 22050)
    xa, xb = decode_audio(a, DEFAULTS, SR), decode_audio(b, DEFAULTS, SR)
    x = decode_audio(a + b, DEFAULTS, SR)
    assert abs(len(x) - (len(xa) + len(xb))) <= 1
    assert abs(peak_hz(x[: len(xa)]) - 440) < 3 and abs(peak_hz(x[len(xa) :]) - 880) < 3


def test_float_overshoot_is_clipped():
    rate = 16000
    x = decode_audio(encode("pcm_f32le", "wav", [tone(440, 0.5, rate, amp=1.5)], rate), AudioLimits(), SR)
    assert x.min() == -1.0 and x.max() == 1.0


def test_audio_hash():
    rate = 44100
    x = tone(440, 0.5, rate)
    wav = decode_audio(encode("pcm_s16le", "wav", [x], rate), AudioLimits(), SR)
    flac = decode_audio(encode("flac", "flac", [x], rate), AudioLimits(), SR)
    assert audio_hash(wav, SR) == audio_hash(flac, SR)  # lossless: same samples, another container
    assert audio_hash(wav, SR) != audio_hash(wav, 24000)
    assert audio_hash(wav, SR) != audio_hash(wav[:-1], SR)
    assert audio_hash(wav, SR) == audio_hash(wav.astype(np.float64), SR)  # hashed as float32


# ---- limits ----


def test_max_bytes():
    data = sine()
    assert f"over the {len(data) - 1} bytes size limit" in refused(data, AudioLimits(max_bytes=len(data) - 1))
    assert "no data" in refused(b"")


def with_xing_frames(mp3: bytes, frames: int) -> bytes:
    """Rewrite the frame count in LAME's Xing/Info header, which FFmpeg takes as the duration."""
    i = mp3.find(b"Info") if b"Info" in mp3[:1000] else mp3.find(b"Xing")
    assert 0 <= i < 1000
    assert struct.unpack(">I", mp3[i + 4 : i + 8])[0] & 1  # the frame-count field is present
    return mp3[: i + 8] + struct.pack(">I", frames) + mp3[i + 12 :]


@pytest.mark.alone
def test_duration_refused_from_header(monkeypatch):
    assert "from its header" in refused(sine(), AudioLimits(max_duration_s=0.5))
    # an mp3 whose header claims 10 hours: refused before any packet is decoded
    ten_hours = with_xing_frames(sine("libmp3lame", "mp3"), 36000 * 44100 // 1152)

    def boom(*a, **k):
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(audio.av, "AudioResampler", boom)  # the first decoded frame would build one
    t = time.perf_counter()
    msg = refused(ten_hours)
    assert time.perf_counter() - t < 1
    assert "from its header" in msg and "duration limit of 600 s" in msg


def test_duration_counted_while_decoding_when_the_header_lies():
    lying = with_xing_frames(sine("libmp3lame", "mp3", seconds=2.0), 2)
    with av.open(io.BytesIO(lying)) as c:  # the header now claims 2 frames: ~0.05 s
        assert c.duration < 0.1 * av.time_base
    assert len(decode_audio(lying, AudioLimits(), SR)) == 2 * SR  # decoding counts the real length
    msg = refused(lying, AudioLimits(max_duration_s=0.5))
    assert "runs past 0.5 s" in msg and "duration limit of 0.5 s" in msg


def test_deadline():
    assert "took longer than 0 s" in refused(sine(), AudioLimits(deadline_s=0))


# ---- hostile and odd inputs ----


@pytest.mark.parametrize("codec, fmt, rate", [("libmp3lame", "mp3", 44100), ("flac", "flac", 44100)])
@pytest.mark.parametrize("frac", [0.5, 0.9])
def test_truncated_decodes_what_it_can(codec, fmt, rate, frac):
    data = sine(codec, fmt, rate, seconds=2.0)
    x = decode_audio(data[: int(len(data) * frac)], AudioLimits(), SR)
    assert 0 < len(x) < 2 * SR
    assert abs(peak_hz(x) - 440) < 3


@pytest.mark.parametrize("codec, fmt, rate", [("libopus", "ogg", 48000), ("aac", "mp4", 44100)])
@pytest.mark.parametrize("frac", [0.5, 0.9])
def test_truncated_is_media_error_or_shorter(codec, fmt, rate, frac):
    data = sine(codec, fmt, rate, seconds=2.0)
    try:
        x = decode_audio(data[: int(len(data) * frac)], AudioLimits(), SR)
    except MediaError:
        return
    assert 0 < len(x) < 2 * SR


def test_empty_audio():
    assert "no samples" in refused(encode("pcm_s16le", "wav", [np.zeros(0)], 16000))


def test_video_only_file():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for _ in range(3):
            for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    assert "no audio stream" in refused(buf.getvalue())


@pytest.mark.parametrize(
    "data, expect",
    [
        (random.Random(0).randbytes(5000), "not valid audio"),
        (b"just some text\n" * 40, "not valid audio"),
        (b"\x89PNG\r\n\x1a\n" + bytes(200), "not valid audio"),
    ],
    ids=["random", "text", "png-ish"],
)
def test_not_audio(data, expect):
    assert expect in refused(data)


def test_corrupted_bytes_give_samples_or_media_error():
    rng = random.Random(2)
    for codec, fmt, rate, _ in FORMATS:
        data = sine(codec, fmt, rate)
        for _ in range(8):
            b = bytearray(data)
            for _ in range(8):
                b[rng.randrange(len(b))] = rng.randrange(256)
            try:
                x = decode_audio(bytes(b), AudioLimits(), SR)
            except MediaError:
                continue
            assert x.dtype == np.float32 and x.ndim == 1 and np.all(np.abs(x) <= 1)
