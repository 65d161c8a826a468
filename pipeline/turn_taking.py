"""Turn-taking for a live conversation: events in, actions out, no I/O.

The gateway feeds `TurnTaking.handle` what happens (the VAD heard voice, a partial or final
transcript, an end-of-turn score, reply audio sent, a playback report, time passing) and
carries out the actions it returns (start, confirm or cancel a turn; tell the client to
pause, resume or drop the audio; record what the user heard; report the turn). Everything
that decides *when* lives here, so it is tested as plain Python with a fake clock.

The rules, in the terms of Pipecat's and LiveKit Agents' turn handling:

- **End of turn.** A final transcript (the VAD closed the utterance after a short silence)
  starts the reply at once but *held*: its output waits until the turn is confirmed, by an
  end-of-turn score of at least `end_of_turn_threshold` on the user's text (plainly
  complete), or, when the score says the user is mid-sentence, by `incomplete_wait_s` more
  silence; a turn of an opening alone ("Hello?", "Excuse me,": `openers`) always waits it.
  Speech before that cancels the held reply and its words begin the next turn, so a
  pause inside a sentence never cuts the user off. A stable partial at the first silence
  starts the held reply even sooner (preemption); a final that says something else drops it.
- **Interruption in two steps** (Kyutai's Unmute and LiveKit pause first, too): voice while
  the avatar is audible *pauses* playback at once; then the words decide. A backchannel
  ("yeah", "mm-hmm"), a final with no words, or one whose only words the asr is sure of ask
  for nothing (backchannel words, hums, a lone letter) *resumes*; anything else *interrupts*: the
  turn's queued audio is dropped, its work cancelled, and the history keeps only the words
  the user heard, marked as cut off. Voice that stops before it is speech (a cough, noise)
  resumes too.
- **Playback-true history.** Audio goes out ahead of playback, so a reply is over when it
  has been *heard*: by the client's playback reports or, without them, by real-time
  playout from the first chunk sent. Only then does the exchange enter the history.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.asr_stream import norm_word, normalised_text

DEFAULT_BACKCHANNELS = (
    "yeah", "yes", "yep", "yup", "mm", "mmm", "m", "mhm", "mm-hmm", "hm", "hmm", "uh-huh", "huh",
    "okay", "ok", "right", "sure", "alright", "i see", "got it", "cool", "nice", "wow", "oh", "ah",
    "uh", "um",
)
# Words a speaker opens with and then goes on ("Hello, … can you tell me", "Excuse me, … where
# is"): a turn of these alone waits `incomplete_wait_s` whatever its score. With a conversation
# before it the stage's model scores a lone "Hello?" as a whole message (0.056 after three
# exchanges, above "Yes." at 0.034), so the score alone cut the user off at such a pause
# (docs/benchmarks/history.md, "Live conversations end to end").
DEFAULT_OPENERS = (
    "hello", "hi", "hey", "hello there", "hi there", "hey there", "excuse me", "so", "well", "um", "uh",
    "listen", "i have a question", "quick question", "one question",
)
# Whisper's spellings of a hum ("Mmmmm", "mm-m-m", "N M M", "hmmm"): letters m, n and h alone.
MURMUR = re.compile(r"[mnh]+")
HEARD_WORD_SLACK_S = 0.05  # a word counts as heard once playback passed its end, less this
REQUESTED_UTTERANCE = -1  # the utterance of a turn the client asked for (ReplyRequested): none of the asr's


@dataclass(frozen=True)
class TurnTakingOptions:
    # A text end-of-turn score at least this confirms a turn at once; lower waits for more
    # silence. 0: every final ends the turn (silence alone decides). 0.01 (lower-marks) and 0.7 s
    # cut off 0 of 50 in-sentence pauses (bundled and espeak-ng voices) where silence alone cut
    # off 44 of 50 (docs/benchmarks/history.md, "End of turn").
    end_of_turn_threshold: float = 0.01
    incomplete_wait_s: float = 0.7  # more silence after a low-scored final before it is the turn's end
    backchannels: tuple[str, ...] = DEFAULT_BACKCHANNELS
    backchannel_max_words: int = 3
    openers: tuple[str, ...] = DEFAULT_OPENERS  # a turn of one of these alone is never plainly complete
    # Over the avatar, only words the asr is at least this sure of can take the floor; the rest
    # count as noise. Whisper tiny turns a murmured "mm-hmm" into "And" (p 0.43) or "mm in a
    # moment" (0.00, 0.30, 0.71, 0.39), while a real "Stop." or "Hold on." came at 0.52-0.94 on
    # both test voices (docs/benchmarks/history.md, "Live conversations end to end").
    min_interrupt_confidence: float = 0.45
    pause_max_s: float = 3.0  # a pause the words never decided ends in a resume
    audio_lead_s: float = 1.0  # reply audio sent ahead of playback, at most
    # Off, a final takes no turn: its words wait for the client to ask for a reply (ReplyRequested; the
    # Realtime API's turn_detection.create_response false).
    start_turns: bool = True
    # Off, speech over the avatar neither pauses nor interrupts it: its words wait for the next reply (the
    # Realtime API's turn_detection.interrupt_response false).
    interruptions: bool = True


# ---- events -------------------------------------------------------------------------------

@dataclass(frozen=True)
class VoiceStarted:
    """The VAD heard voice: maybe speech, maybe a cough."""


@dataclass(frozen=True)
class VoiceEnded:
    """The voice stopped before it became speech."""


@dataclass(frozen=True)
class SpeechStarted:
    utterance: int


@dataclass(frozen=True)
class Partial:
    utterance: int
    text: str
    stable_ending: bool  # silence begun: the pass the final reuses, so the final will likely match


@dataclass(frozen=True)
class Final:
    utterance: int
    text: str
    # The asr's probability of each of its words, in order, as (word, probability); empty: not
    # known, and every word counts as sure.
    word_probabilities: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class EndOfTurnScored:
    turn_id: str
    probability: float


@dataclass(frozen=True)
class AudioSent:
    """Reply audio up to `end_s` of the turn's timeline went to the client."""

    turn_id: str
    end_s: float


