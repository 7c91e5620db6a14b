"""Schemathesis hooks for schemathesis_run.py (loaded through $SCHEMATHESIS_HOOKS; not run by itself).

before_call: keep generation short on a CPU box: an integer max_tokens / max_completion_tokens above
    $ADV_MAX_TOKENS_HINT is lowered to it, and a body with neither (or a null one) gets max_tokens =
    the hint (a chat request without one would generate up to the context length); /v1/responses'
    max_output_tokens likewise, and nothing is added where a route generates nothing (embeddings,
    token counts); min_tokens, n and
    best_of are capped, and a list of more than 4 prompts is cut to 4. Values of a wrong type are left
    alone: those are the negative cases. Runs before every call, in every phase.
after_call / after_network_error: one JSON line per request in $ADV_CALL_LOG (method, path, status;
    the request and response bodies of a 5xx), so the runner counts requests and 5xx itself.
"""

from __future__ import annotations

import json
import os
import threading

import schemathesis

HINT = int(os.environ.get("ADV_MAX_TOKENS_HINT", "8"))
LOG = os.environ.get("ADV_CALL_LOG")
_lock = threading.Lock()


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# the field that bounds generation, per route (None: the route generates nothing); default max_tokens
_LIMIT = {
    "/v1/responses": ("max_output_tokens",),
    "/v1/embeddings": None,
    "/v1/messages/count_tokens": None,
    "/v1/responses/input_tokens": None,
}


def _clamp(body: dict, path: str = "") -> None:
    fields = _LIMIT.get(path, ("max_tokens", "max_completion_tokens"))
    if fields is None:
        return
    for k in fields:
        if _int(body.get(k)) and body[k] > HINT:
            body[k] = HINT
    if not any(_int(body.get(k)) for k in fields) and body.get(fields[0]) is None:
        body[fields[0]] = HINT
    for k, cap in (("min_tokens", HINT), ("n", 2), ("best_of", 2), ("top_logprobs", 5), ("logprobs", 5)):
        if _int(body.get(k)) and body[k] > cap:
            body[k] = cap
    p = body.get("prompt")
    if isinstance(p, list) and len(p) > 4 and not all(_int(x) for x in p):
        body["prompt"] = p[:4]


def _write(rec: dict) -> None:
    if LOG:
        with _lock, open(LOG, "a") as f:
            f.write(json.dumps(rec, default=repr) + "\n")


@schemathesis.hook
def before_call(context, case, kwargs):
    if isinstance(case.body, dict):
        _clamp(case.body, case.path)


@schemathesis.hook
def after_call(context, case, response):
    rec = {"method": case.method, "path": case.path, "status": response.status_code}
    if response.status_code >= 500:
        rec["request_body"] = repr(case.body)[:1000]
        rec["response"] = response.text[:1000] if hasattr(response, "text") else None
    _write(rec)


@schemathesis.hook
def after_network_error(context, case, request):
    _write({"method": case.method, "path": case.path, "status": None, "network_error": True})
