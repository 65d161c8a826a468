"""When a stage received and emitted its items: the times each stage reports for a turn."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from services.store.client import now_ms

T = TypeVar("T")


@dataclass
class StageClock:
    """When a stage received and emitted its first and last item (Unix ms)."""

    stage: str
    first_in_unix_ms: int = 0
    last_in_unix_ms: int = 0
    first_out_unix_ms: int = 0
    last_out_unix_ms: int = 0

    def received(self) -> None:
        t = now_ms()
        self.first_in_unix_ms = self.first_in_unix_ms or t
        self.last_in_unix_ms = t

    def emitted(self) -> None:
        t = now_ms()
        self.first_out_unix_ms = self.first_out_unix_ms or t
        self.last_out_unix_ms = t

    def to_proto(self, message_type: Callable[..., T]) -> T:
        return message_type(**vars(self))
