"""Turn work handed out through Redis Streams consumer groups: any number of workers per stage.

One stream per stage (`sv:work:<stage>`, services/store/keys.py) read by one consumer group
(`<stage>`); every worker reads it under its stable consumer name (Settings.worker_name_of). An
entry is the whole of one turn's work for that stage; the worker that holds it acks it (and
deletes it) once the turn is done.

- A live worker keeps what it holds: every `refresh_ms` it resets the idle time of each entry
  it works on (XCLAIM ... JUSTID to itself, only while it is still the owner) and renews its
  heartbeat key. So a long reply is never taken from a worker that is alive.
- A dead worker's entries are taken over. Each worker keeps one connection to Redis named after
  it (CLIENT SETNAME); a process that dies (killed, crashed) loses it at once, its kernel closes
  the socket. Every poll, a worker with room takes the entries idle `claim_disconnected_ms` whose
  holder has no such connection any more (CLIENT LIST), and any entry idle `claim_idle_ms` (a
  holder frozen, or cut off from Redis, while its connection looks open). The new holder resumes
  the turn from its logs in Redis (the stage's business, not this module's); a worker restarted
  under the same name takes its own pending entries back first.
- A poison entry is not retried forever: one whose deliveries failed `max_deliveries` times (its
  handler raised, or its holder died with it) goes to `sv:work:<stage>:dead` with its last
  error, and is acked. A hand-back, or an entry taken from a holder still alive (a stalled
  loop), is no failure.
- Draining (SIGTERM): stop claiming, let what is held finish for `drain_grace_s`, then hand the
  rest back (idle time set far past the claim threshold, the delivery not counted) so another
  worker resumes it at once.

Plain redis-py asyncio; nothing here knows gRPC or what a stage does with a turn (an entry's
request is protobuf JSON, `turn_work`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

import redis.asyncio as aioredis
from google.protobuf import json_format
from google.protobuf.message import Message
from redis.exceptions import ResponseError

from services.store.client import REDIS_ERRORS, now_ms
from services.store.keys import attempts_key, dead_key, heartbeat_key, work_key

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
HANDED_BACK_IDLE_MS = 10**9  # an entry handed back looks idle this long: the next poll takes it


@dataclass(frozen=True)
class WorkOptions:
    """How workers share a stage's turns. The defaults aim at a recovery under 1 s (docs/reliability.md)."""

    # An entry idle this long is taken from its holder, whatever its holder's connection says. Live
    # holders reset the idle time every refresh_ms, so only one that missed ten refreshes in a row
    # (frozen, or cut off from Redis) loses it.
    claim_idle_ms: int = 1_000
    # ... and this long when its holder's named connection to Redis is gone (the process died).
    claim_disconnected_ms: int = 300
    refresh_ms: int = 100
    poll_ms: int = 100  # XREADGROUP blocks this long; reclaim runs once per poll
    heartbeat_ttl_ms: int = 2_000  # the consumer's heartbeat key lives this long after its last beat
    max_deliveries: int = 3  # delivered more often than this: dead-lettered
    drain_grace_s: float = 5.0  # on SIGTERM, held turns may finish this long, then are handed back
    dead_max_len: int = 1_000  # dead letters kept per stage (approximate MAXLEN)
    consumer_gc_idle_s: float = 300.0  # a consumer with nothing pending, no heartbeat, idle this long is removed


def turn_work(turn_id: str, request: Message, **extra: str) -> dict[str, str]:
    """A turn's work entry: everything the stage's call carried (the request as protobuf JSON), plus
    `extra` (the producer's trace context)."""
    return {"turn": turn_id, "request": json_format.MessageToJson(request, indent=None), "t_ms": str(now_ms()),
            **extra}


def work_request(item: WorkItem, message_type: type[M]) -> M:
    """The request a work entry carries (a malformed one raises: retried, then dead-lettered)."""
    return json_format.Parse(item.fields["request"], message_type())


