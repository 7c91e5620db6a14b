"""LoRA adapters through the OpenAI-compatible server, end to end: a real uvicorn server (tests/
test_server.py's helpers) on a tiny qwen3 base with PEFT adapters (tests/lora_models.py). The request's
`model` picks the adapter; /v1/models lists them; /v1/load_lora_adapter and /v1/unload_lora_adapter
change them at run time (admins only under auth); /metrics counts requests per adapter."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from foveal.request import SamplingParams
from tests.lora_models import adapter_folders, base_folder, save_adapter
from tests.test_server import _free_soon, serving

ENGINE = dict(num_blocks=128, block_size=4, max_model_len=128, max_loras=2, max_lora_rank=16)
PROMPT = [5, 77, 120, 33, 250, 9, 64, 200, 18, 140]  # token ids: no tokenizer in between
MAX_TOKENS = 8
ADMIN, USER = "sk-admin", "sk-user"
BASE = "tiny-base"  # the main server's --served-model-name


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base folder and three adapters (ranks 8, 16, 8): a, b served from the start; c loaded later."""
    base = base_folder(tmp_path_factory.mktemp("base"))
    (a, pa), (b, pb), (c, pc) = adapter_folders(tmp_path_factory, ranks=(8, 16, 8))
    return base, {"a": (a, pa), "b": (b, pb), "c": (c, pc)}


@pytest.fixture(scope="module")
def srv(models):
    base, ad = models
    kw = dict(model=base, lora_modules=(("a", ad["a"][0]), ("b", ad["b"][0])), enable_lora=True, **ENGINE)
    with serving(kw, {"served_model_name": BASE}) as s:
        yield s


def _completion(srv, model: str, stream: bool = False, **extra) -> dict:
    body = dict(
        model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, **extra
    )
    if not stream:
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    # streamed: the chunks folded into the whole response's shape
    out = {"text": "", "token_logprobs": [], "finish_reason": None, "models": set()}
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            ch = json.loads(line.removeprefix("data: "))
            out["models"].add(ch["model"])
            for c in ch["choices"]:
                out["text"] += c["text"]
                if c["logprobs"]:
                    out["token_logprobs"] += c["logprobs"]["token_logprobs"]
                out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return out


