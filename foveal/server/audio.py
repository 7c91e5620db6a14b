"""Audio inputs: encoded bytes in (from `media.read_media_bytes(..., kind="audio")`), mono float32 samples at
the model's sampling rate out.

Owns the limits that stop one request from holding a decode thread or unbounded memory: encoded bytes,
duration (from the header before anything is decoded, then by counting decoded samples, since a header can
lie) and a wall-clock deadline. Decoding and resampling are FFmpeg's (PyAV); the downmix to mono is the
channels' mean, as librosa's: FFmpeg's own (-3 dB a channel) makes identical channels 1.41x louder and
clips a loud stereo file. A corrupt tail ends the audio where decoding failed. Every problem with the
input is a `MediaError`; no PyAV/FFmpeg exception gets out. Synchronous on purpose: callers run it on a
thread pool, so each decode uses one codec thread. It must not import torch or foveal.engine.
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass

import av
import numpy as np

from foveal.server import av_errors
from foveal.server.media import MediaError, _fmt_bytes

# FFmpeg demuxer names ("mov" is m4a/mp4, "matroska" is webm/mka, "ogg" carries opus and vorbis). The rest
# stay out of reach of untrusted bytes: playlist demuxers (hls, concat, sdp) open further URLs or sockets.
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "mov", "matroska", "aac", "aiff")
AUDIO_CONTAINERS = "wav, mp3, flac, ogg/opus, m4a/mp4, webm/mka, aac, aiff"


@dataclass(frozen=True, slots=True)
class AudioLimits:
    max_bytes: int = 25 * 2**20  # encoded bytes; OpenAI's transcription upload limit
    max_duration_s: float = 600.0  # from the header before decoding, and by decoded samples while decoding
    deadline_s: float = 30.0  # wall time for one decode_audio call


def decode_audio(data: bytes, limits: AudioLimits, sampling_rate: int) -> np.ndarray:
    """The first audio stream of `data`, resampled to `sampling_rate` and downmixed to mono (the mean of
    the channels): float32, 1-D, in [-1, 1]."""
    if sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be positive, got {sampling_rate}")
    deadline = time.monotonic() + limits.deadline_s
    if not data:
        raise MediaError("audio has no data")
    if len(data) > limits.max_bytes:
        raise MediaError(f"audio is over the {_fmt_bytes(limits.max_bytes)} size limit")
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        container = av.open(
            io.BytesIO(data),
            mode="r",
            container_options={"format_whitelist": ",".join(AUDIO_FORMATS)},
            options={"threads": "1"},
            timeout=(remaining, remaining),  # FFmpeg's interrupt callback: open, probe and each read
        )
    except Exception as e:
        raise av_errors.open_failed(e, "audio", limits.deadline_s, "not valid audio", AUDIO_CONTAINERS) from e
    try:
        return _decode(container, limits, sampling_rate, deadline)
    except MediaError:
        raise
    except Exception as e:
        raise av_errors.corrupt(e, "audio", limits.deadline_s) from e
    finally:
        try:
            container.close()
        except Exception:  # closing a broken input can raise too; nothing left to report
            pass


def audio_hash(samples: np.ndarray, sampling_rate: int) -> str:
    """sha256 hex over the sampling rate and the float32 samples: the same sound decoded at the same rate
    hashes equal whatever URL or container it came in."""
    samples = np.ascontiguousarray(samples, dtype="<f4")
    h = hashlib.sha256(f"float32|{sampling_rate}|{samples.size}|".encode())
    h.update(memoryview(samples).cast("B"))
    return h.hexdigest()


def _decode(
    container: av.container.InputContainer, limits: AudioLimits, sampling_rate: int, deadline: float
) -> np.ndarray:
    if not container.streams.audio:
        raise MediaError("no audio stream in the file")
    stream = container.streams.audio[0]
    if stream.codec_context is None:
        raise MediaError("no decoder for the audio's codec in this build")
    claimed = av_errors.check_claimed_duration(container, stream, "audio", limits.max_duration_s)
    stream.codec_context.thread_count = 1  # FFmpeg's audio decoders take one today; keep it so
    resampler, setup = None, None
    chunks: list[np.ndarray] = []
    seconds = 0.0  # decoded so far, on the input's own clock
    failure = None
    for packet in container.demux(stream):
        if time.monotonic() > deadline:
            raise av_errors.timed_out("audio", limits.deadline_s)
        try:
            frames = packet.decode()
        except (MemoryError, av.error.ExitError):
            raise
        except Exception as e:  # a corrupt packet: what decoded before it stands, the rest does not come
            failure = e
            break
        for frame in frames:
            if frame.sample_rate <= 0:
                raise MediaError("corrupt audio: a frame has no sample rate")
            seconds += frame.samples / frame.sample_rate
            if seconds > limits.max_duration_s:
                raise MediaError(
                    f"audio runs past {limits.max_duration_s:g} s (its header said {claimed:.1f} s), "
                    f"over the duration limit of {limits.max_duration_s:g} s"
                )
            # a stream may change rate or layout mid-way: a resampler takes one input setup
            if (frame.format.name, frame.layout.name, frame.sample_rate) != setup:
                if resampler is not None:
                    chunks += _samples(resampler.resample(None))
                # planar float, channels kept (layout None): _samples takes their mean
                resampler = av.AudioResampler(format="fltp", rate=sampling_rate)
                setup = (frame.format.name, frame.layout.name, frame.sample_rate)
            chunks += _samples(resampler.resample(frame))
    if resampler is not None:
        chunks += _samples(resampler.resample(None))
    total = sum(len(c) for c in chunks)
    if total == 0:
        why = f": corrupt or truncated ({av_errors.reason(failure)})" if failure is not None else ""
        raise MediaError(f"audio has no samples{why}")
    samples = np.concatenate(chunks)
    return np.clip(samples, -1.0, 1.0, out=samples)  # float codecs and resampling can overshoot full scale


def _samples(frames: list[av.AudioFrame]) -> list[np.ndarray]:
    # planar float: to_ndarray() is [channels, samples]
    return [f.to_ndarray().mean(axis=0, dtype=np.float32) for f in frames]
