"""Fault injection, in process: a real uvicorn server on 127.0.0.1 around an Engine (fp32, 128 MiB KV
pool, --max-num-seqs 4 so some requests wait while others run), streams running, and exactly one fault
injected at a time by monkeypatching one method (no product code changes). Each fault run is compared
with a fault-free run of the same requests (greedy, temperature 0, ignore_eos, staggered max_tokens so
requests finish one by one and waiting ones join running batches; the prefix cache is reset before
every run, so each run computes the same way).

  detokenizer     8 streams on the embedded SmolLM2; one more request (marked by a stop string no text
                  contains) has its IncrementalDetokenizer.add raise on its 4th token. Target: it ends
                  with an error event, finish_reason "error" and [DONE]; the 8 others get the reference
                  text.
  forward_pass    the same 8 streams; ModelRunner.launch raises once, on a step with >= 2 sequences one
                  of which is a prefill chunk (--fault-batch any: any step), at call >= --fault-step.
                  Target: exactly the requests in that step's batch end with an error; every other one
                  gets the reference text.
  image_decode    a tiny random LLaVA (tests/tiny_vlm.py), 4 image + 2 text requests; one more request's
                  image fails to decode (PIL's ImageFile.load raises OSError for that image's size,
                  once). Target: a 400 with code invalid_image; the 6 others get the reference text.
  vision_encoder  the same 6 + one image request (marked by max_tokens == 7) whose encoding raises on the
                  model thread (ModelRunner._encode_missing). Target: as forward_pass, the failing
                  step's batch and nothing else.
  image_loader_unexpected (info, not judged): foveal.server.media.read_media_bytes raising
                  RuntimeError for one image URL, an exception type the image path does not expect;
                  reports the status it becomes.
After each: /health 200, a fresh request completes, 0 KV blocks in use and no open request, the pool's
integrity check passes (both read on the model thread).

    .venv/bin/python benchmarks/adversarial/faults.py            # everything (~30 s on 2 vCPUs)
    .venv/bin/python benchmarks/adversarial/faults.py --skip-vlm

$FOVEAL_SRC picks the source tree to import (default: this checkout). The server's logs are silenced
(the faults log tracebacks by design; --verbose shows them). Prints a table, then one JSON object as
the last line; exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import SRC, emit, free_port, table  # noqa: E402

sys.path.insert(0, SRC)  # foveal (and tests/, for the tiny VLM) from the tree under test

import httpx  # noqa: E402

MARK = "\x00@@adv-detok-fault@@"  # a stop string no generated text contains
ENC_MARK = 7  # the max_tokens that marks the vision-encoder fault's target (no other request uses it)
TOPICS = ["the sea", "a red bicycle", "bread", "winter", "the moon", "a small dog", "trains", "coffee"]


@contextlib.contextmanager
def patched(obj, name: str, new):
    old = getattr(obj, name)
    setattr(obj, name, new)
    try:
        yield
    finally:
        setattr(obj, name, old)


class Served:
    """create_app + uvicorn in a thread (as tests/test_server.py `_serve` does)."""

    def __init__(self, engine_kw: dict, server_kw: dict):
        import uvicorn

        from foveal.config import EngineConfig, ServerConfig
        from foveal.engine.factory import build_engine
        from foveal.server.app import create_app

        self.engine, self.processor = build_engine(
            EngineConfig.from_kwargs(dtype="float32", kv_cache_memory=128 * 2**20, **engine_kw)
        )
        self.app = create_app(self.engine, self.processor, ServerConfig(drain_timeout=1.0, **server_kw))
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def on_model_thread(self, fn, timeout: float = 30.0):
        return self.app.state.loop.call(fn).result(timeout)

    def state(self) -> dict:
        """Blocks in use (ref count > 0), integrity, loop state: read on the model thread once idle."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            used = self.on_model_thread(lambda e: e.kv.num_used_blocks)
            if used == 0 and self.app.state.loop.num_open == 0:
                break
            time.sleep(0.05)

        def check(e):
            try:
                e.kv.check_integrity()
                return None
            except AssertionError as err:
                return str(err)

        return {
            "used_blocks": self.on_model_thread(lambda e: e.kv.num_used_blocks),
            "open_requests": self.app.state.loop.num_open,
            "integrity_error": self.on_model_thread(check),
            "loop_state": self.app.state.loop.state,
            "health": httpx.get(self.url + "/health", timeout=10).status_code,
        }

    def reset_cache(self) -> None:
        httpx.post(self.url + "/v1/cache/reset", timeout=30).raise_for_status()