def _connection_name(stage: str, consumer: str) -> str:
    """The name of a worker's liveness connection (CLIENT SETNAME takes no spaces)."""
    return f"sv-worker.{stage}.{consumer}".replace(" ", "_")


@dataclass(frozen=True)
class WorkItem:
    """One entry as delivered: its stream id, its fields, and how often it has been delivered."""

    id: str
    fields: dict[str, str]
    deliveries: int


class HandBack(Exception):  # noqa: N818 - a signal, not a failure
    """Raised by a handler that should not finish its entry here (draining, or its log moved on):
    the entry goes back to the group at once, this delivery not counted."""


class Fenced(Exception):  # noqa: N818 - a signal, not a failure
    """Raised by a handler that found another worker now owns its turn: drop it, no ack."""


# Reset the idle time of the entries this consumer still owns; return the ids it no longer owns.
_REFRESH = """
local lost = {}
for i, id in ipairs(ARGV) do
  if i > 1 then
    local p = redis.call('XPENDING', KEYS[1], KEYS[2], id, id, 1)
    if p[1] and p[1][2] == ARGV[1] then
      redis.call('XCLAIM', KEYS[1], KEYS[2], ARGV[1], 0, id, 'JUSTID')
    else
      table.insert(lost, id)
    end
  end
end
return lost
"""

# One entry's delivery records (a JSON list in the attempts hash), changed in place: `claim` opens
# this consumer's record, `fail` sets its error, `spare` marks it as no failure (handed back, or
# taken while its holder was alive). Only failed deliveries count towards the dead letter.
_ATTEMPT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local a = {}
if raw then a = cjson.decode(raw) end
if ARGV[3] == 'claim' then
  table.insert(a, {consumer = ARGV[2], unix_ms = tonumber(ARGV[5]), error = ARGV[4]})
  while #a > tonumber(ARGV[6]) do table.remove(a, 1) end
else
  for i = #a, 1, -1 do
    if a[i].consumer == ARGV[2] then
      a[i].error = ARGV[4]
      if ARGV[3] == 'spare' then a[i].spared = true end
      break
    end
  end
