"""A turn in Redis: its record, and the two logs its stages write, which any worker can resume.

- the token log (`sv:turn:{id}:tokens`): the llm's reply, one entry per verify step (TokenEntry)
- the speech log (`sv:turn:{id}:speech`): the tts's phrases, words, audio chunks and cues (SpeechEntry)

A stage writes its log through a fenced TurnLogWriter; readers tail it with one reader that
gives each entry once (an XADD retried after its reply was lost may land twice).
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import redis.asyncio as aioredis

from services.store.client import block_ms, now_ms
from services.store.keys import cancel_key, speech_stream_key, token_stream_key, turn_key


class UnknownTurnError(LookupError):
    pass


@dataclass
class TurnStore:
    redis: aioredis.Redis
    ttl_s: int = 3600

    async def create(self, session_id: str, turn_id: str = "") -> str:
        turn_id = turn_id or uuid.uuid4().hex
        key = turn_key(turn_id)
        await self.redis.hset(key, mapping={"session_id": session_id, "created_unix_ms": now_ms()})
        await self.redis.expire(key, self.ttl_s)
        return turn_id

    async def require(self, turn_id: str, session_id: str) -> None:
        owner = await self.redis.hget(turn_key(turn_id), "session_id")
        if owner is None:
            raise UnknownTurnError(f"unknown turn id {turn_id!r}")
        if owner != session_id:
            raise UnknownTurnError(f"turn {turn_id!r} does not belong to session {session_id!r}")

    async def cancel(self, turn_id: str, reason: str = "cancelled") -> None:
        """Barge-in or a client gone: the workers on the turn stop at their next step or piece."""
        await self.redis.set(cancel_key(turn_id), reason, ex=self.ttl_s)

    async def cancelled(self, turn_id: str) -> bool:
        return bool(await self.redis.exists(cancel_key(turn_id)))

    async def plan(self, turn_id: str, stage: str, plan: str) -> str:
        """The stage's plan of the turn (what a worker resuming it must decode or say the same way):
        the first one recorded wins, and is returned."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hsetnx(turn_key(turn_id), f"{stage}_plan", plan)
            pipe.hget(turn_key(turn_id), f"{stage}_plan")
            _, recorded = await pipe.execute()
        return recorded

    async def once(self, turn_id: str, what: str) -> bool:
        """True the first time `what` is claimed for this turn (an effect a resumed worker must not repeat)."""
        return bool(await self.redis.hsetnx(turn_key(turn_id), f"done_{what}", now_ms()))


@dataclass(frozen=True)
class TokenEntry:
    """One verify step in the turn's stream; the last entry has `end` set."""

    seq: int
    token_ids: tuple[int, ...]
    text: str
    accepted: int
    emitted_unix_ms: int
    end: bool = False
    finish_reason: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {
            "seq": self.seq,
            "token_ids": " ".join(map(str, self.token_ids)),
            "text": self.text,
            "accepted": self.accepted,
            "t_ms": self.emitted_unix_ms,
        }
        if self.end:
            out |= {"end": 1, "finish_reason": self.finish_reason}
        return out | self.extra

    @classmethod
    def parse(cls, data: dict[str, str]) -> TokenEntry:
        known = {"seq", "token_ids", "text", "accepted", "t_ms", "end", "finish_reason"}
        return cls(
            seq=int(data["seq"]),
            token_ids=tuple(int(t) for t in data.get("token_ids", "").split()),
            text=data.get("text", ""),
            accepted=int(data.get("accepted", 0)),
            emitted_unix_ms=int(data.get("t_ms", 0)),
            end=data.get("end") == "1",
            finish_reason=data.get("finish_reason", ""),
            extra={k: v for k, v in data.items() if k not in known},
        )


