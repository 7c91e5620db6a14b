"""The stop rules (foveal/sched/stops.py) one by one; the engine tests run them end to end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from foveal import SamplingParams
from foveal.request import FinishReason
from foveal.sched import stops

EOS, STOP_ID, OTHER = 2, 7, 11
STOP, LENGTH, ERROR = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ERROR


def req(prompt_len: int = 5, **params):
    return SimpleNamespace(
        params=SamplingParams(**{"max_tokens": 10, **params}),
        eos_token_ids={EOS},
        num_prompt_tokens=prompt_len,
    )


def test_eos_and_stop_ids_stop_after_min_tokens_only():
    r = req(min_tokens=3, stop_token_ids=[STOP_ID])
    assert stops.token_stop(r, EOS, 2, 1000) is None  # below min_tokens
    assert stops.token_stop(r, EOS, 3, 1000) is STOP
    assert stops.token_stop(r, STOP_ID, 3, 1000) is STOP
    assert stops.token_stop(r, OTHER, 3, 1000) is None


def test_ignore_eos_keeps_stop_ids():
    r = req(ignore_eos=True, stop_token_ids=[STOP_ID])
    assert stops.token_stop(r, EOS, 4, 1000) is None
    assert stops.token_stop(r, STOP_ID, 4, 1000) is STOP


def test_length_by_max_tokens_or_context():
    r = req(prompt_len=5, max_tokens=10)
    assert stops.token_stop(r, OTHER, 9, 1000) is None
    assert stops.token_stop(r, OTHER, 10, 1000) is LENGTH
    assert stops.token_stop(r, OTHER, 3, 8) is LENGTH  # 5 + 3 tokens fill a context of 8
    assert stops.token_stop(r, EOS, 10, 1000) is STOP  # a stop token at the limit is a stop
    assert stops.length_reached(r, 2, 8, 8) and not stops.length_reached(r, 2, 7, 8)


@pytest.mark.parametrize(
    "decided,cut,want",
    [
        (None, False, STOP),
        (None, True, LENGTH),
        (STOP, True, LENGTH),  # closed for max_tokens, its last token an EOS: a length stop
        (STOP, False, STOP),
        (LENGTH, False, LENGTH),  # max_tokens reached on the token that completed the grammar
        (ERROR, True, ERROR),
    ],
)
def test_a_guide_end_against_what_was_decided(decided, cut, want):
    assert stops.after_guide_end(decided, cut) is want
