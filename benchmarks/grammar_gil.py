"""How long the grammar layer's set-up and compiles hold the GIL (every other Python thread, the model
thread included, waits that long), over the embedded model's tokenizer.

A ticker thread sleeps 0.5 ms at a time and records how late it wakes; each probe reports its own time
and the ticker's longest wait during it ("held"): llguidance's tokenizer build as `llguidance.hf` makes it
(copy, to_str, LLTokenizer) and as `LLGuidanceBackend.from_tokenizer` does, then compiles of the hostile
requests' grammars (tests/test_adversarial_grammars.py).

    .venv/bin/python benchmarks/grammar_gil.py
"""

from __future__ import annotations

import copy
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llguidance  # noqa: E402

from foveal.loader.default_model import default_model_path  # noqa: E402
from foveal.loader.gguf_tokenizer import load_gguf_tokenizer  # noqa: E402
from foveal.structured import OutputConstraint  # noqa: E402
from foveal.structured.llguidance_backend import LLGuidanceBackend  # noqa: E402
from tests.test_adversarial_grammars import big_choice, chain  # noqa: E402

_waits: list[float] = []


def _ticker() -> None:
    last = time.perf_counter()
    while True:
        time.sleep(0.0005)
        now = time.perf_counter()
        _waits.append(now - last)
        last = now


def probe(name: str, fn):
    _waits.clear()
    t = time.perf_counter()
    out = fn()
    took = time.perf_counter() - t
    time.sleep(0.01)  # the ticker's wake-up after a hold
    print(f"{name:36s} {took * 1e3:8.1f} ms   held {max(_waits) * 1e3:7.1f} ms")
    return out


def main() -> None:
    tok = load_gguf_tokenizer(default_model_path())
    threading.Thread(target=_ticker, daemon=True).start()
    time.sleep(0.05)
    bt = probe("tokenizer copy (llguidance.hf)", lambda: copy.copy(tok.backend_tokenizer))
    text = probe("to_str", bt.to_str)
    eos = [tok.eos_token_id]
    probe("LLTokenizer", lambda: llguidance.LLTokenizer(text, n_vocab=len(tok), eos_token=eos))
    backend = probe("LLGuidanceBackend.from_tokenizer", lambda: LLGuidanceBackend.from_tokenizer(tok))
    probe("byte tables (closing plans)", lambda: (backend.byte_tokens, backend.lead_bytes))
    for name, spec in [
        ("compile: 300 KB choice list", OutputConstraint.choice(big_choice(0))),
        ("compile: chain of 3,000 rules", OutputConstraint.lark(chain(3000))),
        ("compile: minLength 301", OutputConstraint.json_schema({"type": "string", "minLength": 301})),
    ]:
        probe(name, lambda spec=spec: backend.compile(spec))


if __name__ == "__main__":
    main()
