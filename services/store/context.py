"""A service's Redis, opened once at its start: the client, the session and turn stores on it, and
the private embedded Valkey started when no Redis URL is configured (stopped with it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from services.store.client import connect, wait_for_redis
from services.store.embedded import EmbeddedRedis
from services.store.sessions import SessionStore
from services.store.turn_log import TurnStore

if TYPE_CHECKING:
    from services.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class RedisContext:
    """A service's Redis: its client, the session and turn stores on it, and the embedded Valkey
    it started (stopped with it)."""

    client: aioredis.Redis
    sessions: SessionStore
    turns: TurnStore
    embedded: EmbeddedRedis | None = None

    async def close(self) -> None:
        await self.client.aclose()
        if self.embedded:
            self.embedded.stop()


async def open_redis(settings: Settings) -> RedisContext:
    """Connect to the configured Redis, or start a private embedded Valkey when none is configured.

    The private one (a service started alone) keeps its AOF in a temporary directory: it serves
    this process only, and a shared data directory would lock out the next service started so.
    """
    embedded = None
    url = settings.redis_url
    if not url:
        embedded = EmbeddedRedis().start()
        url = embedded.url
        log.warning("no SPECVOX_REDIS_URL: started an embedded Valkey at %s for this process alone",
                    embedded.display_url)
    client = connect(url, settings.redis)
    await wait_for_redis(client, settings.redis.startup_timeout_s)
    return RedisContext(
        client=client,
        sessions=SessionStore(client, settings.session_ttl_s),
        turns=TurnStore(client, settings.token_stream_ttl_s),
        embedded=embedded,
    )
