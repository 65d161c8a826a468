"""Process-level wiring shared by the services: settings, logging and the Redis connection."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.redis_store import EmbeddedRedis, SessionStore, TurnStore, connect, default_data_dir, wait_for_redis
from services.settings import Settings

log = logging.getLogger(__name__)


def configure_logging(level: str = "INFO", fmt: str = "text", service: str = "") -> None:
    """Text, or JSON lines with the session and turn ids (`log_format`, services/server/logs.py)."""
    from services.server import logs

    logs.configure(level, fmt, service)


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


def start_embedded_redis(settings: Settings) -> EmbeddedRedis:
    """`specvox up`'s Valkey: its AOF in `redis.data_dir`, so sessions and token logs outlive it."""
    return EmbeddedRedis(data_dir=settings.redis.data_dir or default_data_dir()).start()


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
