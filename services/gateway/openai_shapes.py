"""OpenAI's HTTP request and response shapes ↔ the stages' protos, free of any transport.

The routes (services/gateway/openai_http.py) only plumb: a chat completion request becomes an llm
`ReplyRequest` on a conversation (persona, history, the user's last words) as the live path builds
its prompts (pipeline/llm/prompts.py); a transcription is asr's `Transcribe` stream over the file's
decoded audio, its FINAL events written as OpenAI's formats with the project's caption writers; speech
is tts's `Synthesize` stream, its 24 kHz chunks encoded as they come (PyAV's encoders: FFmpeg in
its wheel). What the stages cannot do is refused here with a 400 naming the parameter.
"""

from __future__ import annotations

import base64
import io
import json
import math
import struct
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from pipeline.asr import prompt_of_phrases
from pipeline.caption_style import broadcast_cues
from pipeline.captions import srt_document, webvtt_document
from pipeline.llm.prompts import Exchange
from services.gateway.convert import common, llm_pb, tts_pb
from services.gateway.web import HttpError

# ---- models and voices -------------------------------------------------------------------------

# OpenAI's own model names, taken as the one asr and the one tts specvox serves, so that clients whose
# defaults name them (Pipecat's OpenAISTTService, OpenAITTSService) work unchanged.
TRANSCRIPTION_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-transcribe")
SPEECH_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# OpenAI's voice names: each is specvox's default voice (a client may only offer these; Pipecat checks).
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


@dataclass(frozen=True)
class ServedModels:
    """The model names each endpoint takes: the llm's own; asr and tts by specvox's names and OpenAI's."""

    chat: tuple[str, ...]
    transcription: tuple[str, ...]
    speech: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.chat, *self.transcription, *self.speech)


def served_models(llm_model: str, asr_model: str) -> ServedModels:
    return ServedModels((llm_model,), (f"specvox-asr-{asr_model}", *TRANSCRIPTION_MODELS),
                        ("specvox-tts", *SPEECH_MODELS))


def model_entry(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "specvox"}


def check_model(body: Mapping[str, Any], known: Sequence[str]) -> str:
    model = body.get("model")
    if model is None or model == "":
        raise HttpError(400, "you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise HttpError(400, "model must be a string", param="model", code="invalid_type")
    if model not in known:
        raise HttpError(404, f"the model {model!r} does not exist here; GET /v1/models lists "
                             f"those served: {', '.join(known)}", param="model", code="model_not_found")
    return model


# ---- chat completions --------------------------------------------------------------------------

# Parameters taken and ignored (they change nothing a reply of this service would be).
IGNORED_CHAT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                          "safety_identifier", "stream_options"})
# Accepted only at the value that asks for nothing: each other value is refused, naming the parameter.
NEUTRAL_CHAT: dict[str, tuple[Any, ...]] = {
    "n": (1,), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none",),
    "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "response_format": ({"type": "text"},), "modalities": (["text"],),
    "audio": (), "prediction": (), "reasoning_effort": (), "verbosity": (), "web_search_options": ()}
KNOWN_CHAT = frozenset({"model", "messages", "stream", "temperature", "top_p", "top_k", "repetition_penalty",
                        "stop", "max_tokens", "max_completion_tokens", "seed", "drafter"}
                       ) | IGNORED_CHAT | set(NEUTRAL_CHAT)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass(frozen=True)
class ChatRequest:
    """A chat completion as the llm stage takes it: the conversation and the decoding asked."""

    model: str
    persona: str  # "": the llm's default persona
    history: tuple[Exchange, ...]
    user_text: str
    stream: bool
    include_usage: bool
    sampling: Any  # common.Sampling
    stop: tuple[str, ...]
    max_new_tokens: int  # 0: the llm's default
    drafter: str  # "": the llm's default

    def reply_request(self, session_id: str, turn_id: str) -> Any:
        return llm_pb.ReplyRequest(session_id=session_id, turn_id=turn_id, user_text=self.user_text,
                                   task=llm_pb.ReplyRequest.DIALOGUE, max_new_tokens=self.max_new_tokens,
                                   drafter=self.drafter, sampling=self.sampling, stop=list(self.stop),
                                   defer_history=True, system_prompt=self.persona)


