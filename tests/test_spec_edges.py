"""Speculative decoding at the edges: the `--speculative-config` flag, the `speculative` request field
(and its place in /openapi.json), and the spec_decode series of /metrics and /v1/metrics. Tiny random
Llama (load_format dummy, the synthetic tokenizer) behind a real server; the engine side of speculation
is tested in test_speculative.py."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from foveal import cli
from foveal.config import EngineConfig, SpeculativeConfig
from foveal.metrics import StepReport, SummarySink
from foveal.metrics.prometheus import PrometheusSink
from tests.test_server import serving

NGRAM = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
    "adaptive": False,  # every row drafts whenever it can: these tests are about verification
}  # fmt: skip
ADMIN, TENANT = "sk-admin", "sk-tenant"
PROMPT = [17, 42, 99, 123, 7] * 4  # repeats itself: the n-gram lookup drafts from the first step


# -- the flag ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_speculative_config_reaches_the_engine_config(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    a = cli.build_parser().parse_args([command, "--speculative-config", json.dumps(NGRAM), *extra])
    cfg = EngineConfig.from_kwargs(**cli._engine_kwargs(a))
    assert cfg.speculative == SpeculativeConfig(**NGRAM)
    off = cli.build_parser().parse_args([command, *extra])
    assert EngineConfig.from_kwargs(**cli._engine_kwargs(off)).speculative is None


@pytest.mark.parametrize(
    "value, message",
    [
        ("{method: ngram}", "not valid JSON"),
        ('["ngram"]', "must be a JSON object"),
        ('{"method": "medusa"}', "unknown speculative method 'medusa'"),
        ('{"method": "ngram", "num_lookahead": 3}', "unknown speculative config key(s): num_lookahead"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"num_speculative_tokens": 4}', "needs a method"),
    ],
)
def test_cli_bad_speculative_config_is_an_argparse_error(value, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", "--speculative-config", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --speculative-config" in err and message in err and "Traceback" not in err


# -- the sinks, without a server -----------------------------------------------------------------------


def _stats(drafts, tokens, accepted, per_pos):
    n = drafts
    return {
        "num_drafts": n,
        "num_draft_tokens": tokens,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": per_pos,
        "acceptance_rate": accepted / tokens if tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / n if n else 0.0,
        "method": "ngram",
    }


def _series(text: str) -> dict[str, float]:
    """name{labels} -> value of the foveal_spec_decode_* samples of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"(foveal_spec_decode_\w+(?:\{[^}]*\})?) (\S+)$", line)
        if m and not m.group(1).split("{")[0].endswith("_created"):
            out[m.group(1)] = float(m.group(2))
    return out


def test_prometheus_counters_follow_the_lifetime_totals():
    sink = PrometheusSink()
    sink.step(StepReport(0, 0, 0.0))  # not speculating: no spec series at all
    assert _series(sink.render().decode()) == {}
    sink.step(StepReport(1, 0, 0.1, spec=_stats(2, 8, 3, [2, 1, 0, 0])))
    sink.step(StepReport(1, 0, 0.1, spec=_stats(2, 8, 3, [2, 1, 0, 0])))  # no new drafts: none counted
    sink.step(StepReport(1, 0, 0.1, spec=_stats(5, 20, 9, [4, 3, 1, 1])))
    assert _series(sink.render().decode()) == {
        "foveal_spec_decode_num_drafts_total": 5,
        "foveal_spec_decode_num_draft_tokens_total": 20,
        "foveal_spec_decode_num_accepted_tokens_total": 9,
        'foveal_spec_decode_num_accepted_tokens_per_pos_total{position="0"}': 4,
        'foveal_spec_decode_num_accepted_tokens_per_pos_total{position="1"}': 3,
        'foveal_spec_decode_num_accepted_tokens_per_pos_total{position="2"}': 1,
        'foveal_spec_decode_num_accepted_tokens_per_pos_total{position="3"}': 1,
    }


def test_summary_shows_speculation_to_admins_only():
    sink = SummarySink()
    assert sink.to_dict()["summary"]["speculative"] is None
    sink.step(StepReport(1, 0, 0.1, spec=_stats(2, 8, 3, [2, 1, 0, 0])))
    assert sink.to_dict()["summary"]["speculative"] == _stats(2, 8, 3, [2, 1, 0, 0])
    assert "speculative" not in json.dumps(sink.tenant_dict("a"))  # global figures, as kv usage
    sink.step(StepReport(1, 0, 0.1))
    assert sink.to_dict()["summary"]["speculative"] is None