async def stream_chat(c: httpx.AsyncClient, name: str, body: dict, timeout: float) -> dict:
    out = {
        "name": name,
        "status": None,
        "id": None,
        "text": "",
        "finish_reason": None,
        "error_event": None,
        "done": False,
    }

    async def go():
        async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                raw = await r.aread()
                out["body"] = raw[:500].decode("utf-8", "replace")
                try:
                    out["error_code"] = json.loads(raw)["error"].get("code")
                except (ValueError, KeyError, TypeError, AttributeError):
                    pass
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    return
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out["error_event"] = chunk["error"].get("message")
                    continue
                out["id"] = out["id"] or chunk.get("id")
                for ch in chunk.get("choices", []):
                    out["text"] += (ch.get("delta") or {}).get("content") or ""
                    out["finish_reason"] = ch.get("finish_reason") or out["finish_reason"]

    try:
        await asyncio.wait_for(go(), timeout)
    except TimeoutError:
        out["timeout"] = True
    except httpx.HTTPError as e:
        out["client_error"] = f"{type(e).__name__}: {e}"
    return out


def run_set(srv: Served, specs: list[tuple[str, dict, float]], timeout: float = 180.0) -> dict[str, dict]:
    """Send every (name, body, delay_s) concurrently; results by name."""

    async def main():
        limits = httpx.Limits(max_connections=len(specs) + 4)
        async with httpx.AsyncClient(base_url=srv.url, timeout=timeout, limits=limits) as c:

            async def delayed(name, body, delay):
                await asyncio.sleep(delay)
                return await stream_chat(c, name, body, timeout)

            return await asyncio.gather(*(delayed(n, b, d) for n, b, d in specs))

    return {r["name"]: r for r in asyncio.run(main())}


def ok_normal(r: dict, ref: dict) -> bool:
    return (
        r["status"] == 200
        and r["done"]
        and r["error_event"] is None
        and r["finish_reason"] in ("stop", "length")
        and r["text"] == ref["text"]
    )


def text_bodies(n: int, max_tokens: int) -> list[tuple[str, dict, float]]:
    return [
        (
            f"n{i}",
            {
                "messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[i % 8]}."}],
                "max_tokens": max_tokens + 3 * i,  # staggered: finishing ones let waiting ones in mid-batch
                "temperature": 0,
                "ignore_eos": True,
            },
            0.0,
        )
        for i in range(n)
    ]


def compare(results: dict, ref: dict, names: list[str]) -> list[dict]:
    bad = []
    for n in names:
        r = results[n]
        if not ok_normal(r, ref[n]):
            bad.append(
                {
                    "name": n,
                    "status": r["status"],
                    "finish_reason": r["finish_reason"],
                    "error_event": r["error_event"],
                    "same_text": r["text"] == ref[n]["text"],
                    "text": r["text"][:80],
                    "ref": ref[n]["text"][:80],
                }
            )
    return bad


def probe(srv: Served) -> bool:
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
    )
    return r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"] is not None)


def batch_desc(batch) -> list[dict]:
    return [
        {"id": s.request_id, "start": s.start, "tokens": s.num_tokens, "logits": s.num_logits}
        for s in batch.items
    ]


