"""One choice run to its end for a reply that is not streamed (Anthropic's messages, transcriptions):
every delta fed to the choice's output parser, the request aborted if the caller leaves early, a
failure as the APIError it maps to."""

from __future__ import annotations

from foveal.engine.loop import StreamFailed
from foveal.parsing.output import ChoiceOutput
from foveal.request import FinishReason, TokenDelta
from foveal.server.errors import APIError, from_stream_error


async def run_whole(loop, stream, out: ChoiceOutput) -> TokenDelta:
    """The final delta of `stream` (one choice), every text fed to `out` and `out` finished."""
    final = None
    try:
        async for _, d in stream.deltas():
            out.feed(d.text)
            if d.finished:
                final = d
                out.finish(truncated=d.finish_reason is FinishReason.LENGTH)
    except StreamFailed as e:
        raise from_stream_error(e.error) from None
    finally:
        if not stream.finished:
            loop.abort(stream.request_id)
    if final.error:
        raise APIError(400 if final.error_type == "invalid_request_error" else 500, final.error)
    return final
