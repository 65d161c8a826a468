"""The model thread's queue: one call at a time, the earliest due first, cancellation safe."""

from __future__ import annotations

import asyncio
import threading

from services.server.model_worker import ModelWorker


async def _held(worker: ModelWorker) -> tuple[threading.Event, asyncio.Task]:
    """The worker busy with a call that returns once the event is set."""
    release = threading.Event()
    task = asyncio.create_task(worker.call(release.wait))
    await asyncio.sleep(0.05)
    return release, task


async def test_waiting_calls_run_earliest_due_first_then_in_arrival_order():
    worker = ModelWorker("test")
    release, held = await _held(worker)
    ran: list[str] = []
    calls = [asyncio.create_task(worker.call(ran.append, name, due_s=due))
             for name, due in (("later", 20.0), ("first", 10.0), ("also-later", 20.0), ("soon", 15.0))]
    await asyncio.sleep(0.05)
    assert ran == []  # one call at a time: all wait behind the held one
    release.set()
    await asyncio.gather(held, *calls)
    assert ran == ["first", "soon", "later", "also-later"]


async def test_calls_that_say_nothing_run_in_order():
    worker = ModelWorker("test")
    release, held = await _held(worker)
    ran: list[int] = []
    calls = []
    for i in range(5):
        calls.append(asyncio.create_task(worker.call(ran.append, i)))
        await asyncio.sleep(0.001)
    release.set()
    await asyncio.gather(held, *calls)
    assert ran == [0, 1, 2, 3, 4]


async def test_a_cancelled_waiter_never_holds_the_thread():
    worker = ModelWorker("test")
    release, held = await _held(worker)
    ran: list[str] = []
    gone = asyncio.create_task(worker.call(ran.append, "gone", due_s=1.0))
    kept = asyncio.create_task(worker.call(ran.append, "kept", due_s=2.0))
    await asyncio.sleep(0.01)
    gone.cancel()
    release.set()
    await asyncio.gather(held, kept)
    assert ran == ["kept"] and gone.cancelled()
    assert await asyncio.wait_for(worker.call(lambda: "free"), 1.0) == "free"  # the turn was passed on


async def test_a_tts_piece_due_later_yields_to_a_new_turns_first_piece():
    """iterate asks for each item's due time as it goes (the tts's playback deadline)."""
    worker = ModelWorker("test")
    release, held = await _held(worker)
    order: list[str] = []

    async def speak(name: str, due_s: float) -> None:
        async for item in worker.iterate(iter([f"{name}0", f"{name}1"]), lambda: due_s):
            order.append(item)

    playing = asyncio.create_task(speak("playing", 100.0))
    await asyncio.sleep(0.01)
    new = asyncio.create_task(speak("new", 50.0))
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(held, playing, new)
    assert order[0] == "new0"  # then each next item queues anew, behind what waits already
