"""A Converse stream's state is freed when the stream ends, by reference counting alone.

A stream's state that only the cyclic collector frees waits, once promoted, for a full
collection: a soak's gateway held 30 ended conversations at minute 12, their audio clocks with
them (docs/reliability.md). That its records stay bounded however long it runs is
tests/unit/test_conversation_ports.py's.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from pipeline.audio import PcmFormat, float_to_pcm16
from services.client import ClientOptions, Say, converse_script
from services.protos import load
from services.server import metrics
from services.settings import Settings
from tests.inprocess import four_services

gw, _ = load("gateway")


@pytest.mark.e2e
async def test_a_finished_conversation_and_its_turns_are_freed_without_the_cyclic_collector(redis_url, speech):
    settings = Settings(redis_url=redis_url)
    audio = float_to_pcm16(speech("What is the capital of France?"))
    async with four_services(settings) as addresses:
        gc.collect()
        gc.disable()  # what is freed now is freed by reference counting
        try:
            turns = await converse_script(addresses["gateway"], [Say(audio)], PcmFormat(16_000, 1, 2), ClientOptions(
                chunk_ms=40, realtime=False, wait_for_replies=True, config=gw.SessionConfig(max_reply_tokens=12)))
            assert turns[0].report and turns[0].report["finish_reason"] in ("eos", "length"), turns
            await asyncio.sleep(0.5)  # the stream's handler returns after the client has its end
            left = list(metrics._conversations)  # a WeakSet: only what something still holds
            assert not left, f"{len(left)} ended conversation(s) wait for the cyclic collector"
        finally:
            gc.enable()
