"""Video inputs: encoded bytes in (from `media.read_media_bytes(..., kind="video")`), sampled RGB frames out.

Owns the limits that stop one request from holding a decode thread or gigabytes of memory: encoded bytes,
duration, pixels a frame, frames and decoded bytes a video, and a wall-clock deadline. The order of work is
what makes them hold: the header is checked first (size, duration), then the packets are demuxed without
decoding anything (a cheap count of the frames, and a second duration check, since a header can lie), the
sampler picks frame indices from that count, the indices are checked against the frame and memory limits,
and only then are frames decoded, up to the last one picked. Every problem with the input is a
`MediaError`; no PyAV/FFmpeg exception gets out. Synchronous on purpose: callers run it on a thread pool,
which is the parallelism, so each decode uses one codec thread. It must not import torch or foveal.engine.
"""

from __future__ import annotations

import errno
import hashlib
import io
import operator
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import av
import numpy as np

from foveal.models.vlm import uniform_frames
from foveal.server import av_errors
from foveal.server.media import MediaError, _fmt_bytes

# FFmpeg demuxer names ("mov" is mp4/m4v/mov/3gp, "matroska" is mkv/webm). The rest stay out of reach of
# untrusted bytes: playlist and manifest demuxers (hls, dash, concat, sdp) open further URLs or sockets.
VIDEO_FORMATS = ("mov", "matroska", "avi", "ogg", "mpegts")
VIDEO_CONTAINERS = "mp4/mov, webm/mkv, avi, ogg, mpeg-ts"
DEFAULT_SAMPLE_FPS = 2.0  # decode_video's sampler when the caller passes none


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_bytes: int = 64 * 2**20  # encoded bytes (media.read_media_bytes caps the read; checked again here)
    max_duration_s: float = 600.0  # from the header before decoding, then from packet timestamps
    max_frames: int = 768  # most sampled frames one video may give
    max_frame_pixels: int = 4096 * 2160  # width*height from the header, and of every decoded frame
    max_decoded_bytes: int = 2 * 2**30  # sampled frames kept in memory, T*H*W*3, checked before decoding
    deadline_s: float = 30.0  # wall time for one decode_video call


@dataclass(frozen=True, slots=True)
class VideoMetadata:
    total_frames: int  # counted by demuxing packets (no decode), not trusted from the header
    fps: float  # the stream's average rate (frames / duration if the header has none)
    duration_s: float  # first frame's start to last frame's end, from packet timestamps
    width: int
    height: int


@dataclass(slots=True)
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB, the sampled frames in order
    indices: list[int]  # each sampled frame's index among the stream's frames, in presentation order
    timestamps: list[float]  # each sampled frame's presentation time in seconds from the stream start
    metadata: VideoMetadata


def uniform_indices(
    meta: VideoMetadata, *, fps: float | None = None, num_frames: int | None = None, max_frames: int
) -> list[int]:
    """`num_frames` frames spread evenly over the clip, or `fps` frames a second of it (every frame when
    neither is given), capped by `max_frames` and by the clip's frames, at least one.

    transformers' `default_sample_indices_fn` rule (models/vlm.py uniform_frames)."""
    if meta.total_frames <= 0:
        return []
    return uniform_frames(meta.total_frames, meta.fps, fps=fps, num_frames=num_frames, max_frames=max_frames)


def decode_video(
    data: bytes,
    limits: VideoLimits,
    choose: Callable[[VideoMetadata], list[int]] | None = None,
    reserve: Callable[[int], None] | None = None,
) -> Video:
    """Decode the frames `choose(metadata)` picks (default: `DEFAULT_SAMPLE_FPS` frames a second, at most
    `limits.max_frames`) from the first video stream of `data`. `reserve(nbytes)`, when given, is
    called with the decoded frames' size once it is known and before any frame is decoded (a budget
    shared across requests: it may wait, or raise to refuse).

    An exception `choose` raises is passed on as it is (a sampler bug is not the user's 400); the indices
    it returns are checked: increasing, distinct, in range, within max_frames and max_decoded_bytes."""
    deadline = time.monotonic() + limits.deadline_s
    if not data:
        raise MediaError("video has no data")
    if len(data) > limits.max_bytes:
        raise MediaError(f"video is over the {_fmt_bytes(limits.max_bytes)} size limit")
    with _opened(data, limits, deadline) as (container, stream):
        meta, ticks = _scan(container, stream, limits, deadline)
    if choose is None:
        chosen = uniform_indices(meta, fps=DEFAULT_SAMPLE_FPS, max_frames=limits.max_frames)
    else:
        chosen = choose(meta)
    indices = _checked_indices(chosen, meta, limits)
    if reserve is not None:
        reserve(len(indices) * meta.width * meta.height * 3)
    # a second open instead of a seek back: seeking lands where a (possibly hostile) index says
    with _opened(data, limits, deadline) as (container, stream):
        frames = _decode_chosen(container, stream, indices, ticks, meta, limits, deadline)
        tb = _time_base(stream)
    times = [(ticks[i] - ticks[0]) * tb for i in indices]
    return Video(frames=frames, indices=indices, timestamps=times, metadata=meta)


