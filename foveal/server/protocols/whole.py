"""A choice's deltas through its output parser: one at a time (`events_of`, for the streamed replies of
Anthropic's messages and transcriptions), or run to the end for a reply that is not streamed
(`run_whole`: the request aborted if the caller leaves early, a failure as the APIError it maps to)."""

from __future__ import annotations

from foveal.engine.loop import StreamFailed
from foveal.parsing.output import ChoiceOutput
from foveal.request import FinishReason, TokenDelta
from foveal.server.errors import APIError, from_stream_error


def events_of(out: ChoiceOutput, d: TokenDelta) -> list:
    """A delta's output events (its text fed to the parser; the parser finished on the last delta)."""
    events = out.feed(d.text)
    if d.finished:
        events += out.finish(truncated=d.finish_reason is FinishReason.LENGTH)
    return events


async def run_whole(loop, stream, out: ChoiceOutput) -> TokenDelta:
    """The final delta of `stream` (one choice), every text fed to `out` and `out` finished."""
    final = None
    try:
        async for _, d in stream.deltas():
            events_of(out, d)
            if d.finished:
                final = d
    except StreamFailed as e:
        raise from_stream_error(e.error) from None
    finally:
        if not stream.finished:
            loop.abort(stream.request_id)
    if final.error:
        raise APIError(400 if final.error_type == "invalid_request_error" else 500, final.error)
    return final
