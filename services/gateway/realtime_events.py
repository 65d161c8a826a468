"""The OpenAI Realtime API's events ↔ one specvox conversation: a converter, no I/O.

Client events become the conversation's inputs (services/gateway/ports.py: audio, typed words,
commits, response requests, cancels, truncates as heard positions, session changes); the
conversation's events (gateway ServerEvents and its speech notices) become Realtime server events,
in the GA dialect's names or the beta's. services/gateway/realtime.py carries them over the WebSocket;
tests drive this class as plain Python.

How a specvox turn reads as a Realtime response (docs/protocols.md, "OpenAI Realtime API"):
- The user's utterance is an item: `speech_started` when the asr hears speech begin, then at its final
  `speech_stopped`, `committed`, the item and its transcript. Speech over a reply that is playing
  starts nothing yet: specvox pauses and lets the words decide. If they interrupt, `speech_started`
  goes out then and the response ends `cancelled` / `turn_detected`; a backchannel or a cough
  resumes the reply, and a strict client never hears of it (`specvox.playback.*` tells those who ask).
- A reply is a response with one assistant item: created when its first text or audio is ready, done
  when the turn is over (heard, interrupted or cancelled), so a barge-in during the last second of
  playback still cancels it.
- `conversation.item.truncate` says where the client stopped playing: the history keeps the words
  heard by then, also when it comes after the interruption (the usual order).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import json_format

from pipeline import g711
from pipeline.audio import StreamResampler, float_to_pcm16, resample
from services.gateway import realtime_session as rs
from services.gateway.ports import (
    CancelReply,
    ClearAudio,
    ClientAudio,
    ClientInput,
    CommitAudio,
    HeardUntil,
    InputCommitted,
    Reconfigure,
    RequestReply,
    TurnStarted,
    UserSpeech,
    UserText,
)
from services.gateway.realtime_session import PCM, PCMA, PCMU, RealtimeError, RealtimeSession

# GA name → beta name, where they differ
BETA_NAMES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
}
BETA_ONLY_GA = {"conversation.item.done"}  # GA events the beta dialect does not have
KEPT_ITEMS = 256  # items a connection remembers for retrieve, delete and truncate
LAW: dict[str, g711.Law] = {PCMU: "mulaw", PCMA: "alaw"}
FINISHED = {"eos": ("completed", None), "stop": ("completed", None), "length": ("incomplete", "max_output_tokens")}


@dataclass
class Response:
    """One reply of specvox's as a Realtime response with its one assistant item."""

    response_id: str
    item_id: str
    metadata: Any = None
    requested: bool = False  # a response.create asked for it
    turn_id: str = ""
    created: bool = False  # response.created went out
    done: bool = False
    transcript: str = ""
    audio_ms: float = 0.0  # audio sent, in the item's timeline
    cancel_reason: str = ""  # "client_cancelled", "turn_detected"
    accepted_tokens: list[int] = field(default_factory=list)  # per verify step: the speculative statistics


@dataclass
class Utterance:
    item_id: str
    start_s: float = 0.0  # where the speech began, in the input audio's timeline
    started: bool = False  # speech_started went out
    committed: bool = False
    transcript_delta: str = ""  # what the transcription deltas have said so far


