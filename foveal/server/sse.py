"""OpenAI response shapes for chat and text completions, streamed (SSE chunks) and whole.
Owns the JSON layout only; it never waits on the engine."""

from __future__ import annotations

import json

from foveal.request import TokenLogprobs


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def error_event(message: str, type_: str = "server_error") -> bytes:
    """An in-stream error (after headers were sent), in OpenAI's error shape."""
    return sse({"error": {"message": message, "type": type_, "param": None, "code": None}})


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Tally:
    """Token usage of one request: prompt (and prefix-cached) tokens count once per prompt, not once per
    choice (choice i belongs to prompt i // n); completion tokens count for every choice."""

    def __init__(self, n: int):
        self.n = n
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}
        self.completion = 0

    def add(self, index: int, final_delta) -> None:
        p = index // self.n
        self.prompt[p] = final_delta.num_prompt_tokens
        self.cached[p] = max(self.cached.get(p, 0), final_delta.num_cached_tokens)
        self.completion += final_delta.num_output_tokens

    def usage(self) -> dict:
        return usage(sum(self.prompt.values()), self.completion, sum(self.cached.values()))


def finish(reason) -> str | None:
    if reason is None:
        return None
    v = reason.value
    return v if v in ("stop", "length") else "error" if v == "error" else "abort"


class TokenText:
    """Token id -> text piece (cached); used for logprobs only."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.tok.decode([tid])
        return s


def chat_logprobs(lps: list[TokenLogprobs], text: TokenText) -> dict:
    def entry(tid, lp):
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
            for lp in lps
        ]
    }


def completion_logprobs(lps: list[TokenLogprobs], text: TokenText, offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = text(lp.token_id)
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({text(t.token_id): t.logprob for t in lp.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_completion_logprobs(acc: dict | None, new: dict) -> dict:
    if acc is None:
        return new
    for k in acc:
        acc[k].extend(new[k])
    return acc
