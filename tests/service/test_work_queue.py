"""The work queue on a real Valkey: claim, ack, reclaim from a dead consumer, entries a live one
keeps, poison entries dead-lettered, hand-back on drain, and nothing left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time

import pytest

from services.store.client import connect
from services.store.keys import attempts_key, dead_key, heartbeat_key, work_key
from services.store.work_queue import HandBack, WorkOptions, WorkQueue, run_worker

FAST = WorkOptions(claim_idle_ms=200, refresh_ms=40, poll_ms=20, heartbeat_ttl_ms=400, max_deliveries=3,
                   drain_grace_s=0.5)
_stages = itertools.count()


@pytest.fixture
async def redis(redis_url):
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def stage():
    return f"test{next(_stages)}"


def queue(redis, stage: str, name: str, options: WorkOptions = FAST) -> WorkQueue:
    return WorkQueue(redis, stage, name, options)


async def pending(redis, stage: str) -> list[dict]:
    return await redis.xpending_range(work_key(stage), stage, "-", "+", 100)


async def test_work_is_claimed_once_and_an_ack_deletes_it(redis, stage):
    a, b = queue(redis, stage, "a"), queue(redis, stage, "b")
    ids = [await a.add({"turn": f"t{i}"}) for i in range(3)]
    got_a = await a.claim(2, block_ms=10)
    got_b = await b.claim(5, block_ms=10)
    assert [i.fields["turn"] for i in got_a] == ["t0", "t1"] and [i.fields["turn"] for i in got_b] == ["t2"]
    assert all(i.deliveries == 1 for i in got_a + got_b)
    assert await b.claim(5, block_ms=10) == []  # nothing is handed out twice while it is held
    for item in got_a + got_b:
        await (a if item in got_a else b).ack(item)
    assert await redis.xlen(work_key(stage)) == 0 and await pending(redis, stage) == []
    assert not await redis.exists(attempts_key(stage))
    assert sorted(ids) == sorted(i.id for i in got_a + got_b)


async def test_a_dead_consumers_entry_is_reclaimed_after_the_idle_time(redis, stage):
    dead, alive = queue(redis, stage, "dead"), queue(redis, stage, "alive")
    await dead.add({"turn": "t"})
    [held] = await dead.claim(1, block_ms=10)
    assert await alive.claim(1, block_ms=10) == []  # not idle long enough yet
    await asyncio.sleep(FAST.claim_idle_ms / 1000 + 0.05)  # the holder died: no refresh
    [taken] = await alive.claim(1, block_ms=10)
    assert taken.id == held.id and taken.deliveries == 2
    assert await dead.refresh([held.id]) == [held.id]  # the old holder learns it lost the entry
    attempts = json.loads(await redis.hget(attempts_key(stage), held.id))
    assert [a["consumer"] for a in attempts] == ["dead", "alive"]
    assert "stopped while holding it" in attempts[0]["error"]


async def test_a_live_worker_keeps_a_long_turn_and_nobody_steals_it(redis, stage):
    # The idle threshold is 20 refreshes here: the test is about the refresh, not about a loaded
    # machine's scheduling (the shipped default's margin is measured by `specvox bench faults`).
    options = WorkOptions(claim_idle_ms=1_000, refresh_ms=50, poll_ms=20)
    worker, thief = queue(redis, stage, "worker", options), queue(redis, stage, "thief", options)
    release, runs = asyncio.Event(), []

    async def long_turn(item):
        runs.append(item.id)
        await release.wait()

    draining = asyncio.Event()
    running = asyncio.create_task(run_worker(worker, long_turn, capacity=1, draining=draining))
    await worker.add({"turn": "long"})
    while not runs:
        await asyncio.sleep(0.01)
    stolen = []
    for _ in range(int(3 * options.claim_idle_ms / 20)):  # three idle windows of polling by another worker
        stolen += await thief.claim(1, block_ms=20)
    assert stolen == []
    assert await redis.exists(heartbeat_key(stage, "worker"))
    release.set()
    while await redis.xlen(work_key(stage)):
        await asyncio.sleep(0.01)
    draining.set()
    await running
    assert len(runs) == 1 and await pending(redis, stage) == []
    assert not await redis.exists(heartbeat_key(stage, "worker"))  # a drained worker says so at once


async def test_a_poison_entry_is_dead_lettered_with_its_error_not_retried_forever(redis, stage):
    # A generous idle threshold (free: a failed delivery is handed back looking idle 10^9 ms). With
    # FAST's 200 ms, a stall of this test process (both workers share its loop; CI loads it) lets
    # one worker take the entry from the other, alive: a hand-out counted, never run ([1, 2, 4]),
    # or run twice. Stalls are the business of the test below.
    options = dataclasses.replace(FAST, claim_idle_ms=10_000)
    tries, dead = [], []

    async def poisoned(item):
        tries.append(item.deliveries)
        raise ValueError(f"cannot read {item.fields['turn']}")

    async def on_dead(item, letter):
        dead.append(letter)

    draining = asyncio.Event()
    workers = [asyncio.create_task(run_worker(queue(redis, stage, name, options), poisoned, 2, draining, on_dead))
               for name in ("w1", "w2")]
    await queue(redis, stage, "producer").add({"turn": "poison"})
    while not dead:
        await asyncio.sleep(0.01)
    draining.set()
    await asyncio.gather(*workers)
    assert sorted(tries) == [1, 2, 3]  # max_deliveries tries, then no more
    [(_, letter)] = await redis.xrange(dead_key(stage))
    assert letter["turn"] == "poison" and letter["deliveries"] == "3"
    assert letter["error"] == "ValueError: cannot read poison"
    assert [a["error"] for a in json.loads(letter["attempts"])] == ["ValueError: cannot read poison"] * 3
    assert dead == [letter]
    assert await redis.xlen(work_key(stage)) == 0 and await pending(redis, stage) == []
    assert not await redis.exists(attempts_key(stage))


async def test_a_failed_delivery_counts_even_when_its_hand_back_is_slow(redis, stage):
    """The CI failure of the test above, made certain: a stall (the loop blocked past claim_idle_ms)
    leaves the entry idle enough to be reclaimed while its failed delivery is still being handed
    back, and that hand-back is slow. The worker must not claim the entry again meanwhile: the late
    hand-back would overwrite the new delivery's count (taken again at once, uncounted, and so on)."""
    calls, dead = [], []

    class SlowToLetGo(WorkQueue):
        async def hand_back(self, item, count_delivery=False):
            for _ in range(5):  # until another delivery has started, or five polls
                if calls[-1] is not item:
                    break
                await asyncio.sleep(FAST.poll_ms / 1000)
            return await super().hand_back(item, count_delivery)

    async def poisoned(item):
        calls.append(item)
        if len(calls) == 1:
            time.sleep(FAST.claim_idle_ms / 1000 + 0.05)  # the loop stalls: nothing is refreshed
        raise ValueError("cannot read it")

    async def on_dead(item, letter):
        dead.append(letter)

    draining = asyncio.Event()
    worker = asyncio.create_task(run_worker(SlowToLetGo(redis, stage, "w", FAST), poisoned, 2, draining, on_dead))
    await queue(redis, stage, "producer").add({"turn": "poison"})
    while not dead and len(calls) < 10:
        await asyncio.sleep(0.01)
    draining.set()
    await worker
    assert [c.deliveries for c in calls] == [1, 2, 3] and [d["deliveries"] for d in dead] == ["3"]