def _greedy_logprobs(hf, prompt: list[int], n: int) -> list[float]:
    """transformers' own greedy continuation (PeftModel or plain): the chosen tokens' logprobs."""
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            lp = torch.log_softmax(hf(input_ids=ids).logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            out.append(float(lp[tok]))
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
    return out


def test_models_lists_base_then_adapters(srv, models):
    _, ad = models
    data = httpx.get(srv.url + "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [BASE, "a", "b"]
    assert data[0]["parent"] is None and data[0]["root"] == srv.model  # the checkpoint's own name
    for m in data[1:]:
        assert m["root"] == ad[m["id"]][0] and m["parent"] == BASE
        assert m["object"] == "model" and m["max_model_len"] == 128


def test_adapter_routing_matches_offline_and_peft(srv, models):
    from foveal import LLM, LoRARequest

    base, ad = models
    out = {name: _completion(srv, name) for name in (BASE, "a", "b")}
    for name, r in out.items():
        assert r["model"] == name and r["object"] == "text_completion"
        ch = r["choices"][0]
        assert ch["finish_reason"] == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS
    by_ckpt_name = _completion(srv, srv.model)  # the checkpoint's name also picks the base
    assert by_ckpt_name["model"] == BASE
    assert by_ckpt_name["choices"][0]["text"] == out[BASE]["choices"][0]["text"]
    lps = {name: r["choices"][0]["logprobs"]["token_logprobs"] for name, r in out.items()}
    assert lps["a"] != lps[BASE] and lps["b"] != lps[BASE] and lps["a"] != lps["b"]
    # the same request again: the same output (slot reuse, prefix cache per adapter)
    again = _completion(srv, "a")
    assert again["choices"][0]["text"] == out["a"]["choices"][0]["text"]
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lps["a"], abs=1e-5)
    # transformers + PEFT, greedy: the same tokens (their logprobs) per adapter
    for name in ("a", "b"):
        assert lps[name] == pytest.approx(_greedy_logprobs(ad[name][1], PROMPT, MAX_TOKENS), abs=1e-3)
    # the offline API on the same options: the same text and logprobs
    llm = LLM(base, dtype="float32", enable_lora=True, **ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for name in ("a", "b"):
        (o,) = llm.generate(PROMPT, sp, lora_request=LoRARequest(name, ad[name][0]))[0].outputs
        assert o.text == out[name]["choices"][0]["text"]
        assert [t.logprob for t in o.logprobs] == pytest.approx(lps[name], abs=1e-4)
    _free_soon(srv.engine)


def test_adapter_stream_equals_whole(srv):
    whole = _completion(srv, "b")
    s = _completion(srv, "b", stream=True)
    assert s["models"] == {"b"}
    assert s["text"] == whole["choices"][0]["text"] and s["finish_reason"] == "length"
    assert s["token_logprobs"] == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    # chat, streamed: every chunk names the adapter
    body = dict(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    assert chunks and {c["model"] for c in chunks} == {"a"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "a"
    _free_soon(srv.engine)


def test_unknown_model_is_404_listing_served_names(srv):
    for path, body in [
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ]:
        r = httpx.post(srv.url + path, json={"model": "nope", **body})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "'nope'" in err["message"]
        listed = re.findall(r"'([^']+)'", err["message"].split("serves", 1)[1])
        assert listed == [BASE, "a", "b"]


def _post(srv, path: str, body, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def test_load_use_unload_at_run_time(srv, models, tmp_path):
    _, ad = models
    path = ad["c"][0]
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": path})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'c' added successfully."
    cards = httpx.get(srv.url + "/v1/models").json()["data"]
    assert [m["id"] for m in cards] == [BASE, "a", "b", "c"]
    assert cards[-1]["root"] == path and cards[-1]["parent"] == BASE
    # three adapters on two device slots: all run, each with its own output
    lps = {n: _completion(srv, n)["choices"][0]["logprobs"]["token_logprobs"] for n in ("c", "a", "b")}
    assert lps["c"] == pytest.approx(_greedy_logprobs(ad["c"][1], PROMPT, MAX_TOKENS), abs=1e-3)
    assert lps["c"] != lps["a"] and lps["c"] != lps["b"]
    # all at once, base included: more adapters than device slots, each still its own output
    lps[BASE] = _completion(srv, BASE)["choices"][0]["logprobs"]["token_logprobs"]
    names = [BASE, "a", "b", "c"] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda n: _completion(srv, n), names))
    for n, o in zip(names, outs):
        assert o["model"] == n
        assert o["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lps[n], abs=1e-4), n

    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": path})
    assert r.status_code == 400 and "has already been loaded" in r.json()["error"]["message"]
    for body in ({"lora_name": "d"}, {"lora_path": path}, {"lora_name": "", "lora_path": path}, {}):
        r = _post(srv, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = _post(srv, "/v1/load_lora_adapter", [1, 2])
    assert r.status_code == 400
    missing = str(tmp_path / "no-such-adapter")
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": missing})
    assert r.status_code == 400 and missing in r.json()["error"]["message"]
    # a readable adapter Foveal refuses: rank over --max-lora-rank, the message says so
    from tests.test_loader import tiny_model

    save_adapter(tmp_path / "r32", tiny_model("qwen3"), 32, seed=7)
    r = _post(srv, "/v1/load_lora_adapter", {"lora_name": "d", "lora_path": str(tmp_path / "r32")})
    assert r.status_code == 400 and "32" in r.json()["error"]["message"], r.text
    for base_name in (BASE, srv.model):  # the base model's names cannot be taken
        r = _post(srv, "/v1/load_lora_adapter", {"lora_name": base_name, "lora_path": path})
        assert r.status_code == 400 and "base model" in r.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == [BASE, "a", "b", "c"]

    r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
    r = _post(srv, "/v1/completions", {"model": "c", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'c' cannot be found."
    assert _post(srv, "/v1/unload_lora_adapter", {}).status_code == 400
    assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == [BASE, "a", "b"]
    # the name again, other weights: nothing computed under the old "c" (prefix cache included) is reused
    assert _post(srv, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": ad["a"][0]}).status_code == 200
    again = _completion(srv, "c")["choices"][0]["logprobs"]["token_logprobs"]
    assert again == pytest.approx(lps["a"], abs=1e-4)
    assert _post(srv, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    _free_soon(srv.engine)


def _metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_count_requests_per_adapter(srv):
    text = httpx.get(srv.url + "/metrics").text
    before = _metric(text, "foveal_lora_requests_total", adapter="a") or 0.0
    for _ in range(3):
        _completion(srv, "a")
    _free_soon(srv.engine)
    text = httpx.get(srv.url + "/metrics").text
    assert _metric(text, "foveal_lora_requests_total", adapter="a") >= before + 3
    assert _metric(text, "foveal_lora_requests_total", adapter=BASE) is None  # base: no series
    assert "foveal_lora_requests_info{" in text
    assert 'max_lora="2"' in text
    # "a" ran in reported steps, so its gauges exist; nothing runs or waits now
    assert _metric(text, "foveal_lora_running_requests", adapter="a") == 0.0
    assert _metric(text, "foveal_lora_waiting_requests", adapter="a") == 0.0


@pytest.fixture(scope="module")
def auth(models):
    """Admin and user keys; no start-up adapters; host copies of two adapters only."""
    base, _ = models
    keys = [(ADMIN, "ops", True), (USER, "u", False)]
    with serving(dict(model=base, enable_lora=True, max_cpu_loras=2, **ENGINE), {"api_keys": keys}) as s:
        yield s


def test_admin_only_under_auth(auth, models):
    _, ad = models
    s = auth
    load = {"lora_name": "a", "lora_path": ad["a"][0]}
    assert _post(s, "/v1/load_lora_adapter", load).status_code == 401
    r = _post(s, "/v1/load_lora_adapter", load, USER)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert _post(s, "/v1/load_lora_adapter", load, ADMIN).status_code == 200
    # any key may use it
    r = _post(s, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 2}, USER)
    assert r.status_code == 200 and r.json()["model"] == "a"
    assert httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {USER}"}).status_code == 200
    assert _post(s, "/v1/unload_lora_adapter", {"lora_name": "a"}, USER).status_code == 403
    assert _post(s, "/v1/unload_lora_adapter", {"lora_name": "a"}, ADMIN).status_code == 200
    assert _post(s, "/v1/unload_lora_adapter", {"lora_name": "a"}, USER).status_code == 403  # not 404
    _free_soon(s.engine)


def test_dropped_host_copy_is_read_again(auth, models, tmp_path):
    """Past --max-cpu-loras the least recently used host copy is dropped and read again when named;
    if its folder went away meanwhile, that request is a 400 naming the adapter (the server lives on)."""
    _, ad = models
    s = auth
    x = shutil.copytree(ad["b"][0], tmp_path / "x")
    for name, path in [("x", str(x)), ("b2", ad["b"][0]), ("c", ad["c"][0])]:
        assert (
            _post(s, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, ADMIN).status_code
            == 200
        )
    reads = s.processor.lora.num_reads
    body = dict(prompt=PROMPT, temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    r = _post(s, "/v1/completions", {"model": "x", **body}, USER)  # x was dropped: read again
    assert r.status_code == 200 and s.processor.lora.num_reads == reads + 1
    ref = _post(s, "/v1/completions", {"model": "b2", **body}, USER).json()  # same weights as x
    lp = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert lp == pytest.approx(ref["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    _post(s, "/v1/completions", {"model": "c", **body}, USER)  # x is dropped again (b2, c kept)
    shutil.rmtree(x)
    r = _post(s, "/v1/completions", {"model": "x", **body}, USER)
    assert r.status_code == 400 and "'x'" in r.json()["error"]["message"], r.text
    assert _post(s, "/v1/completions", {"model": "c", **body}, USER).status_code == 200
    for name in ("x", "b2", "c"):
        assert _post(s, "/v1/unload_lora_adapter", {"lora_name": name}, ADMIN).status_code == 200
    _free_soon(s.engine)


def test_load_without_enable_lora_is_400(models):
    base, ad = models
    with serving(dict(model=base, **{k: v for k, v in ENGINE.items() if "lora" not in k}), {}) as s:
        r = _post(s, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": ad["a"][0]})
        assert r.status_code == 400 and "not enabled" in r.json()["error"]["message"]
        assert _post(s, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 400
        cards = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in cards] == [s.model] and cards[0]["parent"] is None
        r = _post(s, "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_cli_lora_modules():
    from foveal.cli import _engine_kwargs, build_parser

    p = build_parser()
    a = p.parse_args(
        ["serve", "--model", "m", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "c=/z=1"]
    )
    assert a.lora_modules == [("a", "/x"), ("b", "/y"), ("c", "/z=1")]
    kw = _engine_kwargs(a)
    assert kw["enable_lora"] is True and kw["lora_modules"] == (("a", "/x"), ("b", "/y"), ("c", "/z=1"))
    a = p.parse_args(["serve", "--lora-modules", "a=/x", "--max-loras", "3", "--max-lora-rank", "64"])
    assert (a.lora_modules, a.max_loras, a.max_lora_rank) == ([("a", "/x")], 3, 64)
    plain = _engine_kwargs(p.parse_args(["serve"]))
    assert plain["enable_lora"] is False and plain["lora_modules"] == ()
    assert _engine_kwargs(p.parse_args(["serve", "--enable-lora"]))["enable_lora"] is True
    for bad in ("noequals", "=/x", "a=", '{"name": "b"}', "{not json", '{"name": 1, "path": "/y"}'):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "--lora-modules", bad])