@dataclass
class TokenStreamWriter:
    """An unfenced writer of a token log: for tests and benchmarks standing in for the llm."""

    redis: aioredis.Redis
    turn_id: str
    ttl_s: int = 3600

    async def append(self, entry: TokenEntry) -> None:
        """XADD and EXPIRE in one round trip, so even a stream whose writer dies expires."""
        key = token_stream_key(self.turn_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(key, entry.fields())
            pipe.expire(key, self.ttl_s)
            await pipe.execute()


class LogMoved(Exception):  # noqa: N818 - a signal
    """Another worker claimed the turn's log after this one: this writer must stop (it is fenced)."""


class LogGap(Exception):  # noqa: N818 - a signal
    """The log in Redis ends before what this writer wrote (a Redis restarted from an AOF that missed
    its last second): the turn must be resumed from the log as it is."""


# Append entries numbered first..first+n-1 to a turn's log, if this writer's epoch is the turn's
# (fencing) and they follow the last entry written (a retried call's entries are not added twice);
# returns 1 when the turn is cancelled, 0 when not, -1 fenced, -2 a gap. The log's expiry is
# pushed to ARGV[4] seconds, or kept where the turn is done (`finish_turn`: a cancelled reply's
# last steps must not keep a finished turn an hour).
_FENCED_APPEND = """
if redis.call('HGET', KEYS[1], ARGV[1] .. '_epoch') ~= ARGV[2] then return -1 end
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. '_seq') or '-1')
local first = tonumber(ARGV[3])
local entries = cjson.decode(ARGV[5])
if first + #entries - 1 > last then
  if first ~= last + 1 then return -2 end
  for _, e in ipairs(entries) do redis.call('XADD', KEYS[2], '*', unpack(e)) end
  redis.call('HSET', KEYS[1], ARGV[1] .. '_seq', first + #entries - 1)
end
if redis.call('HEXISTS', KEYS[1], 'done_unix_ms') == 0 or redis.call('TTL', KEYS[2]) < 0 then
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return redis.call('EXISTS', KEYS[3])
"""


async def finish_turn(redis: aioredis.Redis, turn_id: str, ttl_s: int) -> None:
    """The turn is over (its speech stream ended): its record, token log, speech stream and cancel
    key expire `ttl_s` from now instead of `token_stream_ttl_s` after their last write, so that
    what a stack holds in Redis is bounded by its recent turns (finished_turn_ttl_s)."""
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(turn_key(turn_id), "done_unix_ms", now_ms())
        for key in (turn_key(turn_id), token_stream_key(turn_id), speech_stream_key(turn_id), cancel_key(turn_id)):
            pipe.expire(key, ttl_s)
        await pipe.execute()


class TurnLogWriter:
    """One stage's writer of one turn's log (the llm's token log, the tts's speech stream).

    `claim()` takes the log over: it bumps the stage's epoch in the turn's hash, so an earlier
    writer (a worker taken for dead, still running) is refused from then on. Entries carry a
    running number; the hash keeps the last one written, so a resumed writer continues after it.
    """

    def __init__(self, redis: aioredis.Redis, turn_id: str, stage: str, stream_key: str, ttl_s: int) -> None:
        self.redis, self.turn_id, self.stage, self.key, self.ttl_s = redis, turn_id, stage, stream_key, ttl_s
        self.epoch = ""
        self.next_seq = 0
        self._append = redis.register_script(_FENCED_APPEND)

    async def claim(self) -> int:
        """This writer owns the log from now on; returns the number of the next entry."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(turn_key(self.turn_id), f"{self.stage}_epoch", 1)
            pipe.hget(turn_key(self.turn_id), f"{self.stage}_seq")
            epoch, last = await pipe.execute()
        self.epoch, self.next_seq = str(epoch), int(last if last is not None else -1) + 1
        return self.next_seq

    async def append(self, *entries: dict[str, str | int]) -> bool:
        """Write entries (atomically, as one piece) numbered from `next_seq`; True if the turn is cancelled."""
        keys = [turn_key(self.turn_id), self.key, cancel_key(self.turn_id)]
        flat = json.dumps([[str(x) for kv in e.items() for x in kv] for e in entries])
        result = int(await self._append(keys=keys, args=[self.stage, self.epoch, self.next_seq, self.ttl_s, flat]))
        if result == -1:
            raise LogMoved(f"{self.stage}: turn {self.turn_id} was claimed by another worker")
        if result == -2:
            raise LogGap(f"{self.stage}: the log of turn {self.turn_id} ends before entry {self.next_seq}")
        self.next_seq += len(entries)
        return result == 1


@dataclass(frozen=True)
class SpeechEntry:
    """One entry of a turn's speech stream, the tts stage's output log.

    `phrase` entries open a phrase (its text, where it starts in the reply's timeline, the chunk
    and word numbers it starts at); `word`, `viseme`, `audio` and `cue` entries carry a
    serialized tts.v1.SpeechEvent, numbered by (phrase, index): the chunk's index within the turn
    for audio, the word's for words, the viseme's within its phrase for visemes. The `end` entry
    closes the turn's speech (finish_reason, error).
    """

    n: int  # the entry's running number in the stream
    kind: str
    phrase: int = -1
    index: int = -1
    event: bytes = b""
    data: dict[str, str] = field(default_factory=dict)

    def fields(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {"n": self.n, "kind": self.kind, "phrase": self.phrase, "index": self.index}
        if self.event:
            out["ev"] = base64.b64encode(self.event).decode()
        return out | self.data

    @classmethod
    def parse(cls, data: dict[str, str]) -> SpeechEntry:
        rest = {k: v for k, v in data.items() if k not in ("n", "kind", "phrase", "index", "ev")}
        return cls(int(data.get("n", -1)), data.get("kind", ""), int(data.get("phrase", -1)),
                   int(data.get("index", -1)), base64.b64decode(data["ev"]) if "ev" in data else b"", rest)

    @property
    def key(self) -> tuple[str, int, int]:
        """What makes it unique in its turn: the client gets each of these once."""
        return self.kind, self.phrase, self.index


class TokenStreamTimeout(TimeoutError):
    """No new entry on a turn's log for the reader's timeout: no worker is writing it."""


Entry = TypeVar("Entry", TokenEntry, SpeechEntry)


def _token_dedupe() -> Callable[[TokenEntry], bool]:
    """True for an entry read the first time: one per seq (an end entry always passes)."""
    last_seq = -1

    def first(entry: TokenEntry) -> bool:
        nonlocal last_seq
        if not entry.end and entry.seq <= last_seq:
            return False
        last_seq = max(last_seq, entry.seq)
        return True

    return first


def _speech_dedupe() -> Callable[[SpeechEntry], bool]:
    """True for an entry read the first time: one per (kind, phrase, index)."""
    seen: set[tuple[str, int, int]] = set()

    def first(entry: SpeechEntry) -> bool:
        if entry.key in seen:
            return False
        seen.add(entry.key)
        return True

    return first


@dataclass(frozen=True)
class _Log(Generic[Entry]):
    """What the readers need to know of one kind of log."""

    what: str  # for the stall's message
    key: Callable[[str], str]  # turn id -> the stream's key
    parse: Callable[[dict[str, str]], Entry]
    is_end: Callable[[Entry], bool]
    dedupe: Callable[[], Callable[[Entry], bool]]  # a new "read for the first time?" test per read


_TOKEN_LOG: _Log[TokenEntry] = _Log("token", token_stream_key, TokenEntry.parse, lambda e: e.end, _token_dedupe)
_SPEECH_LOG: _Log[SpeechEntry] = _Log("speech", speech_stream_key, SpeechEntry.parse, lambda e: e.kind == "end",
                                      _speech_dedupe)


async def _tail(redis: aioredis.Redis, log: _Log[Entry], turn_id: str, timeout_s: float, start_id: str = "0-0"
                ) -> AsyncIterator[Entry]:
    """The one tail reader of a turn's log: from `start_id` until its end entry, each entry once;
    raise TokenStreamTimeout if no entry comes for `timeout_s`.

    Blocks in slices (`block_ms`), so a read cut by a Redis restart is resent by the client's
    retry from the last entry seen.
    """
    key, first = log.key(turn_id), log.dedupe()
    last_id = start_id
    stalled_at = time.monotonic() + timeout_s
    while (wait_s := stalled_at - time.monotonic()) > 0:
        reply = await redis.xread({key: last_id}, block=block_ms(redis, wait_s), count=64)
        if not reply:
            continue
        stalled_at = time.monotonic() + timeout_s
        for entry_id, data in reply[0][1]:
            last_id = entry_id
            if first(entry := log.parse(data)):
                yield entry
                if log.is_end(entry):
                    return
    raise TokenStreamTimeout(f"no {log.what} entry on {key} for {timeout_s:.1f} s")


def read_token_stream(redis: aioredis.Redis, turn_id: str, timeout_s: float, start_id: str = "0-0"
                      ) -> AsyncIterator[TokenEntry]:
    """Tail the turn's token log from `start_id` until its end entry, one entry per seq; raise if it stalls."""
    return _tail(redis, _TOKEN_LOG, turn_id, timeout_s, start_id)


def read_speech_stream(redis: aioredis.Redis, turn_id: str, timeout_s: float) -> AsyncIterator[SpeechEntry]:
    """Tail the turn's speech stream until its end entry, each (kind, phrase, index) once; raise if it stalls."""
    return _tail(redis, _SPEECH_LOG, turn_id, timeout_s)


async def read_token_log(redis: aioredis.Redis, turn_id: str) -> list[TokenEntry]:
    """The turn's token log as it stands, one entry per seq (the first of any repeat), through its end."""
    entries, first = [], _TOKEN_LOG.dedupe()
    for _, data in await redis.xrange(token_stream_key(turn_id)):
        if first(entry := TokenEntry.parse(data)):
            entries.append(entry)
            if entry.end:
                break
    return entries


async def read_speech_log(redis: aioredis.Redis, turn_id: str) -> list[SpeechEntry]:
    """The turn's speech stream as it stands (each (kind, phrase, index) once)."""
    first = _SPEECH_LOG.dedupe()
    return [entry for _, data in await redis.xrange(speech_stream_key(turn_id))
            if first(entry := SpeechEntry.parse(data))]