async def test_draining_finishes_what_it_can_and_hands_the_rest_back_uncounted(redis, stage):
    finished, stuck = [], asyncio.Event()

    async def handle(item):
        if item.fields["turn"] == "short":
            await asyncio.sleep(0.05)
            finished.append(item.fields["turn"])
        else:
            await stuck.wait()  # longer than the grace

    draining = asyncio.Event()
    worker = queue(redis, stage, "leaving")
    running = asyncio.create_task(run_worker(worker, handle, capacity=2, draining=draining))
    await worker.add({"turn": "short"})
    await worker.add({"turn": "long"})
    while len(await pending(redis, stage)) < 2:
        await asyncio.sleep(0.01)
    draining.set()
    await running
    assert finished == ["short"]
    [item] = await queue(redis, stage, "next").claim(1, block_ms=10)  # at once: no idle time to wait out
    assert item.fields["turn"] == "long" and item.deliveries == 1  # the hand-back counted no delivery


async def test_a_handler_can_hand_its_entry_back(redis, stage):
    handed = []

    async def handle(item):
        handed.append(item.deliveries)
        if len(handed) < 3:
            raise HandBack
        return None

    draining = asyncio.Event()
    running = asyncio.create_task(run_worker(queue(redis, stage, "w"), handle, 1, draining))
    await queue(redis, stage, "p").add({"turn": "t"})
    while await redis.xlen(work_key(stage)):
        await asyncio.sleep(0.01)
    draining.set()
    await running
    assert handed == [1, 1, 1]  # never dead-lettered for being handed back
    assert await redis.xlen(dead_key(stage)) == 0


async def test_a_worker_restarted_under_its_name_takes_its_own_turns_back_first(redis, stage):
    before = queue(redis, stage, "llm-0")
    await before.add({"turn": "mine"})
    await before.add({"turn": "new"})
    [mine] = await before.claim(1, block_ms=10)
    again = queue(redis, stage, "llm-0")  # the same name, a new process
    [first, second] = await again.claim(2, block_ms=10)
    assert (first.id, first.deliveries) == (mine.id, 2) and second.fields["turn"] == "new"