@dataclass(frozen=True)
class WordTimed:
    """One reply word, as written, placed on the turn's audio timeline."""

    turn_id: str
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class ReplyDone:
    """llm and tts are done with the turn: all of its audio exists."""

    turn_id: str
    finish_reason: str


@dataclass(frozen=True)
class PlaybackReported:
    turn_id: str
    played_until_s: float


@dataclass(frozen=True)
class Tick:
    """Time passed (timers: held turns, playout, pauses)."""


@dataclass(frozen=True)
class CaptionDone:
    """Caption mode: the caption of turn `turn_id` went out, or its work failed (`finish_reason`)."""

    turn_id: str
    finish_reason: str


@dataclass(frozen=True)
class ClientDone:
    """The client closed its side: it will play what it has; nothing more is said."""


@dataclass(frozen=True)
class UserSaid:
    """Words the user gave outside the machine's own voice turns (typed, or speech the client committed
    with turn detection off): the next reply answers them, after any unanswered words before them."""

    text: str


@dataclass(frozen=True)
class ReplyRequested:
    """The client asks for a reply now (the Realtime API's `response.create`): a turn starts confirmed,
    answering the unanswered words; a reply still playing is interrupted first, one not heard yet dropped."""


@dataclass(frozen=True)
class ReplyCancelled:
    """The client stopped the current reply (`response.cancel`, or a truncate of the playing one): it
    is over as an interruption is, the history keeping what was heard by then."""


Event = (VoiceStarted | VoiceEnded | SpeechStarted | Partial | Final | EndOfTurnScored | AudioSent
         | WordTimed | ReplyDone | PlaybackReported | Tick | CaptionDone | ClientDone | UserSaid | ReplyRequested
         | ReplyCancelled)


# ---- actions ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StartTurn:
    """Start writing and speaking a reply to `user_text`; its output is held until confirmed."""

    turn_id: str
    utterance: int
    user_text: str
    preemptive: bool  # started from a partial, before the final


