"""Tools for a chat template that has no tool support (the embedded SmolLM2's, for one): a generic,
Hermes-style tool prompt, and the tool turns of the history written out as text the template renders
like any other message.

    system:    <the request's system text>\\n\\n# Tools ... <tools>{"type": "function", ...}</tools> ...
    assistant: <its text>\\n<tool_call>\\n{"name": "f", "arguments": {"city": "Paris"}}\\n</tool_call>
    tool (n):  one user turn: <tool_response>\\n...\\n</tool_response> per result

The model is then parsed with the hermes tool-call format (or the one `--tool-call-parser` names: its
grammar then steers the model from the prompt's shape to its own), and `tool_choice` required / named
/ auto is enforced by the same format's grammar (foveal/structured/tool_grammar.py). A template that
does render `tools` itself gets them as they are (`renders_tools`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The functions "
    "you can call are described in JSON inside <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one call per tag, like this:\n<tool_call>\n"
    '{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}\n</tool_call>'
)


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template does something with a `tools` variable."""
    return bool(chat_template) and "tools" in chat_template


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def has_tool_turns(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def with_tool_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages with the tool turns as text, and the tool prompt (when tools are offered) in the
    first system turn."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            text = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            parts = [_text(m.get("content"))] + [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
            continue
        out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("_tool_results", None)
    if not tools:
        return out
    prompt = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": _text(out[0].get("content")) + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
