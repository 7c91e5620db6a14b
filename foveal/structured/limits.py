"""Size limits on a grammar, checked before the native compiler sees it.

llguidance's compiler and lexer have limits of their own, but some are found late (a choice of 2,001
strings compiles, then fails at its first token: "Current row has 2002 items"), some cost seconds to
reach (`((a{100}){100}){100}` spends 1.1 s building a lexer before it fails) and one is not a limit at
all (a Lark chain of 3,000 rules overflowed the compiling thread's stack: the process died). Each check
here is a ValueError naming what is too big, the size found and the limit, in microseconds:

    alternatives   one choice list, one Lark alternation: < max_items_in_row (llguidance's parser row;
                   every alternative is an item of the row that predicts it); a schema's anyOf / oneOf
                   arms: half that
    rules          Lark rules (each a nonterminal; the compiler recurses through chains of them)
    regex size     a regex's expanded size: atoms times the bounds of the repetitions around them
                   (`a{1000}` is 1,000, `(ab){10}{10}` 200); every regex: guided_regex, a schema's
                   `pattern`s and `patternProperties`, a Lark grammar's /.../ tokens
    schema nodes   subschemas of a JSON schema, and its nesting depth

The checks are cheap scans, not parsers: text they cannot read (an unbalanced group) passes, and the
compiler then says what is wrong with it. What passes still compiles under llguidance's own limits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from foveal.structured.constraint import OutputConstraint


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    # per choice list and Lark alternation: llguidance's parser row holds 2,000 items (the alternatives
    # and the rule predicting them); a JSON schema's anyOf / oneOf arms each add more than one
    max_alternatives: int = 1_998
    max_schema_arms: int = 1_000
    max_rules: int = 10_000  # Lark rules; a chain of 10,000 needs 16-32 MiB of the 256 MiB stack
    max_regex_size: int = 10_000  # expanded atoms per regex (a{50000} ran out of lexer expressions)
    max_schema_nodes: int = 20_000
    max_schema_depth: int = 64


DEFAULT = GrammarLimits()


def check(spec: OutputConstraint, limits: GrammarLimits = DEFAULT) -> None:
    """ValueError when `spec` is over a limit (the message names the part and both numbers)."""
    if spec.kind == "choice":
        _at_most(len(json.loads(spec.value)), limits.max_alternatives, "choices")
    elif spec.kind == "regex":
        check_regex(spec.value, limits, "the regex")
    elif spec.kind == "json_schema":
        _check_schema(json.loads(spec.value), limits)
    elif spec.kind == "lark":
        check_lark(spec.value, limits)
    if spec.whitespace_pattern is not None:
        check_regex(spec.whitespace_pattern, limits, "whitespace_pattern")


def _at_most(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise ValueError(f"{what}: {n:,} is over the limit of {limit:,}")


# -- regexes ------------------------------------------------------------------------------------------
_REPEAT = re.compile(r"\{(\d{1,9})(?:(,)(\d{0,9}))?\}")
_GROUP_HEAD = re.compile(r"\?(?:[:=!]|<[=!]|P?<\w+>|[a-zA-Z-]+[:)])")


def regex_size(pattern: str) -> int:
    """The regex's atoms, each times the upper bounds of the counted repetitions around it (`{n,}`
    counts n + 1; `*`, `+` and `?` count 1: they loop a state, they do not copy one). Groups nest
    through a stack of partial sums; classes and escapes are one atom."""
    stack: list[int] = [0]  # the size of each open group's content so far
    last = 0  # the size of the item a quantifier would apply to
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
            stack[-1] += 1
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            last = 1
            stack[-1] += 1
            continue
        if c == "(":
            if pattern.startswith("?", i + 1):  # (?:  (?=  (?!  (?<=  (?<!  (?P<name>  (?<name>  (?i)
                m = _GROUP_HEAD.match(pattern, i + 1)
                if m is not None and m[0].endswith(")"):  # flags only: no group
                    i = m.end()
                    continue
                if m is not None:
                    i = m.end() - 1
            stack.append(0)
            last = 0
        elif c == ")":
            if len(stack) > 1:
                last = stack.pop()
                stack[-1] += last
            else:
                last = 0
        elif c == "{":
            m = _REPEAT.match(pattern, i)
            if m is not None:
                lo, comma, hi = int(m[1]), m[2], m[3]
                bound = (int(hi) if hi else lo + 1) if comma else lo
                stack[-1] += last * (max(bound, 1) - 1)
                last *= max(bound, 1)
                i = m.end()
                continue
            last = 1
            stack[-1] += 1
        elif c in "*+?|":
            last = 0 if c == "|" else last
        else:
            last = 1
            stack[-1] += 1
        i += 1
    return sum(stack)


def check_regex(pattern: str, limits: GrammarLimits = DEFAULT, what: str = "a regex") -> None:
    size = regex_size(pattern)
    if size > limits.max_regex_size:
        raise ValueError(
            f"{what} expands to {size:,} characters (its repetition bounds multiplied), over the limit of "
            f"{limits.max_regex_size:,}"
        )


# -- JSON schemas -------------------------------------------------------------------------------------
_ARMS = ("anyOf", "oneOf", "allOf", "prefixItems")  # an enum is one lexeme: not a parser row


def _check_schema(schema: Any, limits: GrammarLimits) -> None:
    nodes = 0
    todo: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while todo:
        x, depth, where = todo.pop()
        if isinstance(x, list):
            todo.extend((v, depth, f"{where}/{i}") for i, v in enumerate(x))
            continue
        if not isinstance(x, dict):
            continue
        nodes += 1
        _at_most(nodes, limits.max_schema_nodes, "the schema's subschemas")
        _at_most(depth, limits.max_schema_depth, f"the schema's nesting at {where}")
        for key, v in x.items():
            if key in _ARMS and isinstance(v, list):
                _at_most(len(v), limits.max_schema_arms, f"{where}/{key}")
            if key == "pattern" and isinstance(v, str):
                check_regex(v, limits, f"the pattern at {where}")
            if key == "patternProperties" and isinstance(v, dict):
                for p in v:
                    check_regex(p, limits, f"the patternProperties key at {where}")
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                if isinstance(v, dict):
                    _at_most(len(v), limits.max_schema_nodes, f"{where}/{key}")
                    todo.extend((s, depth + 1, f"{where}/{key}/{k}") for k, s in v.items())
            elif key not in ("enum", "const", "examples", "default") and isinstance(v, (dict, list)):
                todo.append((v, depth + 1, f"{where}/{key}"))


# -- Lark ---------------------------------------------------------------------------------------------
_RULE = re.compile(r"^\s*[?!]?(@?[A-Za-z_][\w]*)(?:\.-?\d+)?\s*:", re.M)
_LEXEME = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*')


def check_lark(text: str, limits: GrammarLimits = DEFAULT) -> None:
    """Rules, alternatives per alternation (each rule's top level and each parenthesized group) and
    every /regex/ token."""
    _at_most(len(_RULE.findall(text)), limits.max_rules, "grammar rules")
    bare_parts = []
    pos = 0
    for m in _LEXEME.finditer(text):
        bare_parts.append(text[pos : m.start()])
        tok = m[0]
        if tok.startswith("/") and not tok.startswith("//"):
            check_regex(tok[1 : tok.rindex("/")], limits, f"the grammar's regex {_short(tok)}")
        bare_parts.append('""')  # a literal, a regex or a comment: no `|` or `(` of the grammar
        pos = m.end()
    bare_parts.append(text[pos:])
    bare = "".join(bare_parts)
    counts = [1]
    for line in re.split(r"\n(?=\s*[?!]?@?[A-Za-z_][\w]*(?:\.-?\d+)?\s*:)", bare):
        counts = [1]
        for c in line:
            if c in "([":
                counts.append(1)
            elif c in ")]" and len(counts) > 1:
                _at_most(counts.pop(), limits.max_alternatives, "alternatives in one group of the grammar")
            elif c == "|":
                counts[-1] += 1
        _at_most(max(counts), limits.max_alternatives, "alternatives of one grammar rule")


def _short(s: str, n: int = 40) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."