end
if #a > 0 then redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(a)) end
return #a
"""

# Give an entry back (idle time set high, delivery count given), only if this consumer still owns it.
_HAND_BACK = """
local p = redis.call('XPENDING', KEYS[1], KEYS[2], ARGV[2], ARGV[2], 1)
if not (p[1] and p[1][2] == ARGV[1]) then return 0 end
redis.call('XCLAIM', KEYS[1], KEYS[2], ARGV[1], 0, ARGV[2], 'IDLE', ARGV[3], 'RETRYCOUNT', ARGV[4], 'JUSTID')
return 1
"""


class WorkQueue:
    """One stage's work stream, seen by one consumer: a worker, under its stable name
    (Settings.worker_name_of); a producer, which only adds work, needs none."""

    def __init__(self, redis: aioredis.Redis, stage: str, consumer: str = "",
                 options: WorkOptions = WorkOptions()) -> None:
        self.redis, self.stage, self.options = redis, stage, options
        self.consumer = consumer
        self.key, self.group = work_key(stage), stage
        self._refresh = redis.register_script(_REFRESH)
        self._hand_back = redis.register_script(_HAND_BACK)
        self._attempt = redis.register_script(_ATTEMPT)
        self._group_ready = False
        self._own_pending_taken = False
        self._liveness: aioredis.Redis | None = None  # this consumer's named connection (heartbeat)
        self._can_list_clients = True  # False where CLIENT LIST is not allowed (an ACL user): idle time only

    async def ensure_group(self) -> None:
        """The stream and its group exist (created on first use, from the stream's start)."""
        try:
            await self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def forget_group(self) -> None:
        """The next call creates the stream and group again (they were lost)."""
        self._group_ready = False

    async def add(self, fields: dict[str, str]) -> str:
        """Hand out one piece of work; returns its entry id."""
        if not self._group_ready:
            await self.ensure_group()
        return await self.redis.xadd(self.key, fields)

    async def claim(self, count: int, block_ms: int | None = None, holding: Collection[str] = frozenset()
                    ) -> list[WorkItem]:
        """Up to `count` entries for this consumer: first (once) its own pending ones from an earlier
        life, then entries idle past `claim_idle_ms`, then new ones (waiting up to `block_ms`).
        `holding`: the ids this consumer works on, or is still letting go of (acking, handing back):
        never claimed again meanwhile, not even from itself; the poll after they are let go takes them."""
        if not self.consumer:
            raise ValueError(f"{self.stage}: a queue without a consumer name only adds work")
        if count < 1:
            return []
        if not self._group_ready:
            await self.ensure_group()
        ids_fields: list[tuple[str, dict[str, str]]] = []
        if not self._own_pending_taken:  # the rest, beyond `count`, go idle and are reclaimed
            self._own_pending_taken = True
            reply = await self.redis.xreadgroup(self.group, self.consumer, {self.key: "0"}, count=count)
            mine = reply[0][1] if reply else []
            gone = [i for i, f in mine if not f]  # deleted from the stream while pending
            if gone:
                await self.redis.xack(self.key, self.group, *gone)
            ids_fields += [(i, f) for i, f in mine if f and i not in holding]
        if len(ids_fields) < count:
            taken = await self._claim_from_the_dead(count - len(ids_fields), holding)
            ids_fields += [(i, f) for i, f in taken if f]
        if len(ids_fields) < count:
            ids_fields += await self._claim_idle(count - len(ids_fields), holding)
        if len(ids_fields) < count:
            reply = await self.redis.xreadgroup(self.group, self.consumer, {self.key: ">"},
                                                count=count - len(ids_fields),
                                                block=block_ms if not ids_fields else None)
            ids_fields += [(i, f) for i, f in (reply[0][1] if reply else [])]
        if not ids_fields:
            return []
        counts = await self._deliveries([i for i, _ in ids_fields])
        items = [WorkItem(i, f, counts[i]) for i, f in ids_fields if i in counts]
        await self._note_attempts(items)
        return items

    async def _claim_idle(self, count: int, holding: Collection[str]) -> list[tuple[str, dict[str, str]]]:
        """Entries idle `claim_idle_ms`, whoever holds them, except `holding`. Not XAUTOCLAIM, which
        takes those too (dropping them after): an entry reclaimed while this consumer still hands it
        back (a stall made it idle) would get that hand-back's IDLE and RETRYCOUNT on its new
        delivery: counted as the old one, taken again at once, and so on (a poison entry never
        dead-lettered); or, reclaimed just after, be dropped and wait out `claim_idle_ms`."""
        idle = [e["message_id"] for e in await self.redis.xpending_range(self.key, self.group, "-", "+", 100,
                                                                         idle=self.options.claim_idle_ms)
                if e["message_id"] not in holding]
        if not idle:
            return []
        claimed = await self.redis.xclaim(self.key, self.group, self.consumer, self.options.claim_idle_ms,
                                          idle[:count])
        return [(i, f) for i, f in claimed if f]

    async def _claim_from_the_dead(self, count: int, holding: Collection[str]) -> list[tuple[str, dict[str, str]]]:
        """Entries idle `claim_disconnected_ms` whose holder's named connection is gone: taken now,
        not after `claim_idle_ms`. Asks CLIENT LIST only when some entry has gone that idle."""
        if not self._can_list_clients:
            return []
        stale = [e for e in await self.redis.xpending_range(self.key, self.group, "-", "+", 100,
                                                            idle=self.options.claim_disconnected_ms)
                 if e["consumer"] != self.consumer and e["message_id"] not in holding]
        if not stale:
            return []
        try:
            connected = {c.get("name", "") for c in await self.redis.client_list(_type="normal")}
        except ResponseError as e:  # NOPERM: an ACL user without CLIENT; the idle time alone decides
            log.warning("%s: CLIENT LIST refused (%s): a dead worker's turns wait claim_idle_ms", self.stage, e)
            self._can_list_clients = False
            return []
        dead = [e["message_id"] for e in stale if _connection_name(self.stage, e["consumer"]) not in connected]
        if not dead:
            return []
        claimed = await self.redis.xclaim(self.key, self.group, self.consumer, self.options.claim_disconnected_ms,
                                          dead[:count])
        return [(i, f) for i, f in claimed]

    async def _deliveries(self, ids: list[str]) -> dict[str, int]:
        """The delivery count of each entry claimed that is still this consumer's (not acked since,
        nor taken by another consumer while this one stalled)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.xpending_range(self.key, self.group, i, i, 1)
            replies = await pipe.execute()
        return {r[0]["message_id"]: int(r[0]["times_delivered"]) for r in replies
                if r and r[0]["consumer"] == self.consumer}

    async def _note_attempts(self, items: list[WorkItem]) -> None:
        """Each delivery's record starts as 'its holder stopped': what a killed worker leaves behind.
        A handler's own failure replaces it (`fail`); a hand-back or a live holder's loss spares it."""
        error = f"worker {self.consumer} stopped while holding it (killed, or cut off)"
        for item in items:
            await self._record(item.id, "claim", error)

    async def _record(self, entry_id: str, op: str, text: str) -> None:
        keep = 4 * (self.options.max_deliveries + 1)
        await self._attempt(keys=[attempts_key(self.stage)], args=[entry_id, self.consumer, op, text, now_ms(), keep])

    async def attempts(self, item: WorkItem) -> list[dict]:
        return json.loads(await self.redis.hget(attempts_key(self.stage), item.id) or "[]")

    async def failures(self, item: WorkItem) -> int:
        """Deliveries before this one that failed (not handed back, not taken from a live holder)."""
        return sum(not a.get("spared") for a in (await self.attempts(item))[:-1])

    async def spare(self, entry_id: str, why: str) -> None:
        """This consumer's delivery of the entry ended through no fault of the entry's: it does not count."""
        await self._record(entry_id, "spare", why)

    async def refresh(self, ids: list[str]) -> list[str]:
        """Reset the idle time of the entries held; returns those another consumer has taken."""
        if not ids:
            return []
        return list(await self._refresh(keys=[self.key, self.group], args=[self.consumer, *ids]))

    async def heartbeat(self, held: int) -> None:
        """The heartbeat key, sent over this consumer's own named connection (named again each time:
        a connection redis-py made anew after a Redis restart has no name)."""
        if self._liveness is None:
            self._liveness = aioredis.Redis(connection_pool=self.redis.connection_pool, single_connection_client=True)
        await self._liveness.client_setname(_connection_name(self.stage, self.consumer))  # (a pipeline
        await self._liveness.set(heartbeat_key(self.stage, self.consumer),  # would take another connection)
                                 json.dumps({"held": held, "unix_ms": now_ms(), "pid": os.getpid()}),
                                 px=self.options.heartbeat_ttl_ms)

    async def ack(self, item: WorkItem) -> None:
        """Done: acked, deleted from the stream (a stream holds only work not yet done) and forgotten."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.key, self.group, item.id)
            pipe.xdel(self.key, item.id)
            pipe.hdel(attempts_key(self.stage), item.id)
            await pipe.execute()

    async def hand_back(self, item: WorkItem, count_delivery: bool = False) -> bool:
        """Give the entry up now: the next poll of any worker takes it (this delivery not counted,
        unless it failed). False if another consumer had already taken it."""
        retries = item.deliveries if count_delivery else max(0, item.deliveries - 1)
        if not count_delivery:
            await self.spare(item.id, f"handed back by {self.consumer}")
        return bool(await self._hand_back(keys=[self.key, self.group],
                                          args=[self.consumer, item.id, HANDED_BACK_IDLE_MS, retries]))

    async def fail(self, item: WorkItem, error: str) -> None:
        """The handler failed: record why (the dead letter carries the last reason), hand the entry back."""
        await self._record(item.id, "fail", error)
        await self.hand_back(item, count_delivery=True)

    async def dead_letter(self, item: WorkItem) -> dict[str, str]:
        """Move the entry to the dead-letter stream with its last error, and ack it; returns the letter."""
        key = attempts_key(self.stage)
        earlier = (await self.attempts(item))[:-1]  # the last record is this delivery's own, opened by claim()
        failed = [a for a in earlier if not a.get("spared")]
        letter = {**item.fields, "work_id": item.id, "deliveries": str(len(failed)),
                  "handed_out": str(item.deliveries - 1), "error": failed[-1]["error"] if failed else "unknown",
                  "attempts": json.dumps(earlier), "dead_unix_ms": str(now_ms())}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(dead_key(self.stage), letter, maxlen=self.options.dead_max_len, approximate=True)
            pipe.xack(self.key, self.group, item.id)
            pipe.xdel(self.key, item.id)
            pipe.hdel(key, item.id)
            await pipe.execute()
        return letter

    async def collect_consumers(self) -> list[str]:
        """Remove consumers that hold nothing, send no heartbeat and have been idle a while: the group's
        state stays bounded however many workers came and went. Returns the names removed."""
        if not self._group_ready:
            await self.ensure_group()
        removed = []
        for info in await self.redis.xinfo_consumers(self.key, self.group):
            name = info["name"]
            if name == self.consumer or info["pending"] or info["idle"] < self.options.consumer_gc_idle_s * 1000:
                continue
            if await self.redis.exists(heartbeat_key(self.stage, name)):
                continue
            await self.redis.xgroup_delconsumer(self.key, self.group, name)
            removed.append(name)
        return removed

    async def retire(self) -> None:
        """This consumer stops (drained): its heartbeat and its named connection go at once."""
        await self.redis.delete(heartbeat_key(self.stage, self.consumer))
        if self._liveness is not None:
            await self._liveness.aclose()
            self._liveness = None


