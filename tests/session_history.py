"""A session's history as the llm reads it from Valkey: what the e2e tests check a conversation recorded."""

from __future__ import annotations

from services.store.client import connect
from services.store.sessions import SessionStore


async def history(stack: dict[str, str], session_id: str):
    """The session's exchanges, oldest first, from the stack's Valkey (`stack["redis"]`)."""
    redis = connect(stack["redis"])
    try:
        return await SessionStore(redis).history(session_id)
    finally:
        await redis.aclose()
