"""The narrow ports a `Conversation` is driven through, so any transport drives the same object.

A conversation needs four things from outside: an ASR stream (the user's audio in, transcript
events out), a turn runner (a turn's llm and tts work started and read back, the session's
history and the llm's side calls), an event sink (what the client is to get, in order) and a
clock. services/gateway/stages.py implements the first two over gRPC and Redis; a transport
(the gRPC `Converse` in service.py, the Realtime WebSocket in realtime.py) supplies the sink;
tests/unit/test_conversation_ports.py wires in-memory fakes and pushes events through in virtual time.
A protocol whose client drives turns itself (the Realtime API) also sends the requests below
(typed words, commits, reply requests and cancels, heard positions), and may ask for speech notices.

Payloads are the project's wire messages (asr's TranscriptEvent, tts's SpeechEvent, the
gateway's ServerEvent): they are the stages' shared vocabulary, and a transport that speaks
another protocol converts from the gateway's ServerEvent (services/gateway/convert.py holds
every conversion that the conversation itself needs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.llm.prompts import Exchange
from pipeline.turn_taking import PlaybackReported, TurnTakingOptions


class TurnFailed(Exception):
    """A turn's work failed and the conversation goes on: a stage ended its log with an error, the
    log stalled (no worker took the turn), or the store stayed out of reach. The message starts
    with the status a client would see ("DEADLINE_EXCEEDED: ...")."""


class AsrStreamClosed(Exception):  # noqa: N818 - a signal
    """The ASR stream ended (its status comes from iterating it); nothing more can be written."""


@dataclass(frozen=True)
class ClientAudio:
    """Input audio in the stream's declared format."""

    data: bytes


@dataclass(frozen=True)
class UserText:
    """Words the user typed (a Realtime text item): the next reply answers them."""

    text: str


@dataclass(frozen=True)
class CommitAudio:
    """Turn detection off: the user's speech so far is a turn's words (the Realtime API's
    `input_audio_buffer.commit`); an utterance still open is waited for, briefly."""


@dataclass(frozen=True)
class ClearAudio:
    """Turn detection off: the user's speech not yet committed is dropped."""


@dataclass(frozen=True)
class RequestReply:
    """Answer now (`response.create`), whatever the turn detection; `instructions`: this reply's system
    prompt (the Realtime API's `response.instructions`), empty for the session's."""

    instructions: str = ""


@dataclass(frozen=True)
class CancelReply:
    """Stop the current reply (`response.cancel`)."""


@dataclass(frozen=True)
class HeardUntil:
    """The client played turn `turn_id` up to `heard_until_s` of its timeline and stopped there (the
    Realtime API's `conversation.item.truncate`): a reply still playing ends there; one already over has
    its exchange in the history amended to the words heard by then."""

    turn_id: str
    heard_until_s: float


@dataclass(frozen=True)
class Reconfigure:
    """The session's config changed mid-stream (`session.update`): later turns use it. `turn_taking`
    is the base of the machine's options (the config's backchannels go over it); `auto_turns` off: the
    asr's voice and finals take no turn, only CommitAudio and RequestReply do."""

    config: Any  # a resolved gateway SessionConfig
    turn_taking: TurnTakingOptions
    auto_turns: bool = True


# The client's input: audio, a report of where its playback of a turn's audio is (the machine's own
# event, handed to it as it is), or one of the requests a protocol with client-driven turns makes.
ClientInput = (ClientAudio | PlaybackReported | UserText | CommitAudio | ClearAudio | RequestReply | CancelReply
               | HeardUntil | Reconfigure)


@dataclass(frozen=True)
class UserSpeech:
    """What the asr heard of the user's voice, for a transport whose protocol reports it (the Realtime
    API's `speech_started` / `speech_stopped`): given to the sink only when the conversation's
    `speech_notices` is on; no gRPC ServerEvent."""

    utterance: int
    started: bool  # speech began; else the utterance closed (its final)
    audio_s: float  # where, in the input audio's timeline
    text: str = ""  # the final's