Handler = Callable[[WorkItem], Awaitable[None]]
DeadHandler = Callable[[WorkItem, dict[str, str]], Awaitable[None]]


async def run_worker(queue: WorkQueue, handle: Handler, capacity: int, draining: asyncio.Event,
                     on_dead: DeadHandler | None = None) -> None:
    """Take and run work until `draining` is set; then finish or hand back what is held.

    `handle(item)` does the turn; returning means done (acked). `HandBack` gives it back uncounted,
    `Fenced` drops it (another worker owns it now), any other exception counts as a failed delivery.
    `on_dead(item, letter)` runs when an entry is dead-lettered (the stage tells the turn's readers).
    """
    options = queue.options
    held: dict[str, asyncio.Task] = {}  # the entries refreshed: being worked on
    running: dict[asyncio.Task, str] = {}  # every handling task and its entry, until it has acked or let go of it
    stop_beating = asyncio.Event()
    beating = asyncio.create_task(_keep_alive(queue, held, stop_beating))
    drained = asyncio.create_task(draining.wait())
    last_gc = 0.0
    try:
        while not draining.is_set():
            try:
                if time.monotonic() - last_gc > options.consumer_gc_idle_s / 10:
                    last_gc = time.monotonic()
                    await queue.collect_consumers()
                room = capacity - len(running)
                if room <= 0:
                    await asyncio.wait([*running, drained],
                                       timeout=options.poll_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # Not `held`: a task leaves it before its hand-back, and is still letting go of its entry.
                for item in await queue.claim(room, options.poll_ms, running.values()):
                    if (item.deliveries > options.max_deliveries
                            and await queue.failures(item) >= options.max_deliveries):
                        letter = await queue.dead_letter(item)
                        log.warning("%s: work %s dead-lettered after %s deliveries: %s", queue.stage, item.id,
                                    letter["deliveries"], letter["error"])
                        if on_dead is not None:
                            await _quietly(on_dead(item, letter), f"{queue.stage}: ending dead-lettered {item.id}")
                        continue
                    held[item.id] = task = asyncio.create_task(_run_one(queue, handle, item, held))
                    running[task] = item.id
                    task.add_done_callback(running.pop)
            except REDIS_ERRORS as e:  # Redis away past its retry deadline: wait, then try again
                log.warning("%s worker %s: %s; retrying", queue.stage, queue.consumer, e)
                await asyncio.sleep(options.poll_ms / 1000)
            except ResponseError as e:  # the stream or its group went (deleted, a Redis without its data)
                log.warning("%s worker %s: %s; creating the group again", queue.stage, queue.consumer, e)
                queue.forget_group()
                await asyncio.sleep(options.poll_ms / 1000)
        if running:
            log.info("%s worker %s draining: %d turns held", queue.stage, queue.consumer, len(running))
            await asyncio.wait(list(running), timeout=options.drain_grace_s)
        for task in list(running):
            task.cancel()  # _run_one hands a cancelled entry back
        await asyncio.gather(*running, return_exceptions=True)
    finally:  # also when this worker is cancelled itself: what it holds is handed back, not left running
        for task in list(running):
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        drained.cancel()
        stop_beating.set()  # not cancel(): a cancel landing inside a redis-py call can be swallowed there
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, *REDIS_ERRORS):
            await asyncio.wait_for(beating, 5)
        with contextlib.suppress(TimeoutError, *REDIS_ERRORS):
            await asyncio.wait_for(queue.retire(), 5)


