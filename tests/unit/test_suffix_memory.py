"""The suffix drafter's session memory stays bounded over a long conversation (issue 13,
bounded state): each request's context is the whole prompt, history included, so without a
bound the memory grows by the history every turn."""

from __future__ import annotations

import random

from pipeline.llm.drafters import SuffixDrafter


def test_a_long_session_memory_is_bounded_and_still_drafts_from_the_latest_context():
    rng = random.Random(7)
    drafter = SuffixDrafter(max_memory_tokens=512)
    history: list[int] = []
    for _ in range(40):  # 40 turns, each context the growing history plus a new reply
        history += [rng.randrange(1000) for _ in range(30)]
        drafter.commit(history)
        assert len(drafter.memory.text) <= 512
    # The latest context is remembered: its continuation is drafted from a suffix match.
    recent = history[-100:-60]
    draft = drafter.propose([5000, *recent], 4)  # 5000: a token never seen, so no match in this context itself
    assert draft.tokens == tuple(history[-60:-56])
    assert draft.match >= len(recent)


def test_under_the_bound_nothing_is_forgotten():
    drafter = SuffixDrafter(max_memory_tokens=10_000)
    first, second = list(range(100, 150)), list(range(200, 250))
    drafter.commit(first)
    drafter.commit(second)
    assert drafter.propose([7, 100, 101, 102], 3).tokens == (103, 104, 105)
