"""Conversions between the gateway's protobuf messages and what a conversation works with:
client messages in, transcripts, cues, captions and turn reports out, and the stage requests
a turn sends. Pure functions: no I/O."""

from __future__ import annotations

from typing import Any

from pipeline.caption_style import CueStyle, broadcast_cues, placed_after
from pipeline.captions import (
    Cue,
    align_caption,
    srt_document,
    webvtt_block,
    webvtt_document,
)
from pipeline.turn_taking import PlaybackReported
from services.gateway.ports import ClientAudio, ClientInput
from services.protos import load, load_common

pb, _ = load("gateway")
asr_pb, _ = load("asr")
llm_pb, _ = load("llm")
tts_pb, _ = load("tts")
common = load_common()
Config = pb.SessionConfig


def client_input(message: Any) -> ClientInput:
    """A Converse message after the start: audio or a playback report."""
    kind = message.WhichOneof("payload")
    if kind == "audio":
        return ClientAudio(message.audio)
    if kind == "playback":
        return PlaybackReported(message.playback.turn_id, message.playback.played_until_s)
    raise ValueError("only audio and playback reports may follow the start message")


def caption_cue(c: Cue) -> Any:
    """A cue as the protos carry it: a broadcast cue's lines joined by a line break."""
    return common.CaptionCue(start_s=c.start_s, end_s=c.end_s, text="\n".join(c.shown_lines), webvtt=webvtt_block(c))


def speech_cue(cue: Any) -> Any:
    """A tts cue or word with its WebVTT block filled in."""
    out = common.CaptionCue()
    out.CopyFrom(cue)
    out.webvtt = webvtt_block(Cue(cue.start_s, cue.end_s, cue.text))
    return out


def transcript(event: Any, final: bool) -> Any:
    """An asr TranscriptEvent as the gateway's Transcript (a final with its word cues)."""
    cues = [caption_cue(c) for c in broadcast_cues([event.words])] if final else []
    return pb.Transcript(
        is_final=final, text=event.text, words=event.words, speech_start_s=event.speech_start_s,
        speech_end_s=event.speech_end_s, committed_text=event.committed_text,
        tentative_text=event.tentative_text, stability=event.stability,
        utterance_index=event.utterance_index, cues=cues,
    )


def caption(text: str, words: list, config: Any, style: CueStyle, earliest_s: float = 0.0) -> Any:
    """The cleaned text placed on the input's timeline by the ASR's word times, in broadcast-style cues no
    earlier than `earliest_s` (the session's captions so far end there), and the documents asked for."""
    cues = align_caption(text, words)
    lines = placed_after(broadcast_cues([cues], style), earliest_s, style)
    formats = set(config.caption_formats)
    return pb.Caption(
        text=text, cues=[caption_cue(c) for c in cues], lines=[caption_cue(c) for c in lines],
        webvtt=webvtt_document(lines) if Config.WEBVTT in formats else "",
        srt=srt_document(lines) if Config.SRT in formats else "")


def provisional_caption(utterance_index: int, committed_words: list, style: CueStyle) -> Any:
    """The words the ASR has committed so far in an utterance, timed as spoken (they are not cleaned yet)."""
    cues = [Cue(w.start_s, w.end_s, w.text.strip()) for w in committed_words]
    text = " ".join(c.text for c in cues)
    return pb.Caption(text=text, cues=[caption_cue(c) for c in cues],
                      lines=[caption_cue(c) for c in broadcast_cues([cues], style)], provisional=True,
                      utterance_index=utterance_index)


def turn_budget(config: Any, speech_end_unix_ms: int) -> Any:
    return common.TurnBudget(budget_ms=config.budget_ms, speech_end_unix_ms=speech_end_unix_ms,
                             deadline_unix_ms=speech_end_unix_ms + config.budget_ms)


def reply_request(config: Any, session_id: str, turn_id: str, user_text: str, speech_end_unix_ms: int,
                  mode: str) -> Any:
    """The llm's work on a turn: a dialogue reply (its history written once heard) or a caption."""
    budget = turn_budget(config, speech_end_unix_ms)
    if mode == "caption":
        return llm_pb.ReplyRequest(session_id=session_id, turn_id=turn_id, user_text=user_text,
                                   task=llm_pb.ReplyRequest.CAPTION, budget=budget)  # its drafter: the transcript
    request = llm_pb.ReplyRequest(
        session_id=session_id, turn_id=turn_id, user_text=user_text, task=llm_pb.ReplyRequest.DIALOGUE,
        defer_history=True, max_new_tokens=config.max_reply_tokens, drafter=config.drafter,
        system_prompt=config.system_prompt, budget=budget)
    if config.HasField("sampling"):
        request.sampling.CopyFrom(config.sampling)
    return request


def speak_request(config: Any, session_id: str, turn_id: str, speech_end_unix_ms: int) -> Any:
    return tts_pb.SpeakTurnRequest(session_id=session_id, turn_id=turn_id, sample_rate_hz=config.reply_sample_rate_hz,
                                   voice=config.voice, budget=turn_budget(config, speech_end_unix_ms))


def turn_report(work: Any, over: Any, config: Any, session_budget_misses: int, session_degradations: int) -> Any:
    """The TurnReport of a finished turn: its times, what was heard, the conversation's counts.

    `work` is the conversation's TurnWork, `over` the machine's TurnOver."""
    counts = over.counts
    degradations = [pb.Degradation(name=name, stage=s.stage) for s in work.stage_times for name in s.degradations]
    return pb.TurnReport(
        transcript=work.user_text, reply_text=work.reply_text.strip(), speech_end_s=work.transcript.speech_end_s,
        speech_end_unix_ms=work.speech_end_unix_ms, first_audio_sent_unix_ms=work.first_audio_sent_unix_ms,
        stages=[*work.stage_times, work.clock.to_proto(common.StageTimes)], budget_ms=config.budget_ms,
        finish_reason=over.finish_reason, error=work.error, preemption=over.preemption,
        preemptions_kept=counts.preemptions_kept, preemptions_dropped=counts.preemptions_dropped,
        heard_text=over.heard_text, cut_off=over.cut_off, budget_missed=work.budget_missed, degradations=degradations,
        pauses=over.pauses, resumes=over.resumes, interrupts=over.interrupts, session_pauses=counts.pauses,
        session_resumes=counts.resumes, session_interrupts=counts.interrupts,
        session_budget_misses=session_budget_misses, session_degradations=session_degradations,
        end_of_turn_probability=over.end_of_turn_probability, mode=work.mode,
        prefix_cached_tokens=work.prefix_cached_tokens, end_of_turn_ms=work.end_of_turn_ms,
    )
