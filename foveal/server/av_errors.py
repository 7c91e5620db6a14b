"""PyAV's exceptions as the user's MediaErrors, shared by the video and audio decoders (server/video.py,
server/audio.py): a deadline that ran out inside FFmpeg, memory, or the short reason FFmpeg gives."""

from __future__ import annotations

import errno

import av

from foveal.server.media import MediaError, _short


def timed_out(what: str, deadline_s: float) -> MediaError:
    return MediaError(f"decoding the {what} took longer than {deadline_s:g} s")


def media_error(e: Exception, what: str, deadline_s: float, message: str) -> MediaError:
    """The MediaError to raise for PyAV's `e`; `message` unless a deadline or memory ran out."""
    if isinstance(e, av.error.ExitError):  # FFmpeg's interrupt callback: the deadline passed mid-call
        return timed_out(what, deadline_s)
    if isinstance(e, MemoryError):
        return MediaError(f"not enough memory to decode the {what}")
    return MediaError(message)


def reason(e: BaseException) -> str:
    """PyAV's own message is long (file name, log lines): FFmpeg's short error string is enough."""
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return _short(str(text))


def open_failed(e: Exception, what: str, deadline_s: float, invalid: str, containers: str) -> MediaError:
    """`av.open` refused the bytes: EINVAL is the format whitelist refusing what FFmpeg recognized (a
    PNG, a playlist, a container of the other kind)."""
    why = "not a supported container" if getattr(e, "errno", None) == errno.EINVAL else reason(e)
    return media_error(e, what, deadline_s, f"{invalid} ({why}); containers: {containers}")


def corrupt(e: Exception, what: str, deadline_s: float) -> MediaError:
    return media_error(e, what, deadline_s, f"corrupt or truncated {what}: {reason(e)}")


def check_claimed_duration(container, stream, what: str, max_duration_s: float) -> float:
    """The longest duration the container or the stream header claims (0 when none), refused over
    the limit before anything is decoded."""
    claims = []
    if container.duration is not None:
        claims.append(container.duration / av.time_base)
    if stream.duration is not None and stream.time_base:
        claims.append(float(stream.duration * stream.time_base))
    claimed = max(claims, default=0.0)
    if claimed > max_duration_s:
        limit = f"over the duration limit of {max_duration_s:g} s"
        raise MediaError(f"{what} is {claimed:.1f} s long (from its header), {limit}")
    return claimed