def chat_request(body: Any, models: Sequence[str], drafters: Sequence[str]) -> ChatRequest:
    """The request checked and converted; HttpError naming the parameter at fault."""
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key not in KNOWN_CHAT:
            raise HttpError(400, f"unrecognized request argument supplied: {key}", param=key,
                            code="unknown_parameter")
        if key in NEUTRAL_CHAT and value is not None and value not in NEUTRAL_CHAT[key]:
            raise HttpError(400, f"{key} is not supported by specvox (only {_neutral(key)})", param=key,
                            code="unsupported_parameter")
    model = check_model(body, models)
    persona, history, user_text = conversation(body.get("messages"))
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise HttpError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if options is not None and not isinstance(options, dict):
        raise HttpError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    sampling = common.Sampling(
        temperature=_number(body, "temperature", 0.0, 2.0, 0.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
        top_k=int(_number(body, "top_k", 0, 1_000_000, 0, integer=True)),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, 10.0, 1.0, low_open=True))
    if body.get("seed") is not None:
        sampling.seed = int(_number(body, "seed", 0, 2**64 - 1, 0, integer=True))
    return ChatRequest(model, persona, history, user_text, stream, include_usage, sampling, _stops(body.get("stop")),
                       _max_tokens(body), _drafter(body.get("drafter"), drafters))


def conversation(messages: Any) -> tuple[str, tuple[Exchange, ...], str]:
    """(persona, history, the user's last words) of OpenAI's messages, the shape the llm's prompts take:
    leading system (or developer) messages, then user and assistant in turn, ending with the user's.
    Consecutive messages of one role are joined (a new line between user messages)."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty array", param="messages",
                        code="missing_required_parameter" if messages is None else "invalid_type")
    system: list[str] = []
    turns: list[tuple[str, list[str]]] = []  # (role, its texts), roles alternating
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise HttpError(400, f"{where} must be an object", param=where)
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls") or message.get("function_call"):
            raise HttpError(400, f"{where}: tool calls are not supported by specvox", param=f"{where}.role")
        if role not in ("system", "developer", "user", "assistant"):
            raise HttpError(400, f"{where}.role must be system, developer, user or assistant, not {role!r}",
                            param=f"{where}.role")
        text = _content_text(message.get("content"), f"{where}.content", role == "assistant")
        if role in ("system", "developer"):
            if turns:
                raise HttpError(400, f"{where}: a {role} message after the conversation has started is not "
                                     "supported; put the instructions first", param=f"{where}.role")
            system.append(text)
        elif turns and turns[-1][0] == role:
            turns[-1][1].append(text)
        elif not turns and role == "assistant":
            raise HttpError(400, f"{where}: the conversation must start with a user message after the "
                                 "system messages", param=f"{where}.role")
        else:
            turns.append((role, [text]))
    if not turns or turns[-1][0] != "user":
        raise HttpError(400, "the last message must be the user's: specvox writes the assistant's next reply "
                             "(continuing an assistant message is not supported)", param="messages")
    joined = ["\n".join(texts) if role == "user" else " ".join(texts) for role, texts in turns]
    user_text = joined[-1]
    if not user_text.strip():
        raise HttpError(400, "the last user message is empty", param=f"messages[{len(messages) - 1}].content")
    history = tuple(Exchange(joined[k], joined[k + 1]) for k in range(0, len(joined) - 1, 2))
    return "\n\n".join(s for s in system if s.strip()), history, user_text


def _content_text(content: Any, where: str, may_be_null: bool) -> str:
    """A message's text: a string, or text parts (another kind of part is refused)."""
    if content is None and may_be_null:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HttpError(400, f"{where}[{k}]: only text parts are supported by specvox, not {kind!r}",
                                param=f"{where}[{k}]")
            texts.append(part["text"])
        return "".join(texts)
    raise HttpError(400, f"{where} must be a string or an array of text parts", param=where)


def _neutral(key: str) -> str:
    values = NEUTRAL_CHAT[key]
    return " or ".join(json.dumps(v) for v in values) if values else "leaving it out"


def _bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HttpError(400, f"{key} must be a boolean", param=key, code="invalid_type")
    return value


