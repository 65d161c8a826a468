"""Sessions in Redis: a session's record (persona, config, owner) and its conversation history."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from pipeline.llm.prompts import Exchange
from services.store.client import now_ms
from services.store.keys import history_key, session_key


class UnknownSessionError(LookupError):
    pass


@dataclass
class SessionStore:
    redis: aioredis.Redis
    ttl_s: int = 24 * 3600

    async def create(self, system_prompt: str, config_json: str = "", owner: str = "") -> str:
        """A new session (its id 122 random bits: unguessable), belonging to `owner` (the tenant)."""
        session_id = uuid.uuid4().hex
        key = session_key(session_id)
        await self.redis.hset(key, mapping={"system_prompt": system_prompt, "config": config_json,
                                            "created_unix_ms": now_ms(), "owner": owner})
        await self.redis.expire(key, self.ttl_s)
        return session_id

    async def touch(self, session_id: str) -> None:
        """A session in use does not expire: each turn pushes its expiry `ttl_s` ahead."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(session_key(session_id), self.ttl_s)
            pipe.expire(history_key(session_id), self.ttl_s)
            await pipe.execute()

    async def require(self, session_id: str, owner: str | None = None) -> dict[str, str]:
        """The session; with `owner`, only if it belongs to that tenant: another tenant's session is
        answered as unknown, so a caller cannot tell it exists (tenant isolation)."""
        if not session_id:
            raise UnknownSessionError("no session id given: create one with Gateway.CreateSession")
        data = await self.redis.hgetall(session_key(session_id))
        if not data or (owner is not None and data.get("owner", "") != owner):
            raise UnknownSessionError(f"unknown session id {session_id!r}")
        return data

    async def history(self, session_id: str) -> tuple[Exchange, ...]:
        items = await self.redis.lrange(history_key(session_id), 0, -1)
        return tuple(Exchange(**json.loads(i)) for i in items)

    async def append(self, session_id: str, exchange: Exchange, keep: int = 20) -> None:
        key = history_key(session_id)
        await self.redis.rpush(key, _entry(exchange))
        await self.redis.ltrim(key, -keep, -1)
        await self.redis.expire(key, self.ttl_s)

    async def amend(self, session_id: str, old: Exchange | None, new: Exchange | None, keep: int = 20) -> None:
        """The latest entry equal to `old` becomes `new` (removed where `new` is None); with no `old`,
        `new` is appended. What the user heard of a reply, learnt after it was recorded (a Realtime
        client's truncate arrives after the interruption)."""
        if old is None:
            if new is not None:
                await self.append(session_id, new, keep)
            return
        key = history_key(session_id)
        entries = await self.redis.lrange(key, 0, -1)
        target = _entry(old)
        for index in range(len(entries) - 1, -1, -1):
            if entries[index] == target:
                if new is None:  # LREM takes a value, not an index: mark the entry, then remove the mark
                    await self.redis.lset(key, index, _REMOVED)
                    await self.redis.lrem(key, 1, _REMOVED)
                else:
                    await self.redis.lset(key, index, _entry(new))
                return


_REMOVED = "\x00removed"


def _entry(exchange: Exchange) -> str:
    return json.dumps({"user": exchange.user, "assistant": exchange.assistant, "cut_off": exchange.cut_off})