def video_hash(video: Video) -> str:
    """sha256 hex over the frames' shape and bytes and the sampled indices: the same clip sampled the same
    way hashes equal whatever URL it came by."""
    frames = np.ascontiguousarray(video.frames)
    h = hashlib.sha256(f"{frames.dtype}|{'x'.join(map(str, frames.shape))}|".encode())
    h.update(memoryview(frames).cast("B"))
    h.update(("|" + ",".join(map(str, video.indices))).encode())
    return h.hexdigest()


# ---- the three passes ----


@contextmanager
def _opened(
    data: bytes, limits: VideoLimits, deadline: float
) -> Iterator[tuple[av.container.InputContainer, av.VideoStream]]:
    """The container and its first video stream; any PyAV error inside the block becomes a MediaError."""
    remaining = max(deadline - time.monotonic(), 0.001)
    try:
        container = av.open(
            io.BytesIO(data),
            mode="r",
            container_options={"format_whitelist": ",".join(VIDEO_FORMATS)},
            # every stream's probe decode (find_stream_info) runs on one thread and refuses a frame over
            # max_frame_pixels before allocating it; the stream's size then reads 0 (refused below)
            options={"threads": "1", "max_pixels": str(limits.max_frame_pixels)},
            timeout=(remaining, remaining),  # FFmpeg's interrupt callback: open, probe and each read
        )
    except Exception as e:
        raise av_errors.open_failed(
            e, "video", limits.deadline_s, "not a valid video", VIDEO_CONTAINERS
        ) from e
    try:
        streams = [
            s for s in container.streams.video if not s.disposition & av.stream.Disposition.attached_pic
        ]
        if not streams:
            raise MediaError("no video stream in the file")
        stream = streams[0]
        if stream.codec_context is None:
            raise MediaError("no decoder for the video's codec in this build")
        yield container, stream
    except MediaError:
        raise
    except Exception as e:
        raise av_errors.corrupt(e, "video", limits.deadline_s) from e
    finally:
        try:
            container.close()
        except Exception:  # closing a broken input can raise too; nothing left to report
            pass


def _scan(
    container: av.container.InputContainer, stream: av.VideoStream, limits: VideoLimits, deadline: float
) -> tuple[VideoMetadata, list[int]]:
    """Header checks, then one demux pass (no decode): the metadata, and each frame's presentation
    timestamp (in the stream's time base) in presentation order."""
    width, height = stream.codec_context.width, stream.codec_context.height
    _check_frame_size(width, height, limits)
    claimed = av_errors.check_claimed_duration(container, stream, "video", limits.max_duration_s)
    tb = _time_base(stream)
    ticks: list[int] = []
    first = end = None
    for n, packet in enumerate(container.demux(stream)):
        if n % 64 == 0:
            _check_deadline(deadline, limits)
        if packet.size == 0 or packet.is_discard:  # the end-of-stream flush; frames an edit list cuts
            continue
        t = packet.pts if packet.pts is not None else packet.dts
        if t is None:  # no timestamps: assume the frame follows the previous one
            t = end if end is not None else 0
        ticks.append(t)
        first = t if first is None else min(first, t)
        end = max(end if end is not None else t, t + max(packet.duration or 0, 0))
        if (end - first) * tb > limits.max_duration_s:
            raise MediaError(
                f"video's frames run past {limits.max_duration_s:g} s (its header said {claimed:.1f} s), "
                f"over the duration limit of {limits.max_duration_s:g} s"
            )
    if not ticks:
        raise MediaError("video has no frames (empty or truncated)")
    ticks.sort()  # packets come in decode order; B-frames put presentation order elsewhere
    duration = (end - first) * tb
    rate = stream.average_rate
    if rate and rate > 0:
        fps = float(rate)
    else:
        fps = len(ticks) / duration if duration > 0 else 0.0
    return VideoMetadata(len(ticks), fps, duration, width, height), ticks


