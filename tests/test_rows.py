"""The row builder (foveal/worker/rows.py) that both the eager and the graph paths of a step read, on a
hand-made batch whose every row is written out here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from foveal.sched.batch import DEVICE_DRAFT, ScheduledItem
from foveal.worker.rows import build_rows


def held(slot: int, prompt_len: int, shift: int = 0):
    return SimpleNamespace(slot=slot, shift=shift, req=SimpleNamespace(prompt_token_ids=[0] * prompt_len))


HELD = {"d": held(0, 4), "p": held(1, 3, shift=5), "v": held(2, 4), "q": held(3, 10)}
BS, WIDTH = 4, 4  # block size; token-buffer width (1 + drafts)


def test_a_mixed_batch_row_by_row():
    items = [
        # a decode whose token is still in flight (async scheduling): position 6 of blocks [7, 8]
        ScheduledItem("d", 6, (), (7, 8), num_logits=1, num_pending=1),
        # a verify run: the fed token and two drafts staged on the device
        ScheduledItem("v", 5, (11, DEVICE_DRAFT, DEVICE_DRAFT), (2, 3), num_logits=3, num_drafts=2),
        # a prefill chunk: positions 4..6 of a 10-token prompt, no logits
        ScheduledItem("q", 4, (21, 22, 23), (5, 6), num_logits=0),
    ]
    rows = build_rows(items, HELD, WIDTH, BS)
    assert rows.ids == [0, 11, DEVICE_DRAFT, DEVICE_DRAFT, 21, 22, 23]
    # d reads slot 0's first entry; v's drafts sit at 1 and 2 of slot 2's row (2 * 4 + 1, + 2)
    assert rows.pending == [0, -1, 9, 10, -1, -1, -1]
    assert rows.positions == [6, 5, 6, 7, 4, 5, 6]
    # position p of a table sits in block table[p // 4] at offset p % 4
    assert rows.slots == [8 * 4 + 2, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]
    assert rows.query_lens == [1, 1, 1, 1, 3] and rows.num_decodes == 4
    assert rows.context_lens == [6, 5, 6, 7, 4]
    assert rows.block_tables == [(7, 8), (2, 3), (2, 3), (2, 3), (5, 6)]
    # each row takes its item's table object itself (the backend converts a tuple once while in use)
    assert all(t is items[i].block_table for t, i in zip(rows.block_tables, [0, 1, 1, 1, 2]))
    assert rows.logits_rows == [0, 1, 2, 3]
    assert not rows.short_queries  # the prompt chunk: eager only


def test_generated_tokens_alone_are_short_queries_with_shifted_rope():
    items = [
        ScheduledItem("p", 7, (31,), (1, 2), num_logits=1),  # a generated token (prompt of 3)
        ScheduledItem("d", 4, (41,), (7, 8), num_logits=1),  # the first generated token of d
    ]
    rows = build_rows(items, HELD, WIDTH, BS)
    assert rows.short_queries and not rows.any_pending
    assert rows.rope == [7 + 5, 4] and rows.positions == [7, 4]  # p's generated tokens sit 5 further


def test_a_prompt_tokens_query_is_not_a_short_query():
    # the last prompt token, alone in its chunk, gives logits: a one-token query, but of the prompt
    rows = build_rows([ScheduledItem("q", 9, (5,), (1, 2, 3), num_logits=1)], HELD, WIDTH, BS)
    assert rows.num_decodes == 1 and not rows.short_queries


def test_block_diffusion_rows_see_their_block_end_and_do_not_mix():
    def key_limits(s):
        return [s.start + s.num_tokens - 1] * s.num_tokens if s.request_id == "q" else None

    block = ScheduledItem("q", 8, (1, 2, 3, 4), (1, 2, 3), num_logits=4, denoise=0)
    rows = build_rows([block], HELD, WIDTH, BS, key_limits)
    assert rows.context_lens == [11] * 4 and rows.query_lens == [1] * 4
    assert rows.block_diffusion and rows.short_queries
    mixed = build_rows(
        [ScheduledItem("d", 4, (41,), (7, 8), num_logits=1), block], HELD, WIDTH, BS, key_limits
    )
    assert mixed.block_diffusion and not mixed.short_queries  # a graph takes their slots only alone


def test_a_block_models_rows_see_up_to_their_blocks_end_within_the_item():
    """DiffusionPasses.key_limits: positions 6..10 with blocks of 4 see keys up to 7 (block 4..7) and
    up to 10 (block 8..11, cut at the item's end); a masked model's item is one both-ways row."""
    from foveal.diffusion.passes import DiffusionPasses

    item = ScheduledItem("q", 6, (1, 2, 3, 4, 5), (1, 2, 3), num_logits=5, denoise=0)
    assert DiffusionPasses.key_limits(item, ("block", 4, 99)) == [7, 7, 10, 10, 10]
    assert DiffusionPasses.spans(item, ("block", 4, 99)) == [[]] * 5
    assert DiffusionPasses.key_limits(item, ("masked", 0, 99)) is None
    assert DiffusionPasses.spans(item, ("masked", 0, 99)) == [[(0, 11)]]


def test_a_decode_after_a_prefill_chunk_is_refused():
    items = [ScheduledItem("q", 4, (21, 22), (5, 6), num_logits=0), ScheduledItem("d", 4, (41,), (7, 8), 1)]
    with pytest.raises(ValueError, match="decode items must come before prefill chunks"):
        build_rows(items, HELD, WIDTH, BS)
