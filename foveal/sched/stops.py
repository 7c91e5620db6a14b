"""Why a request stops: every rule in one module, each applied where its evidence is.

    rule                                      reason   evidence             applied by
    an EOS (unless ignore_eos) or a stop id   STOP     the token, after     Scheduler.resolve, per token
                                                       min_tokens           (a run is cut after it)
    max_tokens reached, or the context full   LENGTH   the counts           Scheduler.resolve; .advance
                                                                            for a token still in flight
    a stop string                             STOP     the detokenized      Engine._emit (the run is cut
                                                       text                 where the string ends)
    the grammar complete                      STOP     the guide            Engine._resolve
    the answer closed for max_tokens          LENGTH   the guide            Engine._resolve
    the guide or the detokenizer failed       ERROR

When a token stop and a later rule meet on the same token: a stop string's STOP replaces a length
stop (Engine._emit), and `after_guide_end` says which reason a guide's end leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from foveal.request import FinishReason

if TYPE_CHECKING:
    from foveal.request import Request


def token_stop(req: Request, tok: int, num_out: int, max_model_len: int) -> FinishReason | None:
    """Why the request ends at `tok`, its num_out-th output token, or None."""
    p = req.params
    if num_out >= p.min_tokens:
        if (tok in req.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return FinishReason.STOP
    if length_reached(req, num_out, req.num_prompt_tokens + num_out, max_model_len):
        return FinishReason.LENGTH
    return None


def length_reached(req: Request, num_out: int, num_tokens: int, max_model_len: int) -> bool:
    """Whether num_out output tokens (num_tokens in all) reach max_tokens or the context."""
    p = req.params
    return (p.max_tokens is not None and num_out >= p.max_tokens) or num_tokens >= max_model_len


def after_guide_end(current: FinishReason | None, closed_for_length: bool) -> FinishReason:
    """The grammar is complete (nothing but EOS could follow): STOP, or LENGTH where the answer was
    closed early for max_tokens, even where its last token was an EOS (a STOP already decided turns
    into LENGTH); any other reason already decided stays."""
    reason = FinishReason.LENGTH if closed_for_length else FinishReason.STOP
    if current is None or (current is FinishReason.STOP and reason is FinishReason.LENGTH):
        return reason
    return current