def _number(body: Mapping[str, Any], key: str, low: float, high: float, default: float, integer: bool = False,
            low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise HttpError(400, f"{key} must be {'an integer' if integer else 'a number'}", param=key,
                        code="invalid_type")
    if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
        raise HttpError(400, f"{key} {value} is outside {'(' if low_open else '['}{low:g}, {high:g}]", param=key,
                        code="invalid_value")
    return value


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise HttpError(400, "stop must be a non-empty string or an array of at most 4 of them", param="stop")
    return tuple(stops)


def _max_tokens(body: Mapping[str, Any]) -> int:
    given = [(k, int(_number(body, k, 1, 2**32 - 1, 0, integer=True))) for k in ("max_completion_tokens", "max_tokens")
             if body.get(k) is not None]
    if len({v for _, v in given}) > 1:
        raise HttpError(400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens")
    return given[0][1] if given else 0


def _drafter(drafter: Any, drafters: Sequence[str]) -> str:
    if drafter is None or drafter == "":
        return ""
    if not isinstance(drafter, str) or drafter not in drafters:
        raise HttpError(400, f"unknown drafter {drafter!r}: the llm offers {', '.join(drafters)}", param="drafter",
                        code="invalid_value")
    return drafter


@dataclass
class ChatResult:
    """A reply's steps as they come, summed into OpenAI's completion, chunk by chunk or at the end."""

    request: ChatRequest
    drafter: str  # the one decoding: asked, else the llm's default
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, step: Any) -> str:
        """A ReplyStep in; its text out. A step that failed raises (500: the llm said why)."""
        self.text += step.text_delta
        self.completion_tokens += len(step.token_ids)
        if step.end:
            if step.finish_reason not in FINISH_REASONS:
                raise HttpError(500, f"llm: the reply ended with {step.finish_reason!r}", kind="server_error")
            self.finish_reason = FINISH_REASONS[step.finish_reason]
            self.stats = json.loads(step.stats_json) if step.stats_json else {}
        return step.text_delta

    def usage(self) -> dict[str, Any]:
        prompt = int(self.stats.get("prompt_tokens", 0))
        cached = int(self.stats.get("prefix_cached_tokens", 0))
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def extension(self) -> dict[str, Any]:
        """`specvox`: the speculative decoding behind the reply (an extension field, ignored by strict clients)."""
        s = self.stats
        return {"drafter": self.drafter, "tokens_per_pass": s.get("mean_accepted_len"),  # 1.0: plain decoding
                **{k: s[k] for k in ("steps", "drafted_tokens", "accepted_draft_tokens", "acceptance_rate",
                                     "prefix_cached_tokens", "prefill_s") if k in s}}

    def completion(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.request.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text, "refusal": None},
                             "logprobs": None, "finish_reason": self.finish_reason}],
                "usage": self.usage(), "system_fingerprint": None, "specvox": self.extension()}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, last: bool = False) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.request.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if self.request.include_usage:
            chunk["usage"] = None
        if last:
            chunk["specvox"] = self.extension()
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.request.model,
                "system_fingerprint": None, "choices": [], "usage": self.usage()}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event's `data:` line (what OpenAI's SDKs read), ended by the blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


# ---- transcriptions ----------------------------------------------------------------------------

TRANSCRIPTION_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("word", "segment")
KNOWN_TRANSCRIPTION = frozenset({"file", "model", "language", "prompt", "response_format", "temperature",
                                 "timestamp_granularities", "timestamp_granularities[]", "stream", "chunking_strategy",
                                 "include", "include[]"})


@dataclass(frozen=True)
class TranscriptionRequest:
    model: str
    language: str
    prompt: str
    response_format: str
    granularities: tuple[str, ...]
    stream: bool
    logprobs: bool = False  # include[]=logprobs: one entry per word (asr gives word probabilities, not tokens')