async def _run_one(queue: WorkQueue, handle: Handler, item: WorkItem, held: dict[str, asyncio.Task]) -> None:
    """One entry's handling, then its fate: acked, handed back, dropped or failed. It leaves `held`
    before any of that, so the heartbeat loop no longer refreshes an entry being let go."""
    try:
        await handle(item)
    except asyncio.CancelledError:  # draining past its grace, or taken by another consumer
        held.pop(item.id, None)
        await _quietly(queue.hand_back(item), f"{queue.stage}: handing back {item.id}")
        raise
    except HandBack:
        held.pop(item.id, None)
        await _quietly(queue.hand_back(item), f"{queue.stage}: handing back {item.id}")
        return
    except Fenced:
        log.info("%s: work %s moved to another worker", queue.stage, item.id)
        return
    except Exception as e:  # noqa: BLE001 - a failed delivery: recorded, retried, dead-lettered in the end
        held.pop(item.id, None)
        log.exception("%s: work %s failed (delivery %d)", queue.stage, item.id, item.deliveries)
        await _quietly(queue.fail(item, f"{type(e).__name__}: {e}"), f"{queue.stage}: recording {item.id}")
        return
    held.pop(item.id, None)
    await _quietly(queue.ack(item), f"{queue.stage}: acking {item.id}")


async def _keep_alive(queue: WorkQueue, held: dict[str, asyncio.Task], stop: asyncio.Event) -> None:
    """The heartbeat, and the idle-time reset of every held entry; a lost entry's task is stopped."""
    last = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now - last > 4 * queue.options.refresh_ms / 1000:
            log.warning("%s: held entries refreshed %.0f ms apart (a stalled loop risks losing them)",
                        queue.stage, (now - last) * 1000)
        last = now
        try:
            await queue.heartbeat(len(held))
            for lost in await queue.refresh(list(held)):
                if task := held.pop(lost, None):
                    log.warning("%s: work %s was taken by another worker; stopping it here", queue.stage, lost)
                    task.cancel()
                    await queue.spare(lost, f"taken from {queue.consumer} while it was alive (its loop stalled)")
        except REDIS_ERRORS as e:
            log.warning("%s heartbeat: %s", queue.stage, e)
        except ResponseError:
            log.exception("%s heartbeat", queue.stage)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), queue.options.refresh_ms / 1000)


async def _quietly(awaitable: Awaitable[object], what: str) -> None:
    try:
        await awaitable
    except REDIS_ERRORS as e:  # the entry stays pending; it is reclaimed once Redis is back
        log.warning("%s: %s", what, e)