def _checked_indices(chosen, meta: VideoMetadata, limits: VideoLimits) -> list[int]:
    indices = [operator.index(i) for i in chosen]  # a TypeError here is the sampler's bug, not the user's
    if not indices:
        raise MediaError("frame sampling chose no frames")
    if len(indices) > limits.max_frames:
        raise MediaError(
            f"frame sampling chose {len(indices)} frames, "
            f"over the limit of {limits.max_frames} frames a video"
        )
    if any(b <= a for a, b in zip(indices, indices[1:])):
        raise MediaError("frame sampling must choose increasing, distinct frame indices")
    if indices[0] < 0 or indices[-1] >= meta.total_frames:
        bad = indices[0] if indices[0] < 0 else indices[-1]
        raise MediaError(f"frame index {bad} is out of range: the video has {meta.total_frames} frames")
    need = len(indices) * meta.width * meta.height * 3
    if need > limits.max_decoded_bytes:
        raise MediaError(
            f"{len(indices)} frames of {meta.width}x{meta.height} need {_fmt_bytes(need)} decoded, "
            f"over the limit of {_fmt_bytes(limits.max_decoded_bytes)}"
        )
    return indices


def _decode_chosen(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    indices: list[int],
    ticks: list[int],
    meta: VideoMetadata,
    limits: VideoLimits,
    deadline: float,
) -> np.ndarray:
    """Decode up to the last chosen frame, converting only the chosen ones to RGB."""
    ctx = stream.codec_context
    ctx.thread_count = 1
    ctx.options = {"max_pixels": str(limits.max_frame_pixels)}  # the decoder refuses a bigger frame itself
    # a frame's index comes from its pts, so frames the decoder drops (those before a stream's first
    # keyframe) do not shift the rest; counting is the fallback, and the rule when timestamps repeat
    index_of = {t: i for i, t in enumerate(ticks)} if len(set(ticks)) == len(ticks) else {}
    slot = {index: k for k, index in enumerate(indices)}
    out = np.empty((len(indices), meta.height, meta.width, 3), np.uint8)
    got, i, last, failure = 0, -1, indices[-1], None
    try:
        for packet in container.demux(stream):
            _check_deadline(deadline, limits)
            for frame in packet.decode():
                _check_frame_size(frame.width, frame.height, limits)
                j = index_of.get(frame.pts) if frame.pts is not None else None
                i = j if j is not None and j > i else i + 1
                k = slot.get(i)
                if k is not None:
                    # a stream may change size mid-way: every frame is scaled to the header's size
                    out[k] = frame.to_ndarray(format="rgb24", width=meta.width, height=meta.height)
                    got += 1
                if i >= last:
                    if got == len(indices):
                        return out
                    raise MediaError(
                        f"corrupt video: {len(indices) - got} of the {len(indices)} chosen frames "
                        "did not decode"
                    )
    except (MediaError, MemoryError, av.error.ExitError):
        raise
    except Exception as e:  # a corrupt packet: what decoded before it stands, the rest does not come
        failure = e
    why = ""
    if getattr(failure, "errno", None) == errno.EINVAL:  # what the decoder's max_pixels refusal returns
        why = f" (a frame is invalid or over the limit of {limits.max_frame_pixels} pixels a frame)"
    elif failure is not None:
        why = f" ({av_errors.reason(failure)})"
    raise MediaError(
        f"corrupt or truncated video: {got} of the {len(indices)} chosen frames decoded "
        f"(frames up to index {i} of {meta.total_frames}){why}"
    )


# ---- helpers ----


def _check_frame_size(width: int, height: int, limits: VideoLimits) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(
            "video frame size is unknown (a corrupt stream, or frames over the limit of "
            f"{limits.max_frame_pixels} pixels a frame)"
        )
    if width * height > limits.max_frame_pixels:
        raise MediaError(
            f"video frames are {width}x{height} = {width * height} pixels, "
            f"over the limit of {limits.max_frame_pixels} pixels a frame"
        )


def _time_base(stream: av.VideoStream) -> float:
    return float(stream.time_base or 0) or 1 / 90000  # a stream always has one; 90 kHz is MPEG's clock


def _check_deadline(deadline: float, limits: VideoLimits) -> None:
    if time.monotonic() > deadline:
        raise av_errors.timed_out("video", limits.deadline_s)