def judge_batch(
    fault: str, srv: Served, res: dict, ref: dict, names: list[str], failing: list, ref_ok
) -> dict:
    """A fault that fails one step: exactly the requests in that step's batch end with an error (event,
    finish_reason "error", then [DONE]); every other one finishes with the reference text."""
    batch_ids = [s.request_id for s in failing[0][0].items] if failing else []
    failed = {n for n, r in res.items() if r["finish_reason"] == "error" or r["error_event"]}
    in_batch = {n for n, r in res.items() if r["id"] in batch_ids}
    bad = compare(res, ref, [n for n in names if n not in in_batch])
    batch_errors_ok = all(
        res[n]["finish_reason"] == "error" and res[n]["error_event"] and res[n]["done"] for n in in_batch
    )
    st = srv.state()
    alive = probe(srv)
    return {
        "fault": fault,
        "faults_fired": len(failing),
        "batch": {"step": failing[0][1], "seqs": batch_desc(failing[0][0])} if failing else None,
        "in_batch": sorted(in_batch),
        "failed": sorted(failed),
        "unmatched_batch_ids": len(batch_ids) - len(in_batch),
        "failed_equals_batch": failed == in_batch,
        "batch_errors_ok": batch_errors_ok,
        "others": len([n for n in names if n not in in_batch]),
        "others_wrong": bad,
        "after": st,
        "serving_after": alive,
        "pass": bool(
            ref_ok
            and len(failing) == 1
            and failed == in_batch
            and batch_errors_ok
            and not bad
            and alive
            and len(batch_ids) == len(in_batch)
            and st["used_blocks"] == 0
            and st["integrity_error"] is None
        ),
    }


# -- text faults --------------------------------------------------------------------------------------
def faulted_run(srv, patch: tuple, specs, ref: dict, names: list[str]) -> tuple[dict, list, dict]:
    """specs run with `patch` (obj, attribute, replacement) in place, from a cold prefix cache: the
    target's result, the other requests that differ from the reference, the engine's state after."""
    srv.reset_cache()
    with patched(*patch):
        res = run_set(srv, specs)
    return res["target"], compare(res, ref, names), srv.state()


def single_target(fault, fired, ref_ok, t, keys, target_ok, names, bad, st, alive) -> dict:
    """The record of a scenario whose fault hits one request: it passes when the fault fired once, the
    target failed as expected, every other request matched the reference and the engine is clean."""
    return {
        "fault": fault,
        "faults_fired": len(fired),
        "reference_ok": ref_ok,
        "target": {k: t.get(k) for k in keys},
        "target_ok": target_ok,
        "others": len(names),
        "others_wrong": bad,
        "after": st,
        "serving_after": alive,
        "pass": bool(
            ref_ok
            and len(fired) == 1
            and target_ok
            and not bad
            and alive
            and st["used_blocks"] == 0
            and st["integrity_error"] is None
        ),
    }


