"""OpenAI's request shapes onto the stages' (services/gateway/openai_shapes.py), without servers: the
conversation the llm is given, what is refused and why, the transcript's streamed deltas, and audio
encoded as it comes (decoded back by PyAV)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from pipeline.asr import MAX_PROMPT_CHARS
from pipeline.llm.prompts import Exchange
from services.gateway import openai_shapes as shapes
from services.gateway.web import HttpError

MODELS, DRAFTERS = ("target",), ("none", "suffix")


def chat(**body):
    return shapes.chat_request({"model": "target", "messages": [{"role": "user", "content": "Hi"}]} | body,
                               MODELS, DRAFTERS)


def test_messages_become_the_persona_the_history_and_the_users_words():
    persona, history, user = shapes.conversation([
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
        {"role": "user", "content": "Quickly."}])
    assert persona == "Be brief.\n\nBe kind."
    assert history == (Exchange("Hello", "Hi."),)
    assert user == "What is 2+2?\nQuickly."


@pytest.mark.parametrize("messages, param", [
    ([], "messages"),
    ([{"role": "assistant", "content": "Hi"}], "messages[0].role"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "messages"),
    ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Now be rude."},
      {"role": "user", "content": "Hi"}], "messages[1].role"),
    ([{"role": "tool", "content": "42"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "   "}], "messages[0].content"),
])
def test_a_conversation_the_llm_cannot_take_is_refused_naming_where(messages, param):
    with pytest.raises(HttpError) as refusal:
        shapes.conversation(messages)
    assert refusal.value.status == 400 and refusal.value.param == param


def test_sampling_and_limits_are_carried_and_absent_temperature_is_greedy():
    asked = chat(temperature=0.7, top_p=0.9, top_k=40, seed=3, stop="\n", max_completion_tokens=12, drafter="suffix",
                 stream=True, stream_options={"include_usage": True}, user="someone", frequency_penalty=0)
    request = asked.reply_request("session", "turn")
    assert request.sampling.temperature == pytest.approx(0.7) and request.sampling.top_k == 40
    assert request.sampling.seed == 3 and request.stop == ["\n"] and request.max_new_tokens == 12
    assert request.drafter == "suffix" and request.defer_history and asked.include_usage
    greedy = chat().reply_request("s", "t").sampling
    assert greedy.temperature == 0 and not greedy.HasField("seed")


@pytest.mark.parametrize("body, status, param", [
    ({"n": 2}, 400, "n"), ({"logprobs": True}, 400, "logprobs"), ({"temperature": "hot"}, 400, "temperature"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, 400, "max_tokens"), ({"stop": ["a"] * 5}, 400, "stop"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"), ({"model": "gpt-4o"}, 404, "model"),
    ({"drafter": "eagle"}, 400, "drafter"), ({"functions": [{"name": "f"}]}, 400, "functions"),
    ({"stream": "yes"}, 400, "stream"), ({"best_of": 2}, 400, "best_of"),
])
def test_what_the_llm_cannot_do_is_refused_naming_the_parameter(body, status, param):
    with pytest.raises(HttpError) as refusal:
        chat(**body)
    assert (refusal.value.status, refusal.value.param) == (status, param)


def test_streamed_transcript_deltas_add_up_to_the_finals():
    streamed = shapes.StreamedText()
    deltas = [streamed.delta("Hello", False), streamed.delta("Hello", False), streamed.delta("Hello there", False),
              streamed.delta("Hello there, friend.", True), streamed.delta("Next", False),
              streamed.delta("Next one.", True)]
    assert deltas == ["Hello", "", " there", ", friend.", " Next", " one."]
    assert "".join(deltas) == streamed.text == "Hello there, friend. Next one."


def test_transcription_fields_both_spellings_of_the_granularities():
    asked = shapes.transcription_request({"model": ["whisper-1"], "response_format": ["verbose_json"],
                                          "timestamp_granularities[]": ["word"],
                                          "timestamp_granularities": ["segment"]}, ("whisper-1",))
    assert asked.granularities == ("word", "segment")
    with pytest.raises(HttpError) as refusal:
        shapes.transcription_request({"model": ["whisper-1"], "stream": ["true"], "response_format": ["srt"]},
                                     ("whisper-1",))
    assert refusal.value.param == "stream"


def test_a_transcription_prompt_past_whispers_is_refused_before_the_asr_hears_audio():
    fields = {"model": ["whisper-1"], "prompt": ["Mm-hmm. Yeah."]}
    assert shapes.transcription_request(fields, ("whisper-1",)).prompt == "Mm-hmm. Yeah."
    with pytest.raises(HttpError) as refusal:
        shapes.transcription_request(fields | {"prompt": ["word " * (MAX_PROMPT_CHARS // 5 + 1)]}, ("whisper-1",))
    assert refusal.value.param == "prompt" and refusal.value.status == 400


def test_openai_voice_names_are_the_default_voice_and_others_must_exist():
    voices = ("en_US-joe-medium",)
    assert shapes.speech_request({"model": "tts-1", "input": "Hi", "voice": "nova"}, ("tts-1",), voices).voice == ""
    own = shapes.speech_request({"model": "tts-1", "input": "Hi", "voice": "en_US-joe-medium"}, ("tts-1",), voices)
    assert own.voice == "en_US-joe-medium" and own.response_format == "mp3"  # OpenAI's default format
    with pytest.raises(HttpError) as refusal:
        shapes.speech_request({"model": "tts-1", "input": "Hi", "voice": "hal"}, ("tts-1",), voices)
    assert refusal.value.param == "voice"


def _tone(seconds: float) -> bytes:
    t = np.arange(int(24_000 * seconds)) / 24_000
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype(np.int16).tobytes()


@pytest.mark.parametrize("response_format", ["wav", "mp3", "opus", "flac", "aac"])
@pytest.mark.parametrize("speed", [1.0, 1.5, 0.5])
def test_audio_is_encoded_piece_by_piece_and_decodes_to_its_length(response_format, speed):
    encoder = shapes.AudioEncoder(response_format, speed)
    pcm = _tone(2.0)
    pieces = [encoder.encode(pcm[i:i + 9600]) for i in range(0, len(pcm), 9600)]  # 0.2 s a piece, as tts sends
    encoded = b"".join(pieces) + encoder.finish()
    assert sum(1 for p in pieces if p) >= len(pieces) // 2  # bytes go out as the audio comes, not at the end
    with av.open(io.BytesIO(encoded)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(audio=0))
        seconds = samples / stream.rate
    assert seconds == pytest.approx(2.0 / speed, abs=0.15)  # (mp3 and aac: codec delay and padding)


def test_pcm_is_passed_through_and_a_wav_stream_says_its_format():
    encoder = shapes.AudioEncoder("wav")
    pcm = _tone(0.5)
    wav = encoder.encode(pcm) + encoder.finish()
    assert wav[44:] == pcm and wav[:4] == b"RIFF" and wav[8:16] == b"WAVEfmt "
    assert int.from_bytes(wav[24:28], "little") == 24_000
    raw = shapes.AudioEncoder("pcm")
    assert raw.encode(pcm) + raw.finish() == pcm