@dataclass(frozen=True)
class ScoreEndOfTurn:
    turn_id: str
    user_text: str


@dataclass(frozen=True)
class ConfirmTurn:
    """The user's turn is over: the held reply's output may go out."""

    turn_id: str


@dataclass(frozen=True)
class AnnounceFinal:
    """Send the final transcript of `utterance` to the client, as part of `turn_id`."""

    turn_id: str
    utterance: int


@dataclass(frozen=True)
class CancelTurn:
    turn_id: str


@dataclass(frozen=True)
class PausePlayback:
    turn_id: str
    at_s: float


@dataclass(frozen=True)
class ResumePlayback:
    turn_id: str
    from_s: float
    reason: str  # "backchannel" or "noise"


@dataclass(frozen=True)
class InterruptPlayback:
    turn_id: str
    heard_until_s: float
    heard_text: str


@dataclass(frozen=True)
class RecordExchange:
    """The history gets what the user said and what of the reply they heard."""

    user_text: str
    heard_text: str
    cut_off: bool


@dataclass(frozen=True)
class TurnOver:
    """The turn is finished: report it. Counts are this turn's and the conversation's."""

    turn_id: str
    finish_reason: str  # the reply's ("eos", "length", …), "interrupted" or "cancelled"
    heard_text: str
    cut_off: bool
    preemption: str  # "", "kept" or "dropped"
    end_of_turn_probability: float  # -1: not scored
    pauses: int
    resumes: int
    interrupts: int
    counts: ConversationCounts


@dataclass(frozen=True)
class StartCaption:
    """Caption mode: clean up this utterance's transcript as a caption."""

    turn_id: str
    utterance: int
    text: str


Action = (StartTurn | ScoreEndOfTurn | ConfirmTurn | AnnounceFinal | CancelTurn | PausePlayback
          | ResumePlayback | InterruptPlayback | RecordExchange | TurnOver | StartCaption)


# ---- state --------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConversationCounts:
    pauses: int = 0
    resumes: int = 0
    interrupts: int = 0
    preemptions_kept: int = 0
    preemptions_dropped: int = 0


class PlaybackClock:
    """Where the client is in a turn's audio: its last report, else real-time playout from
    the first chunk sent; never past the audio it has; frozen while paused."""

    def __init__(self, started_s: float) -> None:
        self._anchor_s = started_s  # wall time at which playback was at _anchor_pos_s
        self._anchor_pos_s = 0.0
        self.paused = False
        self.sent_until_s = 0.0

    def position(self, now_s: float) -> float:
        moving = 0.0 if self.paused else max(0.0, now_s - self._anchor_s)
        return min(self._anchor_pos_s + moving, self.sent_until_s)

    def report(self, played_until_s: float, now_s: float) -> None:
        self._anchor_pos_s, self._anchor_s = min(max(0.0, played_until_s), self.sent_until_s), now_s

    def pause(self, now_s: float) -> float:
        self.report(self.position(now_s), now_s)
        self.paused = True
        return self._anchor_pos_s

    def resume(self, now_s: float) -> float:
        self._anchor_s, self.paused = now_s, False
        return self._anchor_pos_s


@dataclass
class _Turn:
    turn_id: str
    utterance: int
    text: str  # this utterance's words
    user_text: str  # what the reply answers: words the user said before it went unanswered, then `text`
    confirmed: bool = False
    final_seen: bool = False  # the utterance's final arrived (a preemptive turn waits for it)
    final_s: float = 0.0
    score: float = -1.0
    preemption: str = ""
    playback: PlaybackClock | None = None  # from the first audio sent
    words: list[WordTimed] = field(default_factory=list)
    done_reason: str = ""  # set once llm and tts are done
    pauses: int = 0
    resumes: int = 0
    interrupts: int = 0

    @property
    def audio_sent(self) -> bool:
        return self.playback is not None

    def heard(self, until_s: float) -> str:
        return heard_text(self.words, until_s)