def text_faults(args) -> list[dict]:
    from foveal.engine.detokenizer import IncrementalDetokenizer
    from foveal.worker.model_runner import ModelRunner

    out = []
    srv = Served({"max_num_seqs": 4}, {})
    try:
        normal = text_bodies(8, args.max_tokens)
        names = [n for n, _, _ in normal]
        srv.reset_cache()
        ref = run_set(srv, normal)
        ref_ok = all(r["status"] == 200 and r["done"] and r["finish_reason"] for r in ref.values())

        # 1. one request's detokenizer raises on its 4th token
        real_add = IncrementalDetokenizer.add
        fired = []

        def add(self, ids):
            if MARK in self.stop:
                self._adv_calls = getattr(self, "_adv_calls", 0) + 1
                if self._adv_calls == 4:
                    fired.append(1)
                    raise RuntimeError("injected detokenizer fault")
            return real_add(self, ids)

        target = (
            "target",
            {
                "messages": [{"role": "user", "content": "Count from one to twenty."}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [MARK],
            },
            0.3,
        )
        t, bad, st = faulted_run(srv, (IncrementalDetokenizer, "add", add), normal + [target], ref, names)
        alive = probe(srv)
        target_ok = (
            t["status"] == 200
            and t["finish_reason"] == "error"
            and t["error_event"] is not None
            and "injected detokenizer fault" in (t["error_event"] or "")
        )
        out.append(
            single_target(
                "detokenizer",
                fired,
                ref_ok,
                t,
                ("status", "finish_reason", "error_event", "done"),
                target_ok,
                names,
                bad,
                st,
                alive,
            )
        )

        # 2. one forward pass raises: a step with >= 2 sequences, one of them a prefill chunk (a request
        # just let in beside running decodes) unless --fault-batch any, at launch call >= --fault-step
        real_launch = ModelRunner.launch
        calls = {"n": 0}
        failing: list = []

        def launch(self, batch):
            calls["n"] += 1
            mixed = any(not s.is_decode for s in batch.items) or args.fault_batch == "any"
            if not failing and calls["n"] >= args.fault_step and len(batch.items) >= 2 and mixed:
                failing.append((batch, calls["n"]))
                raise RuntimeError("injected forward-pass fault")
            return real_launch(self, batch)

        srv.reset_cache()
        with patched(ModelRunner, "launch", launch):
            res = run_set(srv, normal)
        out.append(judge_batch("forward_pass", srv, res, ref, names, failing, ref_ok))
    finally:
        srv.stop()
    return out


# -- image decode fault ---------------------------------------------------------------------------------
def png_url(w: int, h: int, seed: int) -> str:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (w, h), bytes(rng.randrange(256) for _ in range(w * h * 3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_body(text: str, url: str | None, max_tokens: int) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if url:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def vlm_faults(args) -> list[dict]:
    from PIL import ImageFile

    import foveal.server.media as media
    from tests.tiny_vlm import build_llava

    path = tempfile.mkdtemp(prefix="foveal-adv-llava-")
    build_llava(path)
    srv = Served({"model": path, "max_num_seqs": 4}, {"limit_images_per_request": 2})
    out = []
    mt = args.max_tokens
    try:
        normal = [
            (f"img{i}", image_body(f"Describe picture {i}.", png_url(30 + i, 28, i), mt + 3 * i), 0.0)
            for i in range(4)
        ]
        normal += [
            (f"txt{i}", image_body(f"Say something {i}.", None, mt + 3 * (4 + i)), 0.0) for i in range(2)
        ]
        names = [n for n, _, _ in normal]
        srv.reset_cache()
        ref = run_set(srv, normal)
        ref_ok = all(r["status"] == 200 and r["done"] and r["finish_reason"] for r in ref.values())

        # 3. one image fails to decode: PIL raises OSError while loading the target's pixels (37x23), once
        real_load = ImageFile.ImageFile.load
        fired = []

        def load(self):
            if self.size == (37, 23) and not fired:
                fired.append(1)
                raise OSError("injected: broken data stream when reading image file")
            return real_load(self)

        target = ("target", image_body("Describe this.", png_url(37, 23, 99), args.max_tokens), 0.3)
        t, bad, st = faulted_run(srv, (ImageFile.ImageFile, "load", load), normal + [target], ref, names)
        alive = probe(srv)
        target_ok = t["status"] == 400 and t.get("error_code") == "invalid_image"
        out.append(
            single_target(
                "image_decode",
                fired,
                ref_ok,
                t,
                ("status", "error_code", "body"),
                target_ok,
                names,
                bad,
                st,
                alive,
            )
        )

        # informational: an exception type the loader does not expect (a bug, not bad input)
        target_url = png_url(41, 19, 98)
        real_read = media.read_media_bytes
        fired2 = []

        def read(url, limits):
            if url == target_url and not fired2:
                fired2.append(1)
                raise RuntimeError("injected unexpected loader error")
            return real_read(url, limits)

        target2 = ("target", image_body("Describe this.", target_url, args.max_tokens), 0.3)
        t, bad, st = faulted_run(srv, (media, "read_media_bytes", read), normal + [target2], ref, names)
        out.append(
            {
                "fault": "image_loader_unexpected (info)",
                "faults_fired": len(fired2),
                "target": {k: t.get(k) for k in ("status", "error_code", "body")},
                "others": len(names),
                "others_wrong": bad,
                "after": st,
                "serving_after": probe(srv),
                "pass": None,
            }
        )

        # 4. the vision encoder raises (on the model thread, inside the step's forward pass) for the one
        # request marked by max_tokens == ENC_MARK: that step's batch fails, the rest finish
        from foveal.worker.model_runner import ModelRunner

        real_launch, real_encode = ModelRunner.launch, ModelRunner._encode_missing
        current: list = []
        failing: list = []
        steps = {"n": 0}

        def launch(self, batch):
            steps["n"] += 1
            current[:] = [(batch, steps["n"])]
            return real_launch(self, batch)

        def encode(self, needed):
            needed = list(needed)
            if not failing and any(req.params.max_tokens == ENC_MARK for req, _ in needed):
                failing.extend(current)
                raise RuntimeError("injected vision-encoder fault")
            return real_encode(self, needed)

        target3 = ("target", image_body("Describe this.", png_url(33, 31, 97), ENC_MARK), 0.0)
        srv.reset_cache()
        with patched(ModelRunner, "launch", launch), patched(ModelRunner, "_encode_missing", encode):
            res = run_set(srv, normal + [target3])
        out.append(judge_batch("vision_encoder", srv, res, ref, names, failing, ref_ok))
    finally:
        srv.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--fault-step", type=int, default=6, help="forward-pass fault: at launch call >= this")
    ap.add_argument(
        "--fault-batch",
        choices=["mixed", "any"],
        default="mixed",
        help="forward-pass fault: on a step with a prefill chunk (mixed) or any step",
    )
    ap.add_argument("--skip-vlm", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show the server's (expected) tracebacks")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.CRITICAL)
    os.environ.setdefault("TQDM_DISABLE", "1")

    res: dict = {
        "benchmark": "adversarial_faults",
        "src": SRC,
        "max_tokens": args.max_tokens,
        "scenarios": [],
    }
    t0 = time.monotonic()
    for name, fn in (("text", text_faults), ("vlm", vlm_faults)):
        if name == "vlm" and args.skip_vlm:
            res["vlm"] = "skipped (--skip-vlm)"
            continue
        try:
            res["scenarios"] += fn(args)
        except Exception as e:
            res.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}"[:1000])
            traceback.print_exc()
    res["wall_s"] = round(time.monotonic() - t0, 1)
    judged = [s for s in res["scenarios"] if s["pass"] is not None]
    ok = bool(judged) and all(s["pass"] for s in judged) and not res.get("errors")
    res["pass"] = ok
    print()
    rows = []
    for s in res["scenarios"]:
        tgt = s.get("target") or {}
        target = (
            f"{tgt.get('status')} {tgt.get('finish_reason') or tgt.get('error_code') or ''}".strip()
            if tgt
            else f"batch {len(s.get('in_batch', []))}: failed {len(s.get('failed', []))}, "
            f"equal={s.get('failed_equals_batch')}"
        )
        rows.append(
            (
                s["fault"],
                s["faults_fired"],
                target,
                f"{s['others'] - len(s['others_wrong'])}/{s['others']}",
                s["after"]["used_blocks"],
                s["after"]["integrity_error"] or "ok",
                s["serving_after"],
                {True: "PASS", False: "FAIL", None: "-"}[s["pass"]],
            )
        )
    table(rows, ("fault", "fired", "target", "others ok", "blocks used", "integrity", "serving", "verdict"))
    for s in res["scenarios"]:
        for b in s["others_wrong"]:
            print(f"{s['fault']}: {b}")
        if s.get("target", {}).get("body"):
            print(f"{s['fault']}: target body {s['target']['body'][:200]}")
    for e in res.get("errors", []):
        print("error:", e)
    print(f"verdict {'PASS' if ok else 'FAIL'} ({res['wall_s']} s)")
    emit(res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