async def test_gone_consumers_are_removed_from_the_group(redis, stage):
    options = WorkOptions(claim_idle_ms=200, consumer_gc_idle_s=0.1)
    gone, busy, me = (queue(redis, stage, n, options) for n in ("gone", "busy", "me"))
    await gone.add({"turn": "a"})
    await busy.add({"turn": "b"})
    await gone.ack((await gone.claim(1, block_ms=10))[0])
    await busy.claim(1, block_ms=10)  # holds an entry: stays until it is reclaimed
    await asyncio.sleep(0.15)
    assert await me.collect_consumers() == ["gone"]
    names = {c["name"] for c in await redis.xinfo_consumers(work_key(stage), stage)}
    assert names == {"busy"}


async def test_a_turn_log_has_one_writer_at_a_time_and_takes_each_entry_once(redis):
    from services.store.keys import token_stream_key, turn_key
    from services.store.turn_log import LogGap, LogMoved, TurnLogWriter, TurnStore, read_token_log

    turns = TurnStore(redis)
    turn = await turns.create("session")
    first = TurnLogWriter(redis, turn, "llm", token_stream_key(turn), ttl_s=60)
    assert await first.claim() == 0
    for seq, text in enumerate(["Hello", " there"]):
        assert not await first.append({"seq": seq, "text": text, "token_ids": seq})
    second = TurnLogWriter(redis, turn, "llm", token_stream_key(turn), ttl_s=60)
    assert await second.claim() == 2  # a worker taking the turn over continues after the last entry
    with pytest.raises(LogMoved):
        await first.append({"seq": 2, "text": " stale"})  # the earlier holder is fenced out
    await second.append({"seq": 2, "text": ","})
    second.next_seq -= 1  # a call retried after its reply was lost
    await second.append({"seq": 2, "text": ","})
    await turns.cancel(turn)
    assert await second.append({"seq": 3, "text": " friend", "end": 1, "finish_reason": "eos"})  # cancelled
    assert [e.text for e in await read_token_log(redis, turn)] == ["Hello", " there", ",", " friend"]
    await redis.hset(turn_key(turn), "llm_seq", 1)  # Redis came back from an AOF a second behind
    with pytest.raises(LogGap):
        await second.append({"seq": 4, "text": "!"})
    assert 0 < await redis.ttl(token_stream_key(turn)) <= 60


async def test_an_entry_taken_from_live_holders_is_no_poison(redis, stage):
    """A holder whose loop stalled past the idle time loses its entry, notices, and spares the
    delivery: however often that happens, only failed deliveries lead to the dead letter."""
    workers = [queue(redis, stage, name) for name in ("slow-a", "slow-b")]
    await workers[0].add({"turn": "t"})
    [item] = await workers[0].claim(1, block_ms=10)
    for round_ in range(2 * FAST.max_deliveries):
        await asyncio.sleep(FAST.claim_idle_ms / 1000 + 0.05)  # the holder's loop stalls
        taker = workers[(round_ + 1) % 2]
        loser = workers[round_ % 2]
        [item] = await taker.claim(1, block_ms=10)
        assert await loser.refresh([item.id]) == [item.id]
        await loser.spare(item.id, "taken while alive")  # what its heartbeat loop does on noticing
    assert item.deliveries == 2 * FAST.max_deliveries + 1 and await workers[0].failures(item) == 0
    await asyncio.sleep(FAST.claim_idle_ms / 1000 + 0.05)
    [again] = await workers[1].claim(1, block_ms=10)  # the last holder died: that one counts
    assert await workers[1].failures(again) == 1


async def test_a_killed_workers_entry_is_taken_as_soon_as_its_connection_is_gone(redis_url, redis, stage):
    """A worker that dies loses its named connection at once (its kernel closes the socket): its
    entry is taken after claim_disconnected_ms, long before claim_idle_ms. One whose connection is
    still open keeps its entry however idle, up to claim_idle_ms (a stall is not a death)."""
    options = WorkOptions(claim_idle_ms=60_000, claim_disconnected_ms=100, refresh_ms=40, poll_ms=20)
    dying_client = connect(redis_url)
    dying, other = WorkQueue(dying_client, stage, "dying", options), queue(redis, stage, "other", options)
    await dying.add({"turn": "t"})
    [held] = await dying.claim(1, block_ms=10)
    await dying.heartbeat(1)  # names its connection
    await asyncio.sleep(0.3)
    assert await other.claim(1, block_ms=10) == []  # idle past 100 ms, but its holder is connected
    await dying_client.connection_pool.disconnect()  # the process died: its sockets are closed
    taken = []
    for _ in range(100):
        taken = await other.claim(1, block_ms=10)
        if taken:
            break
    assert [t.id for t in taken] == [held.id] and taken[0].deliveries == 2
    await dying_client.aclose()