# -- a real server -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.tiny import tiny_llama_config_file

    return tiny_llama_config_file(tmp_path_factory.mktemp("spec_edges"))


def _engine_kw(folder, **kw):
    return dict(model=str(folder), load_format="dummy", block_size=4, max_model_len=160, **kw)


@pytest.fixture(scope="module")
def spec(folder):
    keys = ((ADMIN, "ops", True), (TENANT, "a", False))
    with serving(_engine_kw(folder, speculative_config=NGRAM), {"api_keys": keys}) as s:
        yield s


@pytest.fixture(scope="module")
def plain(folder):
    with serving(_engine_kw(folder), {}) as s:
        yield s


def _post(s, path, body, key=ADMIN):
    return httpx.post(s.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _get(s, path, key=ADMIN):
    return httpx.get(s.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _complete(s, **extra):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, **extra}
    r = _post(s, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _reported(s, path, ok, within=5.0):
    """GET path until ok(response) (the loop reports a step just after delivering its tokens)."""
    deadline = time.monotonic() + within
    while True:
        r = _get(s, path)
        assert r.status_code == 200, r.text
        if ok(r) or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_speculative_field_opts_out_and_greedy_text_is_the_same(spec):
    stats = spec.engine.speculation.stats
    before = stats.num_drafts
    off = _complete(spec, speculative=False)
    assert stats.num_drafts == before  # the opted-out request never drafted
    on = _complete(spec)
    assert stats.num_drafts > before  # the repetitive prompt drafted
    assert on == off and on
    assert _complete(spec, speculative=True) == on
    chat = {"messages": [{"role": "user", "content": "t5 t6 t5 t6"}], "max_tokens": 8, "temperature": 0}
    for flag in (True, False):
        r = _post(spec, "/v1/chat/completions", {**chat, "speculative": flag})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_speculative_must_be_a_bool(spec, value):
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        r = _post(spec, path, {**body, "speculative": value})
        assert r.status_code == 400, r.text
        assert "speculative" in r.json()["error"]["message"]


def test_openapi_publishes_the_speculative_field(spec):
    doc = httpx.get(spec.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        prop = schemas[name]["properties"]["speculative"]
        assert prop["type"] == "boolean" and prop["default"] is True


def test_metrics_expose_spec_decode_counts(spec):
    _complete(spec)
    stats = spec.engine.speculation.stats
    r = _reported(
        spec,
        "/metrics",
        lambda r: _series(r.text).get("foveal_spec_decode_num_drafts_total") == stats.num_drafts,
    )
    got = _series(r.text)
    assert got["foveal_spec_decode_num_drafts_total"] == stats.num_drafts > 0
    assert got["foveal_spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens > 0
    assert got["foveal_spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    for j, n in enumerate(stats.accepted_per_pos):
        assert got[f'foveal_spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] == n

    r = _reported(spec, "/v1/metrics", lambda r: r.json()["summary"]["speculative"] is not None)
    summary = r.json()["summary"]["speculative"]
    assert summary["method"] == "ngram"
    assert summary["num_drafts"] > 0 and summary["num_draft_tokens"] > 0
    assert len(summary["accepted_per_pos"]) == NGRAM["num_speculative_tokens"]
    assert 0.0 <= summary["acceptance_rate"] <= 1.0 and summary["mean_acceptance_length"] >= 1.0
    mine = _get(spec, "/v1/metrics", key=TENANT)  # a tenant's view has no global engine figures
    assert mine.status_code == 200 and "speculative" not in mine.text


def test_without_speculation_there_are_no_spec_figures(plain):
    for flag in (True, False):  # the field is accepted, and does nothing
        assert _complete(plain, speculative=flag)
    assert plain.engine.speculation is None
    r = _reported(plain, "/v1/metrics", lambda r: r.json()["summary"]["num_running"] == 0)
    assert r.json()["summary"]["speculative"] is None
    assert "foveal_spec_decode" not in _get(plain, "/metrics").text