class TurnTaking:
    """The state machine of one conversation; `handle(event, now_s)` returns the actions."""

    def __init__(self, options: TurnTakingOptions = TurnTakingOptions(), caption_mode: bool = False,
                 new_turn_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.options = options
        self.caption_mode = caption_mode
        self._new_id = new_turn_id
        self.turn: _Turn | None = None  # the turn being written, spoken or heard
        self.unanswered = ""  # the user's words since the last reply they heard
        self.paused_since_s: float | None = None  # the avatar was spoken over: playback paused
        self.voice_active = False  # the VAD hears voice that no final has closed yet
        self.client_done = False
        self.counts = ConversationCounts()
        self.captions: set[str] = set()  # caption turns started and not yet over
        phrases = [normalised_text(b.replace("-", " ")) for b in options.backchannels]
        self._backchannel_phrases = {p.replace(" ", "") for p in phrases if p}
        self._backchannel_words = {w for p in phrases for w in p.split()}
        # Each opener, and those of three words or more with one word left out: whisper tiny drops
        # a short word at a pause ("I have a question," heard as "I a question.", then cut off).
        self._openers = {"".join(words) for o in options.openers
                         for words in _with_one_word_dropped(_words(o))} - {""}

    # -- queries the gateway asks --------------------------------------------------------

    def audible(self, now_s: float) -> bool:
        """The user hears (or would hear, were it not paused) the current turn's audio."""
        t = self.turn
        if t is None or t.playback is None:
            return False
        return not (t.done_reason and t.playback.position(now_s) >= t.playback.sent_until_s)

    def may_send_until_s(self, turn_id: str, now_s: float) -> float:
        """Reply audio starting before this may go out now (`audio_lead_s` ahead of playback)."""
        t = self.turn
        if t is None or t.turn_id != turn_id or not t.confirmed:
            return -1.0
        if self.client_done:
            return float("inf")
        if t.playback is None:
            return self.options.audio_lead_s
        if t.playback.paused:
            return -1.0
        return t.playback.position(now_s) + self.options.audio_lead_s

    def position_s(self, turn_id: str, now_s: float) -> float:
        t = self.turn
        return t.playback.position(now_s) if t and t.turn_id == turn_id and t.playback else 0.0

    # -- the machine ---------------------------------------------------------------------

    def handle(self, event: Event, now_s: float) -> list[Action]:
        handler = getattr(self, f"_on_{type(event).__name__}")
        actions: list[Action] = handler(event, now_s)
        return actions + self._timers(now_s)

    def _on_VoiceStarted(self, event: VoiceStarted, now_s: float) -> list[Action]:  # noqa: N802
        self.voice_active = True
        return self._pause(now_s)

    def _on_VoiceEnded(self, event: VoiceEnded, now_s: float) -> list[Action]:  # noqa: N802
        self.voice_active = False
        return self._resume(now_s, "noise")

    def _on_SpeechStarted(self, event: SpeechStarted, now_s: float) -> list[Action]:  # noqa: N802
        if self.caption_mode:
            return []
        actions = self._pause(now_s)  # where the asr sent no voice event first
        t = self.turn
        held = t is not None and (self.options.interruptions or t.utterance != REQUESTED_UTTERANCE)
        if t and held and not t.audio_sent:  # nothing heard yet: the user was pausing, not done
            self.unanswered = t.user_text
            actions += self._end(t, "cancelled", now_s)
        return actions

    def _on_Partial(self, event: Partial, now_s: float) -> list[Action]:  # noqa: N802
        if self.caption_mode:
            return []
        if self.paused_since_s is not None or self.audible(now_s):
            # A partial interrupts only when it is plainly more than a backchannel; a short one
            # (often whisper's guess at a murmur) waits for the final to decide.
            if self.options.interruptions and _distinct_words(_words(event.text)) > self.options.backchannel_max_words:
                return self._interrupt(now_s)
            return []
        t = self.turn
        if not event.stable_ending or not event.text.strip() or not self.options.start_turns:
            return []
        if t and (t.utterance == event.utterance or not t.audio_sent):
            return []  # this utterance has its early turn already, or a reply is about to speak
        return self._start(event.utterance, event.text, now_s, preemptive=True)

    def _on_Final(self, event: Final, now_s: float) -> list[Action]:  # noqa: N802
        self.voice_active = False
        text = event.text.strip()
        if self.caption_mode:
            if not text:
                return []
            caption = StartCaption(self._new_id(), event.utterance, text)
            self.captions.add(caption.turn_id)
            return [caption]
        actions: list[Action] = []
        if not self.options.interruptions and self.audible(now_s):  # said over the avatar: for the next reply
            return self._on_UserSaid(UserSaid(text), now_s)
        if self.paused_since_s is not None or self.audible(now_s):  # said over the avatar
            # (Not paused, too: voice in two short bursts can end each one's pause before the
            # utterance they make up is transcribed.)
            if text and self._backchannel(text):  # whisper prompted with them may be unsure of one
                return self._resume(now_s, "backchannel")
            sure = self._sure_words(event)
            if not sure:
                return self._resume(now_s, "noise")
            if self._no_floor_taken(sure):
                return self._resume(now_s, "backchannel")
            actions += self._interrupt(now_s)
        t = self.turn
        if t and t.utterance == event.utterance and not t.final_seen and not t.audio_sent:
            if text and normalised_text(text) == normalised_text(t.text):
                t.final_seen, t.final_s, t.preemption = True, now_s, "kept"
                self.counts = _add(self.counts, preemptions_kept=1)
                return [*actions, AnnounceFinal(t.turn_id, event.utterance)]
            t.preemption = "dropped"
            self.counts = _add(self.counts, preemptions_dropped=1)
            actions += self._end(t, "cancelled", now_s)
        if not text:
            return actions
        if not self.options.start_turns:  # the client asks for the reply
            return actions + self._on_UserSaid(UserSaid(text), now_s)
        if self.turn and not self.turn.audio_sent:
            self.unanswered = self.turn.user_text
            actions += self._end(self.turn, "cancelled", now_s)
        actions += self._start(event.utterance, text, now_s, preemptive=False)
        return actions

    def _on_EndOfTurnScored(self, event: EndOfTurnScored, now_s: float) -> list[Action]:  # noqa: N802
        t = self.turn
        if t and t.turn_id == event.turn_id:
            t.score = event.probability
        return []

    def _on_AudioSent(self, event: AudioSent, now_s: float) -> list[Action]:  # noqa: N802
        t = self.turn
        if t and t.turn_id == event.turn_id:
            if t.playback is None:
                t.playback = PlaybackClock(now_s)
                self.unanswered = ""  # the user hears a reply to what they said
            t.playback.sent_until_s = max(t.playback.sent_until_s, event.end_s)
        return []

    def _on_WordTimed(self, event: WordTimed, now_s: float) -> list[Action]:  # noqa: N802
        if self.turn and self.turn.turn_id == event.turn_id:
            self.turn.words.append(event)
        return []

    def _on_ReplyDone(self, event: ReplyDone, now_s: float) -> list[Action]:  # noqa: N802
        t = self.turn
        if t and t.turn_id == event.turn_id and not t.done_reason:
            t.done_reason = event.finish_reason or "eos"
        return []

    def _on_PlaybackReported(self, event: PlaybackReported, now_s: float) -> list[Action]:  # noqa: N802
        t = self.turn
        if t and t.turn_id == event.turn_id and t.playback:
            t.playback.report(event.played_until_s, now_s)
        return []

    def _on_Tick(self, event: Tick, now_s: float) -> list[Action]:  # noqa: N802
        return []

    def _on_CaptionDone(self, event: CaptionDone, now_s: float) -> list[Action]:  # noqa: N802
        if event.turn_id not in self.captions:
            return []
        self.captions.discard(event.turn_id)
        return [TurnOver(event.turn_id, event.finish_reason or "eos", "", False, "", -1.0, 0, 0, 0, self.counts)]

    def _on_ClientDone(self, event: ClientDone, now_s: float) -> list[Action]:  # noqa: N802
        self.client_done = True
        return self._resume(now_s, "noise")

    def _on_UserSaid(self, event: UserSaid, now_s: float) -> list[Action]:  # noqa: N802
        self.unanswered = " ".join(x for x in (self.unanswered, event.text.strip()) if x)
        return []

    def _on_ReplyRequested(self, event: ReplyRequested, now_s: float) -> list[Action]:  # noqa: N802
        if self.caption_mode:
            return []
        actions = self._drop_current(now_s)
        turn = _Turn(self._new_id(), REQUESTED_UTTERANCE, "", self.unanswered, confirmed=True, final_seen=True,
                     final_s=now_s)
        self.turn = turn
        return [*actions, StartTurn(turn.turn_id, turn.utterance, turn.user_text, False), ConfirmTurn(turn.turn_id)]

    def _on_ReplyCancelled(self, event: ReplyCancelled, now_s: float) -> list[Action]:  # noqa: N802
        return self._drop_current(now_s)

    # -- steps ---------------------------------------------------------------------------

    def _timers(self, now_s: float) -> list[Action]:
        """What time alone decides: confirming a held turn, a heard reply, a pause gone stale."""
        actions: list[Action] = []
        t = self.turn
        if t and not t.confirmed and t.final_seen:
            o = self.options
            complete = o.end_of_turn_threshold <= 0 or (t.score >= o.end_of_turn_threshold
                                                        and not self._opener(t.user_text))
            # The wait after a low score ends in silence: voice heard again (speech begins 200 ms
            # into it, so SpeechStarted may not be here yet) holds the turn until it is decided.
            waited = now_s - t.final_s >= o.incomplete_wait_s and not self.voice_active
            if complete or waited:
                t.confirmed = True
                actions.append(ConfirmTurn(t.turn_id))
        if self.paused_since_s is not None and now_s - self.paused_since_s >= self.options.pause_max_s:
            actions += self._resume(now_s, "noise")
        t = self.turn
        if t and t.done_reason and self.paused_since_s is None:
            if not t.audio_sent:
                if t.confirmed or self.client_done:  # a reply with nothing to say, or never confirmed
                    actions += self._end(t, t.done_reason, now_s)
            elif self.client_done or t.playback and t.playback.position(now_s) >= t.playback.sent_until_s:
                heard = t.heard(float("inf"))
                actions.append(RecordExchange(t.user_text, heard, cut_off=False))
                actions += self._end(t, t.done_reason, now_s, heard_text=heard)
        return actions

    def _start(self, utterance: int, text: str, now_s: float, preemptive: bool) -> list[Action]:
        user_text = " ".join(x for x in (self.unanswered, text) if x)
        turn = _Turn(self._new_id(), utterance, text, user_text, final_seen=not preemptive, final_s=now_s)
        actions: list[Action] = []
        if self.turn is not None:  # a reply still heard while a new turn starts: it is over now
            actions += self._interrupt(now_s)
        self.turn = turn
        actions += [StartTurn(turn.turn_id, utterance, user_text, preemptive),
                    ScoreEndOfTurn(turn.turn_id, user_text)]
        if not preemptive:
            actions.append(AnnounceFinal(turn.turn_id, utterance))
        return actions

    def _pause(self, now_s: float) -> list[Action]:
        t = self.turn
        if (not self.options.interruptions or self.caption_mode or self.paused_since_s is not None or t is None
                or not self.audible(now_s)):
            return []
        assert t.playback is not None
        self.paused_since_s = now_s
        t.pauses += 1
        self.counts = _add(self.counts, pauses=1)
        return [PausePlayback(t.turn_id, t.playback.pause(now_s))]

    def _resume(self, now_s: float, reason: str) -> list[Action]:
        t = self.turn
        if self.paused_since_s is None or t is None or t.playback is None:
            return []
        self.paused_since_s = None
        t.resumes += 1
        self.counts = _add(self.counts, resumes=1)
        return [ResumePlayback(t.turn_id, t.playback.resume(now_s), reason)]

    def _drop_current(self, now_s: float) -> list[Action]:
        """The current reply ends at the client's word: interrupted where heard, else cancelled (its
        user's words still unanswered)."""
        t = self.turn
        if t is None:
            return []
        if t.audio_sent:
            return self._interrupt(now_s)
        self.unanswered = t.user_text
        return self._end(t, "cancelled", now_s)

    def _interrupt(self, now_s: float) -> list[Action]:
        """The user took the turn: drop the reply's audio; the history keeps what was heard."""
        t = self.turn
        self.paused_since_s = None
        if t is None or t.playback is None:
            return []
        heard_until = t.playback.pause(now_s)
        heard = t.heard(heard_until)
        t.interrupts += 1
        self.counts = _add(self.counts, interrupts=1)
        actions: list[Action] = [InterruptPlayback(t.turn_id, heard_until, heard)]
        if heard:
            actions.append(RecordExchange(t.user_text, heard, cut_off=True))
        else:  # nothing of it was heard: what the user said is still unanswered
            self.unanswered = t.user_text
        return actions + self._end(t, "interrupted", now_s, heard_text=heard, cut_off=bool(heard))

    def _end(self, t: _Turn, reason: str, now_s: float, heard_text: str = "", cut_off: bool = False) -> list[Action]:
        if self.turn is t:
            self.turn = None
            self.paused_since_s = None
        actions: list[Action] = [] if t.done_reason else [CancelTurn(t.turn_id)]
        return [*actions, TurnOver(t.turn_id, reason, heard_text, cut_off, t.preemption, t.score, t.pauses,
                                   t.resumes, t.interrupts, self.counts)]

    def _opener(self, text: str) -> bool:
        """Only an opening ("Hello?", "Hey there,"), said once or repeated as whisper repeats it."""
        words = _words(text)
        once = [w for i, w in enumerate(words) if i == 0 or w != words[i - 1]]
        return bool(once) and "".join(once) in self._openers

    def _backchannel(self, text: str) -> bool:
        """Only words of the backchannel list, and few of them."""
        words = _words(text)
        if not words:
            return False
        if _distinct_words(words) > self.options.backchannel_max_words:
            return False
        return "".join(words) in self._backchannel_phrases or all(
            w in self._backchannel_words or MURMUR.fullmatch(w) for w in words)


    def _sure_words(self, event: Final) -> list[str]:
        """The final's words (as `_words` splits them) the asr is sure enough of to take the floor."""
        if not event.word_probabilities:
            return _words(event.text)
        least = self.options.min_interrupt_confidence
        return [w for word, p in event.word_probabilities if p >= least for w in _words(word)]

    def _no_floor_taken(self, sure: list[str]) -> bool:
        """Sure words that ask for nothing: few, and each a backchannel word, a hum or a lone
        letter (the "a" of "mm in a moment", whisper's guess at a murmur)."""
        return _distinct_words(sure) <= self.options.backchannel_max_words and all(
            w in self._backchannel_words or MURMUR.fullmatch(w) or len(w) == 1 for w in sure)


def heard_text(words: list[WordTimed], until_s: float) -> str:
    """The reply's words heard when playback reached `until_s`."""
    return " ".join(w.text for w in words if w.end_s - HEARD_WORD_SLACK_S <= until_s)


def _distinct_words(words: list[str]) -> int:
    """Whisper tends to repeat a short sound ("yeah yeah yeah yeah yeah" for one "Yeah.", "Mm-hmm.
    Mm-hm. Mm-m" for one "Mm-hmm."): the words count once each, and its hum spellings as one."""
    return len({"m" if MURMUR.fullmatch(w) else w for w in words})


def _with_one_word_dropped(words: list[str]) -> list[list[str]]:
    """`words`, and where they are three or more, each of them less one word."""
    return [words, *([words[:i] + words[i + 1:] for i in range(len(words))] if len(words) >= 3 else [])]


def _words(text: str) -> list[str]:
    return [w for w in (norm_word(x) for x in text.replace("-", " ").split()) if w]


def _add(counts: ConversationCounts, **more: int) -> ConversationCounts:
    return ConversationCounts(**{k: v + more.get(k, 0) for k, v in vars(counts).items()})

