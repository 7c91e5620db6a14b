"""Six concurrent openai-client requests of different kinds against a server just started (`make
serve`, 127.0.0.1:8000, the embedded model): greedy; a long prompt (one sentence 100 times) with seeded
top_p; a French stream with a stop string; penalties (repetition too) with top logprobs on a prompt with
猫 and 😀; a JSON schema; top_k with min_p, seeded. Run it at once after the server is up (first recorded
steps, first kernel builds, first grammar compiles) and again (warm); each line: the request, seconds
since the start, its answer. The JSON schema's answer is parsed (an error if it is not JSON).

    make serve &   # then, once it answers:
    .venv/bin/python benchmarks/cold_serve.py [--base-url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time

from openai import OpenAI

M = "SmolLM2-135M-Instruct"
LONG = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 100)


def requests(c: OpenAI) -> list:
    def chat(content: str, **kw):
        return c.chat.completions.create(model=M, messages=[{"role": "user", "content": content}], **kw)

    def greedy():
        return chat("Name three colors.", temperature=0, max_tokens=24).choices[0].message.content

    def long_top_p():
        r = chat(LONG + " Summarize.", temperature=0.8, top_p=0.9, seed=7, max_tokens=24)
        return r.choices[0].message.content

    def french_stream():
        s = chat("Dis bonjour en français.", stream=True, stop=["."], max_tokens=40)
        return "".join((ch.choices[0].delta.content or "") for ch in s if ch.choices)

    def penalties():
        r = chat("Write about 猫 and 😀.", presence_penalty=0.5, frequency_penalty=0.5, logprobs=True,
                 top_logprobs=3, max_tokens=16, extra_body={"repetition_penalty": 1.1})  # fmt: skip
        return r.choices[0].message.content, len(r.choices[0].logprobs.content)

    def schema():
        person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}
        r = chat("Give a person with a name and an age.", max_tokens=60, response_format=fmt)
        return json.loads(r.choices[0].message.content)

    def topk_minp():
        r = chat(
            "Tell a short joke.",
            temperature=1.0,
            seed=3,
            max_tokens=24,
            extra_body={"top_k": 20, "min_p": 0.05},
        )
        return r.choices[0].message.content

    return [greedy, long_top_p, french_stream, penalties, schema, topk_minp]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    a = ap.parse_args()
    fns = requests(OpenAI(base_url=a.base_url, api_key="none"))
    t0 = time.time()
    with cf.ThreadPoolExecutor(len(fns)) as ex:
        futs = {ex.submit(f): f.__name__ for f in fns}
        for fut in cf.as_completed(futs):
            print(f"{futs[fut]} {time.time() - t0:.1f}s: {fut.result()!r}"[:200])


if __name__ == "__main__":
    main()