def transcription_request(fields: Mapping[str, list[str]], models: Sequence[str]) -> TranscriptionRequest:
    """The form's fields (the file aside) checked; each field's values as a list (`x[]` may repeat)."""
    for key in fields:
        if key not in KNOWN_TRANSCRIPTION:
            raise HttpError(400, f"unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    one = {k: v[-1] for k, v in fields.items() if v}
    model = check_model(one, models)
    response_format = one.get("response_format") or "json"
    if response_format not in TRANSCRIPTION_FORMATS:
        raise HttpError(400, f"response_format {response_format!r} is not one of {', '.join(TRANSCRIPTION_FORMATS)}",
                        param="response_format", code="invalid_value")
    granularities = tuple(dict.fromkeys(
        [*fields.get("timestamp_granularities[]", []), *fields.get("timestamp_granularities", [])]))
    for g in granularities:
        if g not in GRANULARITIES:
            raise HttpError(400, f"timestamp_granularities: {g!r} is not word or segment",
                            param="timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise HttpError(400, "timestamp_granularities needs response_format verbose_json",
                        param="timestamp_granularities")
    temperature = one.get("temperature", "0") or "0"
    try:
        asked = float(temperature)
    except ValueError:
        raise HttpError(400, f"temperature {temperature!r} is not a number", param="temperature") from None
    if asked != 0:
        raise HttpError(400, "temperature: specvox transcribes greedily (0 only)", param="temperature",
                        code="unsupported_value")
    if one.get("chunking_strategy") not in (None, "", "auto"):
        raise HttpError(400, "chunking_strategy: only auto (specvox's VAD cuts the utterances)",
                        param="chunking_strategy")
    stream = (one.get("stream") or "false").lower()
    if stream not in ("true", "false"):
        raise HttpError(400, f"stream must be true or false, not {stream!r}", param="stream")
    if stream == "true" and response_format not in ("json", "text"):
        raise HttpError(400, "stream=true gives transcript.text events: response_format must be json or text",
                        param="stream")
    prompt = one.get("prompt", "")
    try:
        prompt_of_phrases([prompt])  # the asr's own check, here: refused before any audio is sent
    except ValueError as e:
        raise HttpError(400, f"prompt: {e}", param="prompt") from None
    include = [*fields.get("include[]", []), *fields.get("include", [])]
    if any(item != "logprobs" for item in include):
        raise HttpError(400, f"include: only logprobs, not {include!r}", param="include")
    if include and response_format != "json":
        raise HttpError(400, "include=logprobs needs response_format json", param="include")
    return TranscriptionRequest(model, one.get("language", ""), prompt, response_format,
                                granularities or ("segment",), stream == "true", bool(include))


@dataclass
class Utterance:
    """One FINAL event of asr: an utterance's text, span and timed words."""

    text: str
    start_s: float
    end_s: float
    words: list[Any]  # common.Word


class StreamedText:
    """transcript.text.delta events from asr's events: each utterance's committed words as they
    settle (LocalAgreement: never taken back), the rest at its FINAL."""

    def __init__(self) -> None:
        self.done: list[str] = []  # the closed utterances' texts
        self._sent = ""  # what went out of the open utterance

    def delta(self, text: str, final: bool) -> str:
        """The new part of the open utterance's (committed or final) text; "" when nothing is new."""
        if not text.startswith(self._sent):  # (a final that differs from its committed words: nothing is resent)
            text = self._sent if not final else text
        new = text[len(self._sent):]
        prefix = " " if self.done and not self._sent and new else ""
        self._sent = text if not final else ""
        if final:
            self.done.append(text)
        return prefix + new if new.strip() else ""

    @property
    def text(self) -> str:
        return " ".join(t for t in self.done if t)


def transcript_text(utterances: Sequence[Utterance]) -> str:
    return " ".join(u.text for u in utterances if u.text)


def transcription_body(request: TranscriptionRequest, utterances: Sequence[Utterance], duration_s: float,
                       language: str) -> tuple[str | dict[str, Any], str]:
    """(body, content type) of the response_format asked."""
    text = transcript_text(utterances)
    fmt = request.response_format
    if fmt == "text":
        return text + "\n", "text/plain"
    if fmt in ("srt", "vtt"):
        cues = broadcast_cues([u.words for u in utterances if u.words])
        return (srt_document(cues), "application/x-subrip") if fmt == "srt" else (webvtt_document(cues), "text/vtt")
    usage = {"type": "duration", "seconds": math.ceil(duration_s)}
    if fmt == "json":
        plain: dict[str, Any] = {"text": text, "usage": usage}
        if request.logprobs:
            plain["logprobs"] = [{"token": w.text, "logprob": round(math.log(w.probability), 4) if w.probability > 0
                                 else None, "bytes": list(w.text.encode())} for u in utterances for w in u.words]
        return plain, "application/json"
    body: dict[str, Any] = {"task": "transcribe", "language": language, "duration": round(duration_s, 3),
                            "text": text, "usage": usage}
    if "segment" in request.granularities:
        body["segments"] = [_segment(i, u) for i, u in enumerate(utterances)]
    if "word" in request.granularities:
        body["words"] = [{"word": w.text.strip(), "start": round(w.start_s, 3), "end": round(w.end_s, 3)}
                         for u in utterances for w in u.words if w.text.strip()]
    return body, "application/json"


def _segment(index: int, u: Utterance) -> dict[str, Any]:
    """Whisper's segment fields; the log-probability is the mean of its words' (asr gives no token ids)."""
    probabilities = [w.probability for w in u.words if w.probability > 0]
    encoded = u.text.encode()
    return {"id": index, "seek": 0, "start": round(u.start_s, 3), "end": round(u.end_s, 3), "text": u.text,
            "tokens": [], "temperature": 0.0,
            "avg_logprob": round(float(np.mean(np.log(probabilities))), 4) if probabilities else 0.0,
            "compression_ratio": round(len(encoded) / len(zlib.compress(encoded)), 4) if encoded else 0.0,
            "no_speech_prob": 0.0}


# ---- speech ------------------------------------------------------------------------------------

SPEECH_RATE_HZ = 24_000  # OpenAI's pcm: 24 kHz, 16-bit, mono, little-endian
MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit on `input`
SPEECH_CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "mp3": "audio/mpeg", "opus": "audio/ogg",
                        "flac": "audio/flac", "aac": "audio/aac"}
