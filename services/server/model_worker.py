"""A service's model behind one thread: its calls run one at a time, off the event loop, the one due
first going first."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelWorker:
    """One thread for a service's model: calls run one at a time, off the event loop.

    Waiting calls go earliest deadline first (Liu and Layland 1973): each says when its result
    is due (Unix seconds; by default, when it was made, so calls that say nothing run in
    order). The tts says when each piece's audio will be played, so a new turn's first phrase
    goes ahead of the later phrases of replies already playing.
    """

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._busy = False
        self._waiting: list[tuple[float, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    @property
    def busy(self) -> bool:
        """A call is running (others may be waiting)."""
        return self._busy

    async def call(self, fn: Callable[..., T], *args: Any, due_s: float | None = None) -> T:
        await self._take_turn(time.time() if due_s is None else due_s)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._pass_turn()

    async def iterate(self, iterator: Iterator[T], due_s: Callable[[], float] | None = None) -> AsyncIterator[T]:
        """Advance a blocking iterator in the worker thread, one item per call; `due_s`: each item's due time."""
        done = object()
        while (item := await self.call(next, iterator, done, due_s=due_s() if due_s else None)) is not done:
            yield item  # type: ignore[misc]

    async def _take_turn(self, due_s: float) -> None:
        if not self._busy:
            self._busy = True
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (due_s, next(self._arrivals), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # the turn had come: hand it on
                self._pass_turn()
            raise

    def _pass_turn(self) -> None:
        while self._waiting:
            turn = heapq.heappop(self._waiting)[2]
            if not turn.done():
                turn.set_result(None)
                return
        self._busy = False