class RealtimeConverter:
    """One Realtime connection's state between its client and its conversation.

    `client_event(text)` → (inputs for the conversation, server events to send now);
    `conversation_event(event)` → server events. Refusals raise RealtimeError; the caller answers them
    with `error_event` and goes on. `resolve` checks a gateway SessionConfig against what the stages offer
    (the servicer's), `base_config` is the specvox session's own."""

    def __init__(self, session: RealtimeSession, dialect: rs.Dialect, voices: tuple[str, ...], asr: Any,
                 base_turn_taking: Any, base_config: Any, resolve: Callable[[Any], Any],
                 new_id: Callable[[str], str] | None = None, drafters: tuple[str, ...] = ()) -> None:
        self.session, self.dialect, self.voices, self.asr = session, dialect, voices, asr
        self.drafters = drafters
        self.base_turn_taking, self.base_config, self.resolve = base_turn_taking, base_config, resolve
        counter = itertools.count()
        self.new_id = new_id or (lambda prefix: f"{prefix}_{uuid.uuid4().hex[:20]}")
        self._event_ids = (f"event_{uuid.uuid4().hex[:12]}{n}" for n in counter)
        self.items: OrderedDict[str, dict] = OrderedDict()  # id → the item as the client sees it
        self.item_turns: dict[str, str] = {}  # assistant item id → turn id
        self.responses: dict[str, Response] = {}  # turn id → its response
        self.requested: list[Response] = []  # response.create asked, its turn not seen yet
        self.utterances: dict[int, Utterance] = {}
        self.latest_utterance: int | None = None
        self.input = _InputAudio(session.input_format)
        self.input_ms = 0.0  # client audio received, in its own timeline
        self.committed_ms = 0.0  # turn detection off: where the last commit took the audio to

    # ---- events out ---------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any] | None:
        """A server event in this connection's dialect (None: the dialect has no such event)."""
        if self.dialect == "beta":
            if kind in BETA_ONLY_GA:
                return None
            kind = BETA_NAMES.get(kind, kind)
        return {"type": kind, "event_id": next(self._event_ids), **fields}

    def error_event(self, error: RealtimeError, client_event_id: str | None = None,
                    kind: str = "invalid_request_error") -> dict[str, Any]:
        return {"type": "error", "event_id": next(self._event_ids),
                "error": {"type": kind, "code": error.code, "message": str(error), "param": error.param,
                          "event_id": client_event_id}}

    def session_created(self) -> list[dict]:
        """The connection's first events: its session, then its conversation (the specvox session's)."""
        return _present(self.event("session.created", session=self._rendered()),
                        self.event("conversation.created", conversation={
                            "id": self.session.session_id, "object": "realtime.conversation"}))

    def _rendered(self) -> dict[str, Any]:
        """The effective session, with what specvox offers (its voices and drafters) in its extension object."""
        session = rs.rendered(self.session, self.dialect)
        session["specvox"]["choices"] = {"voices": list(self.voices), "drafters": list(self.drafters)}
        return session

    # ---- client events → inputs ---------------------------------------------------------------

    def client_event(self, text: str | bytes) -> tuple[list[ClientInput], list[dict]]:
        event = _parsed(text)
        kind = event["type"]
        handler = CLIENT_EVENTS.get(kind)
        if handler is None:
            raise RealtimeError(f"Invalid value: '{kind}'. Supported values are: {', '.join(sorted(CLIENT_EVENTS))}.",
                                "invalid_value", "type")
        inputs, out = handler(self, event)
        return inputs, [e for e in out if e is not None]

    def _session_update(self, event: dict) -> tuple[list[ClientInput], list]:
        session = rs.updated(self.session, event.get("session"), self.dialect, self.voices, self.asr)
        if session.transcription_language not in ("", self.base_config.language):
            raise RealtimeError(f"the transcription language is the specvox session's ({self.base_config.language!r});"
                                " choose another when creating the session", "unsupported_value",
                                "session.audio.input.transcription.language")
        try:
            config = self.resolve(session.session_config(self.base_config))
        except ValueError as e:
            raise RealtimeError(str(e), "invalid_value", "session") from None
        self.session = session
        if session.input_format != self.input.format:
            self.input = _InputAudio(session.input_format)
        reconfigure = Reconfigure(config, session.turn_taking(self.base_turn_taking, self.asr.end_of_speech_silence_ms),
                                  auto_turns=session.turn_detection is not None)
        return [reconfigure], [self.event("session.updated", session=self._rendered())]

    def _append(self, event: dict) -> tuple[list[ClientInput], list]:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError("audio must be a base64 string", "invalid_type", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("audio is not valid base64", "invalid_value", "audio") from None
        pcm = self.input.decode(data)
        self.input_ms += len(data) * 1000 / self.input.bytes_per_s
        return ([ClientAudio(pcm)] if pcm else []), []

    def _commit(self, event: dict) -> tuple[list[ClientInput], list]:
        if self.session.turn_detection is not None:
            raise RealtimeError("turn detection is on: the server commits the audio at each end of speech "
                                "(set turn_detection to null to commit yourself)", "invalid_value", None)
        return [CommitAudio()], []

    def _clear(self, event: dict) -> tuple[list[ClientInput], list]:
        return [ClearAudio()], [self.event("input_audio_buffer.cleared")]

    def _item_create(self, event: dict) -> tuple[list[ClientInput], list]:
        item = event.get("item")
        if not isinstance(item, dict):
            raise RealtimeError("item must be an object", "invalid_type", "item")
        if item.get("type", "message") != "message":
            raise RealtimeError(f"item type {item.get('type')!r} is not served: specvox's model calls no functions",
                                "unsupported_value", "item.type")
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise RealtimeError("item.role must be user, assistant or system", "invalid_value", "item.role")
        texts = []
        for part in item.get("content") or []:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "text", "output_text"):
                raise RealtimeError("only text content is served in a created item (speak the audio instead)",
                                    "unsupported_value", "item.content")
            texts.append(str(part.get("text", "")))
        item_id = item.get("id") or self.new_id("item")
        if item_id in self.items:
            raise RealtimeError(f"an item with id {item_id!r} already exists", "item_create_duplicate_item_id",
                                "item.id")
        content_type = "input_text" if role in ("user", "system") else ("text" if self.dialect == "beta"
                                                                        else "output_text")
        stored = {"id": item_id, "object": "realtime.item", "type": "message", "role": role, "status": "completed",
                  "content": [{"type": content_type, "text": t} for t in texts]}
        out = self._added(stored, event.get("previous_item_id"))
        inputs: list[ClientInput] = [UserText(" ".join(texts))] if role == "user" and any(texts) else []
        return inputs, out

    def _item_retrieve(self, event: dict) -> tuple[list[ClientInput], list]:
        item = self._item(event)
        return [], [self.event("conversation.item.retrieved", item=item)]

    def _item_delete(self, event: dict) -> tuple[list[ClientInput], list]:
        item = self._item(event)
        del self.items[item["id"]]
        return [], [self.event("conversation.item.deleted", item_id=item["id"])]

    def _item_truncate(self, event: dict) -> tuple[list[ClientInput], list]:
        item = self._item(event)
        turn_id = self.item_turns.get(item["id"])
        if turn_id is None:
            raise RealtimeError("only an assistant item's audio can be truncated", "invalid_value", "item_id")
        end_ms = event.get("audio_end_ms")
        if not isinstance(end_ms, int) or isinstance(end_ms, bool) or end_ms < 0:
            raise RealtimeError("audio_end_ms must be a whole number of milliseconds, 0 or more", "invalid_value",
                                "audio_end_ms")
        response = self.responses.get(turn_id)
        sent_ms = int(response.audio_ms) if response else end_ms
        end_ms = min(end_ms, sent_ms)  # past the audio sent: what was sent was heard
        if response and not response.done and not response.cancel_reason:
            response.cancel_reason = "client_cancelled"
        return [HeardUntil(turn_id, end_ms / 1000)], [self.event(
            "conversation.item.truncated", item_id=item["id"], content_index=event.get("content_index", 0),
            audio_end_ms=end_ms)]

    def _response_create(self, event: dict) -> tuple[list[ClientInput], list]:
        options = event.get("response") or {}
        if not isinstance(options, dict):
            raise RealtimeError("response must be an object", "invalid_type", "response")
        if options.get("conversation") == "none":
            raise RealtimeError("out-of-band responses are not served: every reply joins the conversation",
                                "unsupported_value", "response.conversation")
        if options.get("tools"):
            raise RealtimeError("tools are not served here", "unsupported_value", "response.tools")
        rs._modalities(options.get("output_modalities", options.get("modalities")), "response.output_modalities")
        asked = options.get("instructions")  # LiveKit sends null for none: the session's
        instructions = rs.instructions_of("" if asked is None else asked, "response.instructions")
        if self._active() is not None:
            raise RealtimeError("Conversation already has an active response in progress.",
                                "conversation_already_has_active_response", None)
        self.requested.append(Response(self.new_id("resp"), self.new_id("item"), metadata=options.get("metadata"),
                                       requested=True))
        return [RequestReply(instructions)], []

    def _response_cancel(self, event: dict) -> tuple[list[ClientInput], list]:
        response = self._active()
        if response is None or (event.get("response_id") and event["response_id"] != response.response_id):
            raise RealtimeError("Cancellation failed: no active response found", "response_cancel_not_active", None)
        response.cancel_reason = "client_cancelled"
        return [CancelReply()], []

    def _active(self) -> Response | None:
        """The response in progress: asked for and not done, or speaking and not done."""
        if self.requested:
            return self.requested[-1]
        return next((r for r in self.responses.values() if (r.created or r.requested) and not r.done), None)

    def _item(self, event: dict) -> dict:
        item_id = str(event.get("item_id"))
        if item_id not in self.items:
            raise RealtimeError(f"Item with item_id not found: {item_id}", "item_not_found", "item_id")
        return self.items[item_id]

    def _added(self, item: dict, previous_item_id: str | None = None) -> list:
        previous = previous_item_id or next(reversed(self.items), None)
        self.items[item["id"]] = item
        while len(self.items) > KEPT_ITEMS:
            old, _ = self.items.popitem(last=False)
            self.item_turns.pop(old, None)
        return [self.event("conversation.item.added", previous_item_id=previous, item=item),
                self.event("conversation.item.done", item=item)]

    # ---- conversation events → server events --------------------------------------------------

    def conversation_event(self, event: Any) -> list[dict]:
        if isinstance(event, UserSpeech):
            out = self._user_speech(event)
        elif isinstance(event, TurnStarted):
            out = self._turn_started(event)
        elif isinstance(event, InputCommitted):
            out = self._input_committed(event)
        else:
            out = self._server_event(event)
        return [e for e in out if e is not None]

    def _user_speech(self, notice: UserSpeech) -> list:
        if self.session.turn_detection is None:
            return []  # no server VAD: the client's commits make the items
        self.latest_utterance = notice.utterance
        utterance = self.utterances.setdefault(notice.utterance, Utterance(self.new_id("item")))
        if notice.started:
            utterance.start_s = notice.audio_s
            active = self._active()
            over_a_reply = active is not None and active.created and self.session.turn_detection.interrupt_response
            return [] if over_a_reply else self._speech_started(notice.utterance, notice.audio_s)
        if utterance.started:
            return self._committed(notice.utterance, notice.text, notice.audio_s)
        return []  # said over a reply, and it went on: a backchannel or a cough

    def _speech_started(self, index: int, audio_s: float) -> list:
        utterance = self.utterances.setdefault(index, Utterance(self.new_id("item")))
        if utterance.started:
            return []
        utterance.started = True
        return [self.event("input_audio_buffer.speech_started", audio_start_ms=round(audio_s * 1000),
                           item_id=utterance.item_id)]

    def _committed(self, index: int, text: str, audio_end_s: float) -> list:
        utterance = self.utterances[index]
        if utterance.committed:
            return []
        utterance.committed = True
        for old in [u for u in self.utterances if u < index - 8]:
            del self.utterances[old]
        out = [self.event("input_audio_buffer.speech_stopped", audio_end_ms=round(audio_end_s * 1000),
                          item_id=utterance.item_id)]
        return out + self._user_item(utterance.item_id, text, max(0.0, audio_end_s - utterance.start_s))

    def _user_item(self, item_id: str, text: str, seconds: float) -> list:
        previous = next(reversed(self.items), None)
        item = {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_audio", "transcript": text if self.session.transcribe else None}]}
        out = [self.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id),
               *self._added(item, previous)]
        if self.session.transcribe:
            out.append(self.event("conversation.item.input_audio_transcription.completed", item_id=item_id,
                                  content_index=0, transcript=text,
                                  usage={"type": "duration", "seconds": round(seconds, 3)}))
        return out

    def _input_committed(self, notice: InputCommitted) -> list:
        seconds, self.committed_ms = (self.input_ms - self.committed_ms) / 1000, self.input_ms
        return self._user_item(self.new_id("item"), notice.text, seconds)

    def _server_event(self, event: Any) -> list:
        kind = event.WhichOneof("event")
        if kind == "transcript":
            return self._transcript(event)
        if kind in ("reply_text", "audio", "word", "cue", "viseme"):
            return self._reply_output(event, kind)
        if kind == "caption":
            return self._extension("specvox.caption", **_caption(event.caption))
        if kind in ("pause", "resume"):
            return self._extension(f"specvox.playback.{kind}d", turn_id=event.turn_id,
                                   **json_format.MessageToDict(getattr(event, kind), preserving_proto_field_name=True))
        if kind == "interrupt":
            return self._interrupted(event)
        if kind == "report":
            return self._turn_over(event)
        return []

    def _transcript(self, event: Any) -> list:
        t = event.transcript
        if self.session.turn_detection is None:
            return []
        if t.is_final:  # a turn's own utterance (AnnounceFinal): it is committed now, if the notice has not yet
            self.utterances.setdefault(t.utterance_index, Utterance(self.new_id("item"))).start_s = t.speech_start_s
            out = self._speech_started(t.utterance_index, t.speech_start_s)
            return out + self._committed(t.utterance_index, t.text, t.speech_end_s)
        utterance = self.utterances.get(t.utterance_index)
        if not self.session.transcribe or utterance is None or not utterance.started or utterance.committed:
            return []
        said = t.committed_text.strip()
        if not said.startswith(utterance.transcript_delta) or said == utterance.transcript_delta:
            return []
        delta, utterance.transcript_delta = said[len(utterance.transcript_delta):], said
        return [self.event("conversation.item.input_audio_transcription.delta", item_id=utterance.item_id,
                           content_index=0, delta=delta)]

    def _turn_started(self, notice: TurnStarted) -> list:
        if notice.requested and self.requested:
            self._bind(notice.turn_id, self.requested.pop(0))
        return []

    def _response(self, turn_id: str) -> Response:
        """The turn's response: the one a response.create asked for, else one of its own (a voice turn's)."""
        return self.responses.get(turn_id) or self._bind(turn_id, Response(self.new_id("resp"), self.new_id("item")))

    def _bind(self, turn_id: str, response: Response) -> Response:
        response.turn_id = turn_id
        self.responses[turn_id] = response
        self.item_turns[response.item_id] = turn_id
        for old in list(self.responses)[:-KEPT_ITEMS]:
            del self.responses[old]
        return response

    def _reply_output(self, event: Any, kind: str) -> list:
        response = self._response(event.turn_id)
        if response.done:
            return []
        out = self._started(response)
        ids = dict(response_id=response.response_id, item_id=response.item_id, output_index=0, content_index=0)
        if kind == "reply_text":
            response.transcript += event.reply_text.text_delta
            response.accepted_tokens.append(event.reply_text.accepted_tokens)
            out.append(self.event("response.output_audio_transcript.delta", delta=event.reply_text.text_delta, **ids))
            out += self._extension("specvox.verify_step", response_id=response.response_id, item_id=response.item_id,
                                   accepted_tokens=event.reply_text.accepted_tokens)  # the delta just sent
        elif kind == "audio":
            audio = event.audio
            data = _output_audio(audio.pcm_s16le, audio.sample_rate_hz, self.session.output_format)
            response.audio_ms = max(response.audio_ms, audio.start_s * 1000
                                    + len(audio.pcm_s16le) / 2 / audio.sample_rate_hz * 1000)
            out.append(self.event("response.output_audio.delta", delta=base64.b64encode(data).decode(), **ids))
        elif kind == "viseme":
            v = event.viseme
            out += self._extension("specvox.viseme", response_id=response.response_id, item_id=response.item_id,
                                   id=v.id, azure_id=v.azure_id, weight=round(v.weight, 3), approximate=v.approximate,
                                   start_ms=round(v.start_s * 1000), end_ms=round(v.end_s * 1000))
        else:
            cue = getattr(event, kind)
            out += self._extension(f"specvox.{kind}", response_id=response.response_id, item_id=response.item_id,
                                   text=cue.text, start_ms=round(cue.start_s * 1000), end_ms=round(cue.end_s * 1000))
        return out

    def _started(self, response: Response) -> list:
        if response.created:
            return []
        response.created = True
        item = self._assistant_item(response, "in_progress")
        previous = next(reversed(self.items), None)
        self.items[response.item_id] = item  # truncate, retrieve and delete find it from now on
        return [self.event("response.created", response=self._response_object(response, "in_progress", None)),
                self.event("response.output_item.added", response_id=response.response_id, output_index=0, item=item),
                self.event("conversation.item.added", previous_item_id=previous, item=item),
                self.event("response.content_part.added", response_id=response.response_id, item_id=response.item_id,
                           output_index=0, content_index=0, part={"type": "audio", "transcript": ""})]

    def _interrupted(self, event: Any) -> list:
        response = self.responses.get(event.turn_id)
        if response is None or response.done:
            return []
        out = []
        if not response.cancel_reason:  # the user's speech took the turn: it is announced now
            response.cancel_reason = "turn_detected"
            if (latest := self.latest_utterance) is not None and latest in self.utterances:
                out += self._speech_started(latest, self.utterances[latest].start_s)
        return out

    def _turn_over(self, event: Any) -> list:
        report = event.report
        response = self.responses.get(event.turn_id)  # none: a voice turn that ended before it said anything
        if response is None and report.finish_reason == "error" and report.mode == "dialogue":
            response = self._response(event.turn_id)  # a failure is told, as a failed response
        out: list = []
        if response is not None and not response.done:
            out += self._started(response) + self._finished(response, report)
        extension: dict[str, Any] = {"report": json_format.MessageToDict(report, preserving_proto_field_name=True)}
        if response is not None and response.accepted_tokens:
            steps = response.accepted_tokens
            extension["speculative"] = {"verify_steps": len(steps), "accepted_tokens": sum(steps),
                                        "mean_accepted_per_step": round(sum(steps) / len(steps), 3)}
        return out + self._extension("specvox.turn.report", turn_id=event.turn_id,
                                     response_id=response.response_id if response else None, **extension)

    def _finished(self, response: Response, report: Any) -> list:
        response.done = True
        details: dict[str, Any] | None
        if report.finish_reason in FINISHED:
            status, reason = FINISHED[report.finish_reason]
            details = {"type": status, "reason": reason} if reason else None
        elif report.finish_reason == "error":
            status, details = "failed", {"type": "failed", "error": {"type": "server_error", "code": "turn_failed",
                                                                     "message": report.error}}
        else:
            status = "cancelled"
            details = {"type": "cancelled", "reason": response.cancel_reason or "turn_detected"}
        ids = dict(response_id=response.response_id, item_id=response.item_id, output_index=0, content_index=0)
        item_status = "completed" if status == "completed" else "incomplete"
        item = self._assistant_item(response, item_status)
        self.items[response.item_id] = item
        return [self.event("response.output_audio.done", **ids),
                self.event("response.output_audio_transcript.done", transcript=response.transcript, **ids),
                self.event("response.content_part.done", part={"type": "audio", "transcript": response.transcript},
                           **ids),
                self.event("response.output_item.done", response_id=response.response_id, output_index=0, item=item),
                self.event("conversation.item.done", item=item),
                self.event("response.done", response=self._response_object(response, status, details, [item]))]

    def _assistant_item(self, response: Response, status: str) -> dict:
        content_type = "audio" if self.dialect == "beta" else "output_audio"
        return {"id": response.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": [{"type": content_type, "transcript": response.transcript}]}

    def _response_object(self, response: Response, status: str, details: Any, output: list | None = None) -> dict:
        fmt = self.session.output_format
        common = {"id": response.response_id, "object": "realtime.response", "status": status,
                  "status_details": details, "output": output or [], "metadata": response.metadata, "usage": None,
                  "conversation_id": self.session.session_id,
                  "max_output_tokens": self.session.max_output_tokens or "inf"}
        if self.dialect == "beta":
            return {**common, "modalities": ["audio", "text"], "voice": self.session.voice,
                    "output_audio_format": rs.BETA_NAME[fmt], "temperature": self.session.temperature}
        return {**common, "output_modalities": ["audio"], "audio": {"output": {
            "format": {"type": fmt, "rate": 24_000} if fmt == PCM else {"type": fmt}, "voice": self.session.voice}}}

    def _extension(self, kind: str, **fields: Any) -> list:
        return [{"type": kind, "event_id": next(self._event_ids), **fields}] if self.session.extension_events else []


CLIENT_EVENTS: dict[str, Callable[[RealtimeConverter, dict], tuple[list[ClientInput], list]]] = {
    "session.update": RealtimeConverter._session_update,
    "input_audio_buffer.append": RealtimeConverter._append,
    "input_audio_buffer.commit": RealtimeConverter._commit,
    "input_audio_buffer.clear": RealtimeConverter._clear,
    "conversation.item.create": RealtimeConverter._item_create,
    "conversation.item.retrieve": RealtimeConverter._item_retrieve,
    "conversation.item.delete": RealtimeConverter._item_delete,
    "conversation.item.truncate": RealtimeConverter._item_truncate,
    "response.create": RealtimeConverter._response_create,
    "response.cancel": RealtimeConverter._response_cancel,
}


def _cue(cue: Any) -> dict[str, Any]:
    return {"text": cue.text, "start_ms": round(cue.start_s * 1000), "end_ms": round(cue.end_s * 1000)}


def _caption(caption: Any) -> dict[str, Any]:
    """A caption-mode caption: cues on the input audio's timeline."""
    return {"text": caption.text, "provisional": caption.provisional, "utterance_index": caption.utterance_index,
            "cues": [_cue(c) for c in caption.cues], "lines": [_cue(c) for c in caption.lines],
            "webvtt": caption.webvtt, "srt": caption.srt}


def _parsed(text: str | bytes) -> dict:
    try:
        event = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RealtimeError(f"the message is not valid JSON: {e}", "invalid_json", None) from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise RealtimeError("a client event is a JSON object with a string 'type'", "invalid_event", "type")
    return event


def client_event_id(text: str | bytes) -> str | None:
    """The client's event_id, where the message has one (echoed in an error about it)."""
    try:
        event = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    value = event.get("event_id") if isinstance(event, dict) else None
    return value if isinstance(value, str) else None


def _present(*events: dict | None) -> list[dict]:
    return [e for e in events if e is not None]


class _InputAudio:
    """The client's audio in its session format → 16-bit PCM at 24 kHz, the conversation's input format
    whatever the client sends (so a format change mid-connection leaves the asr stream as it is).

    G.711 is decoded by FFmpeg's codecs through PyAV (pipeline/g711.py) and brought from 8 to 24 kHz by
    libsoxr's stream resampler, one signal across chunks."""

    def __init__(self, fmt: str) -> None:
        self.format = fmt
        self.bytes_per_s = 48_000 if fmt == PCM else 8_000
        self._resampler = StreamResampler(8_000, 24_000) if fmt != PCM else None
        self._pending = b""

    def decode(self, data: bytes) -> bytes:
        if self._resampler is None:
            data, self._pending = self._pending + data, b""
            if len(data) % 2:  # a sample split across appends waits for its other byte
                data, self._pending = data[:-1], data[-1:]
            return data
        pcm = np.frombuffer(g711.decode(data, LAW[self.format]), "<i2").astype(np.float32) / 32768
        return float_to_pcm16(self._resampler.feed(pcm))


def _output_audio(pcm: bytes, rate_hz: int, fmt: str) -> bytes:
    """Reply audio (mono s16le at the rate the session asked tts for) in the session's output format."""
    want_hz = rs.FORMAT_RATE_HZ[fmt]
    if rate_hz != want_hz:  # a chunk spoken before a format change
        samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
        pcm = float_to_pcm16(resample(samples, rate_hz, want_hz))
    return pcm if fmt == PCM else g711.encode(pcm, LAW[fmt])
