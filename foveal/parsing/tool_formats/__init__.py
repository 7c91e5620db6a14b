"""The tool-call syntaxes, one module each, behind the scan protocol of `base.py`.

`FORMATS` lists them by name; `foveal.parsing.tools` owns streaming, policy and detection. A new
family is one module with a `ToolFormat` subclass and one line here.
"""

from __future__ import annotations

from foveal.parsing.tool_formats.base import ToolFormat, ToolMarkers
from foveal.parsing.tool_formats.deepseek_dsml import DeepSeekDsml
from foveal.parsing.tool_formats.deepseek_v3 import DeepSeekV3
from foveal.parsing.tool_formats.gemma4 import Gemma4
from foveal.parsing.tool_formats.glm import Glm
from foveal.parsing.tool_formats.hermes import Hermes
from foveal.parsing.tool_formats.kimi_k2 import KimiK2
from foveal.parsing.tool_formats.llama3_json import Llama3Json
from foveal.parsing.tool_formats.mistral import Mistral
from foveal.parsing.tool_formats.pythonic import Pythonic
from foveal.parsing.tool_formats.qwen3_xml import QwenXml

FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        Hermes(),
        QwenXml(),
        Llama3Json(),
        Mistral(),
        Pythonic(),
        Glm(),
        DeepSeekV3(),
        DeepSeekDsml(),
        KimiK2(),
        Gemma4(),
    )
}

__all__ = ["FORMATS", "ToolFormat", "ToolMarkers"]