KNOWN_SPEECH = frozenset({"model", "input", "voice", "response_format", "speed", "stream_format", "instructions"})


@dataclass(frozen=True)
class SpeechRequest:
    model: str
    text: str
    voice: str  # the tts voice ("": its default)
    response_format: str
    speed: float
    sse: bool

    def synthesize_request(self) -> Any:
        return tts_pb.SynthesizeRequest(text=self.text, sample_rate_hz=SPEECH_RATE_HZ, voice=self.voice)


def speech_request(body: Any, models: Sequence[str], voices: Sequence[str]) -> SpeechRequest:
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    for key in body:
        if key not in KNOWN_SPEECH:
            raise HttpError(400, f"unrecognized request argument supplied: {key}", param=key, code="unknown_parameter")
    model = check_model(body, models)
    text = body.get("input")
    if not isinstance(text, str) or not text.strip():
        raise HttpError(400, "input must be a non-empty string", param="input",
                        code="missing_required_parameter" if text is None else "invalid_value")
    if len(text) > MAX_SPEECH_INPUT_CHARS:
        raise HttpError(400, f"input is {len(text)} characters, at most {MAX_SPEECH_INPUT_CHARS}", param="input",
                        code="string_above_max_length")
    voice = body.get("voice")
    if isinstance(voice, dict):  # {"id": ...}: a custom voice by id
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise HttpError(400, "voice must be given: one of OpenAI's voice names (each is specvox's default voice) "
                             f"or a tts voice ({', '.join(voices)})", param="voice", code="missing_required_parameter")
    if voice not in voices and voice not in OPENAI_VOICES:
        raise HttpError(400, f"unknown voice {voice!r}: the tts offers {', '.join(voices)}, and OpenAI's voice names "
                             "are its default voice", param="voice", code="invalid_value")
    response_format = body.get("response_format") or "mp3"
    if response_format not in SPEECH_CONTENT_TYPES:
        raise HttpError(400, f"response_format {response_format!r} is not one of {', '.join(SPEECH_CONTENT_TYPES)}",
                        param="response_format", code="invalid_value")
    stream_format = body.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise HttpError(400, f"stream_format {stream_format!r} is not audio or sse", param="stream_format")
    if body.get("instructions"):
        raise HttpError(400, "instructions are not supported by specvox's voices", param="instructions",
                        code="unsupported_parameter")
    speed = _number(body, "speed", 0.25, 4.0, 1.0)
    return SpeechRequest(model, text, "" if voice in OPENAI_VOICES and voice not in voices else voice,
                         response_format, speed, stream_format == "sse")


def speech_event(kind: str, **data: Any) -> dict[str, Any]:
    return {"type": f"speech.audio.{kind}", **data}


def audio_delta(chunk: bytes) -> dict[str, Any]:
    return speech_event("delta", audio=base64.b64encode(chunk).decode())


class AudioEncoder:
    """24 kHz mono 16-bit PCM in, the response format's bytes out as they are made.

    pcm passes through; wav is a header whose sizes say "unknown length" (0xFFFFFFFF, as a stream's
    is written) and the PCM after it; mp3, opus (in Ogg), flac and aac (ADTS) go through PyAV's encoders
    into its muxers, written to a buffer this class empties at every call. `speed` other than 1 runs the
    audio through FFmpeg's atempo filter (tempo without a change of pitch) first."""

    def __init__(self, response_format: str, speed: float = 1.0, rate_hz: int = SPEECH_RATE_HZ) -> None:
        self.format, self.rate_hz = response_format, rate_hz
        self._header = response_format == "wav"
        self._tempo = _Tempo(speed, rate_hz) if speed != 1.0 else None
        self._muxer = _Muxer(response_format, rate_hz) if response_format not in ("pcm", "wav") else None

    def encode(self, pcm: bytes) -> bytes:
        if self._tempo is not None:
            pcm = self._tempo.feed(pcm)
        return self._out(pcm)

    def finish(self) -> bytes:
        pcm = self._tempo.finish() if self._tempo is not None else b""
        out = self._out(pcm)
        if self._muxer is not None:
            out += self._muxer.finish()
        return out

    def close(self) -> None:
        """Frees the encoder of a stream cut short (finish() closes it otherwise)."""
        if self._muxer is not None:
            self._muxer.close()

    def _out(self, pcm: bytes) -> bytes:
        out = b""
        if self._header:
            self._header = False
            out = wav_stream_header(self.rate_hz)
        if self._muxer is not None:
            return out + (self._muxer.feed(pcm) if pcm else b"")
        return out + pcm