@dataclass(frozen=True)
class TurnStarted:
    """A turn's reply began (with `speech_notices`): `requested` where a RequestReply asked for it, so a
    transport can tie the reply to the request."""

    turn_id: str
    requested: bool


@dataclass(frozen=True)
class InputCommitted:
    """Turn detection off: a CommitAudio took these words (maybe none) as the user's turn; with `speech_notices`."""

    text: str


@dataclass(frozen=True)
class ReplyPiece:
    """One entry of a turn's token log (one verify step's accepted tokens), each seq once."""

    text: str
    accepted: int
    first: bool = False  # the log's first entry: it says how much of the prompt was cached
    cached_tokens: int = 0
    end: bool = False
    finish_reason: str = ""
    times: Any = None  # common.StageTimes of the llm, on the end entry
    error: str = ""  # the end entry of a failed turn


@dataclass(frozen=True)
class SpeechEnd:
    """The turn's speech stream ended."""

    finish_reason: str = ""
    error: str = ""


class AsrStream(Protocol):
    """One open recognition stream for the conversation's audio."""

    async def send_audio(self, chunk: bytes) -> None:
        """Raises AsrStreamClosed once the stream has ended."""

    async def expect_phrases(self, phrases: tuple[str, ...]) -> None:
        """Prompt the recogniser with phrases the user may say next (empty: none)."""

    async def finish(self) -> None:
        """No more audio: the stream's last events follow."""

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Any]:
        """The transcript events (asr TranscriptEvent); raises the stream's error, if it failed."""


class TurnRunner(Protocol):
    """One session's turns: their records, their llm and tts work, what comes back, the history."""

    async def open(self, turn_id: str) -> None:
        """The turn's record, before any work on it; raises LimitExceededError past the session's turns."""

    async def start_reply(self, turn_id: str, request: Any) -> None:
        """Queue the llm's work (an llm ReplyRequest) on the turn."""

    async def start_speech(self, turn_id: str, request: Any) -> None:
        """Queue the tts's work (a tts SpeakTurnRequest) on the turn."""

    def reply(self, turn_id: str) -> AsyncIterator[ReplyPiece]:
        """The turn's token log, each entry once, to its end entry; raises TurnFailed."""

    def speech(self, turn_id: str) -> AsyncIterator[Any]:
        """The turn's speech (tts SpeechEvent), each item once, then a SpeechEnd; raises TurnFailed."""

    async def cancel(self, turn_id: str, reply_started: bool) -> None:
        """Tell the turn's workers it is cancelled; a reply never started has its log ended here."""

    async def record(self, exchange: Exchange) -> None:
        """Append what the user said and heard to the session's history."""

    async def prepare(self, user_text: str) -> None:
        """Ask the llm to prefill the conversation (and the words heard so far); failures cost only time."""

    async def end_of_turn(self, user_text: str) -> float:
        """The probability that `user_text` is a finished turn (1.0 when it cannot be scored)."""

    def configure(self, config: Any) -> None:
        """Later turns and side calls use this session config (a Reconfigure)."""

    async def amend(self, old: Exchange | None, new: Exchange | None) -> None:
        """Replace the session history's latest `old` exchange by `new` (None: none recorded / remove it)."""


class EventSink(Protocol):
    """Where the conversation's events wait for the client, in order (a bounded queue)."""

    async def put(self, item: Any) -> None: ...

    def put_nowait(self, item: Any) -> None: ...

    async def get(self) -> Any: ...

    def failure(self) -> BaseException | None:
        """Set once the sink stopped taking events (a client too slow to read): the conversation ends with it."""


class Clock(Protocol):
    def now_s(self) -> float:
        """Monotonic seconds: the turn-taking machine's time."""

    def unix_ms(self) -> int:
        """Wall time in Unix milliseconds: when things happened, for reports and budgets."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now_s(self) -> float:
        return time.monotonic() - self._t0

    def unix_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
