"""The start-up heap out of the collector's sight: an offline LLM freezes what exists once its engine is
built (the server's loop does at start), so a full collection during generation scans request-time
objects only; an engine dropped afterwards is still freed (refcounts, not the collector, free it)."""

from __future__ import annotations

import gc
import weakref

from foveal import SamplingParams
from foveal.engine.llm import LLM
from tests.tiny import tiny_llama_config_file


def test_llm_freezes_its_start_up_heap_and_a_dropped_engine_is_freed(tmp_path):
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    try:
        llm = LLM(str(tiny_llama_config_file(tmp_path)), load_format="dummy", dtype="float32", num_blocks=32,
                  block_size=4, max_model_len=64)  # fmt: skip
        frozen = gc.get_freeze_count()
        assert frozen > 0 and not any(o is llm.engine for o in gc.get_objects(0))
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        engine, runner = weakref.ref(llm.engine), weakref.ref(llm.engine.runner)
        del llm, out
        assert engine() is None and runner() is None
    finally:
        gc.unfreeze()