def wav_stream_header(rate_hz: int, channels: int = 1, width: int = 2) -> bytes:
    """A RIFF/WAVE header for a stream of unknown length: the sizes at their largest (readers stop at the end)."""
    unknown = 0xFFFFFFFF
    return (b"RIFF" + struct.pack("<I", unknown) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, channels, rate_hz, rate_hz * channels * width, channels * width,
                        8 * width) + b"data" + struct.pack("<I", unknown))


MUXERS = {"mp3": ("mp3", "libmp3lame"), "opus": ("ogg", "libopus"), "flac": ("flac", "flac"), "aac": ("adts", "aac")}


class _Sink(io.RawIOBase):
    """Where the muxer writes: bytes kept until taken; not seekable, so the muxer writes straight through."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.data += bytes(b)
        return len(b)

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


class _Muxer:
    def __init__(self, response_format: str, rate_hz: int) -> None:
        import av

        container_format, codec = MUXERS[response_format]
        self._sink = _Sink()
        # Ogg pages of 100 ms rather than FFmpeg's 1 s: opus leaves as it is spoken, like the other formats.
        options = {"page_duration": "100000"} if container_format == "ogg" else {}
        self._container = av.open(self._sink, mode="w", format=container_format, options=options)
        if codec == "libopus" and rate_hz not in (8000, 12000, 16000, 24000, 48000):
            raise ValueError(f"opus cannot encode {rate_hz} Hz")
        self._stream: Any = self._container.add_stream(codec, rate=rate_hz, layout="mono")
        self._rate_hz = rate_hz
        self._pts = 0
        self._closed = False

    def feed(self, pcm: bytes) -> bytes:
        import av

        samples = np.frombuffer(pcm, np.int16).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate, frame.pts = self._rate_hz, self._pts
        self._pts += samples.shape[1]
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self.close()
        return self._sink.take()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._container.close()


class _Tempo:
    """FFmpeg's atempo filter over a stream of s16 mono PCM (each atempo stage takes 0.5 to 2.0)."""

    def __init__(self, speed: float, rate_hz: int) -> None:
        import av.filter

        stages, left = [], speed
        while left > 2.0 or left < 0.5:
            stages.append(2.0 if left > 2.0 else 0.5)
            left /= stages[-1]
        stages.append(left)
        self._graph = av.filter.Graph()
        source = self._graph.add_abuffer(format="s16", sample_rate=rate_hz, layout="mono",
                                         time_base=Fraction(1, rate_hz))
        nodes = [source, *(self._graph.add("atempo", f"{s:.6f}") for s in stages), self._graph.add("abuffersink")]
        for a, b in zip(nodes, nodes[1:], strict=False):
            a.link_to(b)
        self._graph.configure()
        self._rate_hz, self._pts = rate_hz, 0

    def feed(self, pcm: bytes) -> bytes:
        import av

        samples = np.frombuffer(pcm, np.int16).reshape(1, -1)
        if not samples.size:
            return b""
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate, frame.pts = self._rate_hz, self._pts
        self._pts += samples.shape[1]
        self._graph.push(frame)
        return self._pull()

    def finish(self) -> bytes:
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> bytes:
        import av

        out = b""
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                return out
            out += frame.to_ndarray().astype(np.int16).tobytes()


def speech_usage(text: str, audio_s: float) -> dict[str, Any]:
    """speech.audio.done's usage in the fields OpenAI's SDK reads: tts counts no tokens, so characters of
    input, and milliseconds of audio out."""
    audio_ms = round(audio_s * 1000)
    return {"input_tokens": len(text), "output_tokens": audio_ms, "total_tokens": len(text) + audio_ms}
