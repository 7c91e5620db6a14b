"""DeepSeek V3 / R1 and V3.1 tool calls, in one section of calls:

    V3    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
          ```json
          {...}
          ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
          <｜tool▁calls▁end｜>

What follows `<｜tool▁sep｜>` tells them apart: a JSON object (V3.1) or a name line and a fenced
object (V3). Each call is sent at its `<｜tool▁call▁end｜>`. V3.2 and later write DSML
(`deepseek_dsml`).
"""

from __future__ import annotations

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    NOT_ARGS,
    JsonSpan,
    RunScanner,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    dump_arguments,
    prefix_state,
    read_json_args,
    skip_ws,
    valid_name,
)

SECTION, END_SECTION = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, END_CALL = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE = "```"


class DeepSeekV3Scanner(RunScanner):
    def __init__(self, opener: str):
        self.olen = len(opener)
        self.phase, self.pos = "section", self.olen
        self.head, self.name = "", ""
        self.fenced = False
        self.span: JsonSpan | None = None
        self.start, self.last_end, self.emitted = 0, 0, 0
        self.args: dict = {}

    def _run(self, text: str, calls: list[tuple[str, str]]) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "section":  # the next call, or the end of the section
                i = skip_ws(text, self.pos)
                states = (prefix_state(text, i, CALL), prefix_state(text, i, END_SECTION))
                if states[0] == "yes":
                    self.phase, self.pos = "head", i + len(CALL)
                elif states[1] == "yes":
                    return Step(DONE, i + len(END_SECTION))
                else:
                    return None if "partial" in states else self._give_up()
            elif self.phase == "head":  # `function` (V3) or the name (V3.1), then <｜tool▁sep｜>
                k = text.find(SEP, self.pos, self.pos + MAX_NAME + len(SEP))
                if k < 0:
                    return self._give_up() if n - self.pos >= MAX_NAME + len(SEP) else None
                self.head, self.phase, self.pos = text[self.pos : k].strip(), "body", k + len(SEP)
            elif self.phase == "body":
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] == "{":  # V3.1
                    self.name, self.phase, self.pos = self.head, "json", i
                else:  # V3: the name up to the end of its line
                    j = text.find("\n", i, i + MAX_NAME + 1)
                    if j < 0:
                        return self._give_up() if n - i > MAX_NAME else None
                    self.name, self.phase, self.pos = text[i:j].strip(), "fence", j + 1
                if not valid_name(self.name):
                    return self._give_up()
            elif self.phase == "fence":  # ```json (or ```) on its own line, or the object at once
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] == "{":
                    self.phase, self.pos = "json", i
                    continue
                if prefix_state(text, i, FENCE) == "no":
                    return self._give_up()
                j = text.find("\n", i)
                if j < 0:
                    return None if n - i < 16 else self._give_up()
                if text[i:j].strip() not in (FENCE, FENCE + "json"):
                    return self._give_up()
                self.fenced, self.phase, self.pos = True, "json", j + 1
            elif self.phase == "json":
                args = read_json_args(self, text)
                if args is None:
                    return None
                if args is NOT_ARGS:
                    return self._give_up()
                self.args, self.phase = args, "close"
            else:  # close: the closing fence if one opened, then <｜tool▁call▁end｜>
                i = skip_ws(text, self.pos)
                if self.fenced:
                    state = prefix_state(text, i, FENCE)
                    if state != "yes":
                        return None if state == "partial" else self._give_up()
                    self.fenced, self.pos = False, i + len(FENCE)
                    continue
                state = prefix_state(text, i, END_CALL)
                if state != "yes":
                    return None if state == "partial" else self._give_up()
                calls.append((self.name, dump_arguments(self.args)))
                self.emitted += 1
                self.phase = "section"
                self.pos = self.last_end = i + len(END_CALL)


class DeepSeekV3(ToolFormat):
    name = "deepseek_v3"
    aliases = ("deepseek", "deepseek_r1", "deepseek_v31", "deepseek_v3_1")
    markers = ToolMarkers(
        triggers=(SECTION,),
        start_triggers=(),
        call_close=END_CALL,
        args_open=SEP,
        body="deepseek_v3",
        markup=(SECTION, END_SECTION, CALL, SEP, END_CALL),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> DeepSeekV3Scanner:
        return DeepSeekV3Scanner(opener)
