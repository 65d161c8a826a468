"""Process-level wiring shared by the services: settings, logging and the Redis connection."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.redis_store import EmbeddedRedis, SessionStore, TurnStore, connect, wait_for_redis
from services.settings import Settings

log = logging.getLogger(__name__)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@dataclass
class RedisContext:
    client: aioredis.Redis
    sessions: SessionStore
    turns: TurnStore
    embedded: EmbeddedRedis | None = None

    async def close(self) -> None:
        await self.client.aclose()
        if self.embedded:
            self.embedded.stop()


async def open_redis(settings: Settings) -> RedisContext:
    """Connect to the configured Redis, or start an embedded Valkey when none is configured."""
    embedded = None
    url = settings.redis_url
    if not url:
        embedded = EmbeddedRedis().start()
        url = embedded.url
        log.warning("no SPECVOX_REDIS_URL: started an embedded Valkey at %s for this process alone", url)
    client = connect(url)
    await wait_for_redis(client)
    return RedisContext(
        client=client,
        sessions=SessionStore(client, settings.session_ttl_s),
        turns=TurnStore(client, settings.token_stream_ttl_s),
        embedded=embedded,
    )
