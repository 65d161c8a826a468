"""The reference client's hold on a file sent unpaced in caption mode (services/client.CaptionFlow): no more than
CAPTIONS_IN_FLIGHT caption turns under way, no more than AUDIO_LEAD_S of audio past the last speech transcribed,
and a silence the asr has nothing to show for never holds it for good. The events are the gateway's own messages."""

from __future__ import annotations

import asyncio

import pytest

from services import client
from services.client import AUDIO_LEAD_S, CAPTIONS_IN_FLIGHT, CaptionFlow, pb


def final(turn_id: str, end_s: float):
    return pb.ServerEvent(turn_id=turn_id, transcript=pb.Transcript(is_final=True, text="words", speech_end_s=end_s))


def report(turn_id: str):
    return pb.ServerEvent(turn_id=turn_id, report=pb.TurnReport(finish_reason="eos"))


async def held(flow: CaptionFlow, sent_s: float, within_s: float = 0.05) -> bool:
    try:
        await asyncio.wait_for(flow.room(sent_s), within_s)
        return False
    except TimeoutError:
        return True


async def test_it_holds_while_enough_captions_are_under_way_and_goes_on_as_they_end():
    flow = CaptionFlow()
    for n in range(CAPTIONS_IN_FLIGHT):
        flow.seen(final(f"t{n}", end_s=n + 1.0))
    assert await held(flow, sent_s=CAPTIONS_IN_FLIGHT + 1.0)
    waiting = asyncio.create_task(flow.room(CAPTIONS_IN_FLIGHT + 1.0))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    flow.seen(report("t0"))  # one caption turn over: room for more audio
    await asyncio.wait_for(waiting, 0.5)


async def test_it_holds_audio_past_the_lead_until_the_asr_shows_it_has_heard_more():
    flow = CaptionFlow()
    flow.seen(final("t0", end_s=10.0))
    assert not await held(flow, sent_s=10.0 + AUDIO_LEAD_S - 1)
    assert await held(flow, sent_s=10.0 + AUDIO_LEAD_S)  # t0's caption is under way: no stall rule
    flow.seen(pb.ServerEvent(transcript=pb.Transcript(text="more", speech_end_s=20.0)))  # a partial, further on
    assert not await held(flow, sent_s=10.0 + AUDIO_LEAD_S)


async def test_a_silence_with_nothing_under_way_lets_the_next_lead_go_after_a_stall(monkeypatch):
    monkeypatch.setattr(client, "STALL_S", 0.05)
    flow = CaptionFlow()
    assert await held(flow, sent_s=AUDIO_LEAD_S, within_s=0.01)  # nothing heard yet ...
    await asyncio.wait_for(flow.room(AUDIO_LEAD_S), 1.0)  # ... and nothing under way: after a stall, room
    assert not await held(flow, sent_s=2 * AUDIO_LEAD_S - 1)


@pytest.mark.parametrize(("text", "under_way"), [("", set()), ("   ", set()), ("words", {"t0"})])
def test_only_a_final_with_words_starts_a_caption_turn(text, under_way):
    flow = CaptionFlow()
    flow.seen(pb.ServerEvent(turn_id="t0", transcript=pb.Transcript(is_final=True, text=text, speech_end_s=1.0)))
    assert flow.turns == under_way
