"""The turn-taking state machine as plain Python: events and a fake clock in, actions out."""

from __future__ import annotations

import itertools

import pytest

from pipeline.turn_taking import (
    AnnounceFinal,
    AudioSent,
    CancelTurn,
    CaptionDone,
    ClientDone,
    ConfirmTurn,
    EndOfTurnScored,
    Final,
    InterruptPlayback,
    Partial,
    PausePlayback,
    PlaybackReported,
    RecordExchange,
    ReplyDone,
    ResumePlayback,
    ScoreEndOfTurn,
    SpeechStarted,
    StartCaption,
    StartTurn,
    Tick,
    TurnOver,
    TurnTaking,
    TurnTakingOptions,
    VoiceEnded,
    VoiceStarted,
    WordTimed,
)


class Talk:
    """A TurnTaking with a clock the test moves."""

    def __init__(self, **options) -> None:
        ids = (f"t{i}" for i in itertools.count())
        self.machine = TurnTaking(TurnTakingOptions(**options), new_turn_id=lambda: next(ids))
        self.now = 0.0

    def __call__(self, event, at: float | None = None) -> list:
        if at is not None:
            self.now = at
        return self.machine.handle(event, self.now)

    def speak_reply(self, turn_id: str, words: list[str], word_s: float = 0.5) -> list:
        """The reply's words are timed and all its audio sent, then llm and tts are done."""
        out = []
        for i, w in enumerate(words):
            out += self(WordTimed(turn_id, w, i * word_s, (i + 1) * word_s))
        out += self(AudioSent(turn_id, len(words) * word_s))
        return out + self(ReplyDone(turn_id, "eos"))


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def confirmed_turn(talk: Talk, text: str = "What is the capital of France?", utterance: int = 0,
                   score: float = 0.9) -> str:
    actions = talk(Final(utterance, text))
    start = of(actions, StartTurn)[0]
    assert of(actions, ScoreEndOfTurn) == [ScoreEndOfTurn(start.turn_id, text)]
    assert of(actions, AnnounceFinal) == [AnnounceFinal(start.turn_id, utterance)]
    assert of(talk(EndOfTurnScored(start.turn_id, score)), ConfirmTurn) == [ConfirmTurn(start.turn_id)]
    return start.turn_id


def test_a_complete_turn_is_confirmed_by_its_score_and_recorded_once_heard():
    talk = Talk()
    turn = confirmed_turn(talk)
    assert talk.machine.may_send_until_s(turn, talk.now) == pytest.approx(1.0)  # the lead before playback
    talk.speak_reply(turn, ["Paris", "is", "the", "capital."])
    assert talk.machine.audible(talk.now)
    assert of(talk(Tick(), at=1.9), TurnOver) == []  # 1.9 s of 2 s played
    actions = talk(Tick(), at=2.05)
    assert of(actions, RecordExchange) == [RecordExchange("What is the capital of France?",
                                                          "Paris is the capital.", cut_off=False)]
    over = of(actions, TurnOver)[0]
    assert (over.finish_reason, over.cut_off, over.end_of_turn_probability) == ("eos", False, 0.9)
    assert not talk.machine.audible(talk.now)


def test_a_low_score_waits_for_more_silence_and_speech_then_joins_the_turns():
    talk = Talk(end_of_turn_threshold=0.5, incomplete_wait_s=0.6)
    first = of(talk(Final(0, "Hello, can you tell me")), StartTurn)[0]
    assert of(talk(EndOfTurnScored(first.turn_id, 0.1), at=0.1), ConfirmTurn) == []
    actions = talk(SpeechStarted(1), at=0.4)  # the user goes on within the wait
    assert of(actions, CancelTurn) == [CancelTurn(first.turn_id)]
    assert of(actions, TurnOver)[0].finish_reason == "cancelled"
    second = of(talk(Final(1, "the time in Tokyo?"), at=1.5), StartTurn)[0]
    assert second.user_text == "Hello, can you tell me the time in Tokyo?"
    assert of(talk(EndOfTurnScored(second.turn_id, 0.8), at=1.55), ConfirmTurn) == [ConfirmTurn(second.turn_id)]


def test_a_low_score_confirms_after_the_wait():
    talk = Talk(end_of_turn_threshold=0.5, incomplete_wait_s=0.6)
    turn = of(talk(Final(0, "I was wondering")), StartTurn)[0].turn_id
    talk(EndOfTurnScored(turn, 0.05), at=0.05)
    assert of(talk(Tick(), at=0.55), ConfirmTurn) == []
    assert of(talk(Tick(), at=0.61), ConfirmTurn) == [ConfirmTurn(turn)]


def test_voice_heard_again_during_the_wait_holds_the_turn_until_it_is_decided():
    talk = Talk(end_of_turn_threshold=0.5, incomplete_wait_s=0.6)
    turn = of(talk(Final(0, "Hello,")), StartTurn)[0].turn_id
    talk(EndOfTurnScored(turn, 0.01), at=0.1)
    talk(VoiceStarted(), at=0.5)  # the user goes on; speech is not yet certain
    assert of(talk(Tick(), at=0.7), ConfirmTurn) == []  # the wait is over, but voice is heard
    assert of(talk(SpeechStarted(1), at=0.75), CancelTurn) == [CancelTurn(turn)]
    assert of(talk(Final(1, "can you tell me the time?"), at=2.0), StartTurn)[0].user_text == (
        "Hello, can you tell me the time?")
    # Voice that turns out to be noise lets the wait end.
    talk = Talk(end_of_turn_threshold=0.5, incomplete_wait_s=0.6)
    turn = of(talk(Final(0, "So")), StartTurn)[0].turn_id
    talk(VoiceStarted(), at=0.5)
    assert of(talk(Tick(), at=0.7), ConfirmTurn) == []
    assert of(talk(VoiceEnded(), at=0.8), ConfirmTurn) == [ConfirmTurn(turn)]


@pytest.mark.parametrize("said", ["Hello?", "Hello? Hello?", "Hey there,", "Excuse me.", "I have a question.",
                                  "I a question."])  # as whisper heard an espeak-ng voice say the last
def test_an_opening_alone_waits_for_more_silence_whatever_its_score(said):
    """After a history the model may score a lone "Hello?" as a whole message; the user is
    likely to go on ("Hello, … can you tell me"), so the turn waits `incomplete_wait_s`."""
    talk = Talk(end_of_turn_threshold=0.01, incomplete_wait_s=0.7)
    first = of(talk(Final(0, said)), StartTurn)[0]
    assert of(talk(EndOfTurnScored(first.turn_id, 0.9), at=0.1), ConfirmTurn) == []
    assert of(talk(SpeechStarted(1), at=0.5), CancelTurn) == [CancelTurn(first.turn_id)]  # it went on
    second = of(talk(Final(1, "can you tell me a fun fact about owls?"), at=2.5), StartTurn)[0]
    assert second.user_text == f"{said} can you tell me a fun fact about owls?"
    assert of(talk(EndOfTurnScored(second.turn_id, 0.9), at=2.6), ConfirmTurn) == [ConfirmTurn(second.turn_id)]
    # Said alone, it is answered once the wait is over.
    talk = Talk(end_of_turn_threshold=0.01, incomplete_wait_s=0.7)
    turn = of(talk(Final(0, said)), StartTurn)[0].turn_id
    talk(EndOfTurnScored(turn, 0.9), at=0.1)
    assert of(talk(Tick(), at=0.65), ConfirmTurn) == []
    assert of(talk(Tick(), at=0.71), ConfirmTurn) == [ConfirmTurn(turn)]


@pytest.mark.parametrize("said", ["Hello, how are you?", "Yes.", "Hi, what time is it?", "So what?",
                                  "I have a question about taxes."])
def test_more_than_an_opening_is_confirmed_by_its_score(said):
    talk = Talk(end_of_turn_threshold=0.01)
    confirmed_turn(talk, said, score=0.05)


def test_no_openers_lets_the_score_alone_decide():
    talk = Talk(end_of_turn_threshold=0.01, openers=())
    confirmed_turn(talk, "Hello?", score=0.05)


def test_a_threshold_of_zero_confirms_at_the_final():
    talk = Talk(end_of_turn_threshold=0.0)
    actions = talk(Final(0, "Hi"))
    assert of(actions, ConfirmTurn) == [ConfirmTurn(of(actions, StartTurn)[0].turn_id)]


def test_barge_in_pauses_then_interrupts_and_the_history_keeps_the_heard_words():
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["Paris", "is", "a", "lovely", "city", "by", "the", "Seine."])  # 4 s of audio
    pause = of(talk(VoiceStarted(), at=1.3), PausePlayback)
    assert pause == [PausePlayback(turn, pytest.approx(1.3))]
    assert talk.machine.may_send_until_s(turn, 1.4) == -1.0  # nothing more goes out while paused
    talk(SpeechStarted(1), at=1.45)
    actions = talk(Partial(1, "Actually, what about that", stable_ending=False), at=1.7)
    interrupt = of(actions, InterruptPlayback)[0]
    assert interrupt.heard_until_s == pytest.approx(1.3) and interrupt.heard_text == "Paris is"
    assert of(actions, RecordExchange) == [RecordExchange("What is the capital of France?", "Paris is", cut_off=True)]
    over = of(actions, TurnOver)[0]
    assert (over.finish_reason, over.cut_off, over.pauses, over.interrupts) == ("interrupted", True, 1, 1)
    assert of(actions, CancelTurn) == []  # llm and tts had finished; the client drops the audio
    nxt = of(talk(Final(1, "Actually, what about Spain?"), at=2.2), StartTurn)[0]
    assert nxt.user_text == "Actually, what about Spain?"  # the old question was answered, in part


def test_barge_in_while_the_reply_is_still_written_cancels_its_work():
    talk = Talk()
    turn = confirmed_turn(talk)
    talk(WordTimed(turn, "Paris", 0.0, 0.5))
    talk(AudioSent(turn, 0.6))
    talk(VoiceStarted(), at=0.3)
    actions = talk(Final(1, "Stop, tell me about Spain."), at=1.0)
    assert of(actions, CancelTurn) == [CancelTurn(turn)]
    assert of(actions, InterruptPlayback)[0].heard_text == ""  # 0.3 s played: "Paris" not yet heard
    assert of(actions, RecordExchange) == []
    assert of(actions, StartTurn)[0].user_text == "What is the capital of France? Stop, tell me about Spain."


@pytest.mark.parametrize("said", ["Yeah.", "mm-hmm", "Okay, okay.", "Right.", "Uh-huh.",
                                  "yeah yeah yeah yeah yeah", "ok ok ok ok ok", "Mmmmmm", "N M M", "mm-m-m",
                                  "Mm -hmm. Mm -hm. Mm -m -h."])
def test_a_backchannel_pauses_then_resumes_and_the_reply_completes(said):
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    assert of(talk(VoiceStarted(), at=0.8), PausePlayback)
    talk(SpeechStarted(1), at=0.9)
    assert of(talk(Partial(1, said, stable_ending=True), at=1.1), InterruptPlayback) == []
    resume = of(talk(Final(1, said), at=1.3), ResumePlayback)
    assert resume == [ResumePlayback(turn, pytest.approx(0.8), "backchannel")]
    assert of(talk(Tick(), at=2.4), TurnOver) == []  # 0.8 + 1.1 s played of 2 s
    over = of(talk(Tick(), at=2.6), TurnOver)[0]
    assert (over.finish_reason, over.heard_text, over.pauses, over.resumes) == ("eos", "One two three four.", 1, 1)


@pytest.mark.parametrize("said", ["Yeah, but what about Spain?", "Okay so tell me more about it",
                                  "right right so what now"])
def test_words_beyond_a_backchannel_interrupt(said):
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(VoiceStarted(), at=0.8)
    talk(SpeechStarted(1), at=0.9)
    actions = talk(Final(1, said), at=1.5)
    assert of(actions, InterruptPlayback) and of(actions, StartTurn)[0].user_text == said


@pytest.mark.parametrize("heard", [(("And", 0.43),), (("in", 0.3), ("a", 0.3), ("month", 0.3))])
def test_words_the_asr_is_unsure_of_are_noise(heard):
    said = " ".join(w for w, _ in heard)
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(VoiceStarted(), at=0.8)
    talk(SpeechStarted(1), at=0.9)
    assert of(talk(Partial(1, said, stable_ending=False), at=1.0), InterruptPlayback) == []  # short: the final decides
    actions = talk(Final(1, said, heard), at=1.3)
    assert of(actions, ResumePlayback)[0].reason == "noise" and of(actions, StartTurn) == []


# Whisper tiny's finals for the Piper voice's "Mm-hmm." said over the avatar (bench e2e, 4 sessions).
@pytest.mark.parametrize("heard", [((" mm", 0.0), (" in", 0.3), (" a", 0.71), (" moment.", 0.39)),
                                   ((" mm-h.", 0.5), (" mm-h.", 0.6), (" in", 0.2), (" mm-", 0.5))])
def test_a_murmur_whose_only_sure_words_ask_for_nothing_resumes(heard):
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(VoiceStarted(), at=0.8)
    talk(SpeechStarted(1), at=0.9)
    actions = talk(Final(1, "".join(w for w, _ in heard), heard), at=1.3)
    assert of(actions, ResumePlayback)[0].reason == "backchannel" and of(actions, StartTurn) == []


# Real interruptions as whisper tiny heard them (bench/e2e voices): one sure word takes the floor.
@pytest.mark.parametrize("heard", [((" Stop.", 0.52),), ((" Hold", 0.11), (" on.", 0.98)), ((" No", 0.58),),
                                   ((" Wait,", 0.41), (" what?", 0.8))])
def test_one_sure_word_that_is_no_backchannel_interrupts(heard):
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(VoiceStarted(), at=0.8)
    talk(SpeechStarted(1), at=0.9)
    actions = talk(Final(1, "".join(w for w, _ in heard).strip(), heard), at=1.3)
    assert of(actions, InterruptPlayback) and of(actions, StartTurn)


def test_a_backchannel_after_its_pause_was_resumed_is_still_no_turn():
    """Voice in two bursts ("mm" … "hmm"): each burst's pause resumed on its own, then the final."""
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(VoiceStarted(), at=0.8)
    talk(VoiceEnded(), at=0.9)
    actions = talk(Final(1, "Mm-hmm.", (("Mm-hmm.", 0.7),)), at=1.2)
    assert of(actions, InterruptPlayback) == [] and of(actions, StartTurn) == []
    assert of(talk(Tick(), at=2.2), TurnOver)[0].finish_reason == "eos"


def test_a_long_partial_interrupts_before_the_final():
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(VoiceStarted(), at=0.8)
    assert of(talk(Partial(1, "Stop, what is the capital", stable_ending=False), at=1.2), InterruptPlayback)


def test_noise_pauses_then_resumes():
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two."])
    assert of(talk(VoiceStarted(), at=0.2), PausePlayback)
    assert of(talk(VoiceEnded(), at=0.35), ResumePlayback)[0].reason == "noise"
    talk(VoiceStarted(), at=0.5)
    talk(SpeechStarted(1), at=0.6)
    assert of(talk(Final(1, ""), at=0.9), ResumePlayback)[0].reason == "noise"  # whisper heard no words
    assert talk.machine.counts.pauses == 2 and talk.machine.counts.resumes == 2


def test_a_pause_nothing_decides_resumes_after_pause_max():
    talk = Talk(pause_max_s=2.0)
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two."])
    talk(VoiceStarted(), at=0.2)
    assert of(talk(Tick(), at=2.3), ResumePlayback) == [ResumePlayback(turn, pytest.approx(0.2), "noise")]


def test_no_pause_when_the_avatar_is_silent():
    talk = Talk()
    assert talk(VoiceStarted()) == []
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["Hi."])
    talk(Tick(), at=0.6)  # heard: the turn is over
    assert talk(VoiceStarted(), at=0.7) == []


def test_speech_before_any_audio_carries_the_words_into_the_next_turn():
    talk = Talk()
    turn = confirmed_turn(talk, "Good morning to you,")
    actions = talk(SpeechStarted(1), at=0.3)
    assert of(actions, CancelTurn) == [CancelTurn(turn)] and of(actions, PausePlayback) == []
    start = of(talk(Final(1, "my friend."), at=1.0), StartTurn)[0]
    assert start.user_text == "Good morning to you, my friend."


def test_preemption_kept_when_the_final_agrees_and_dropped_when_not():
    talk = Talk()
    early = of(talk(Partial(0, "What is the capital of France?", stable_ending=True)), StartTurn)[0]
    assert early.preemptive
    assert talk(Partial(0, "What is the capital of France?", stable_ending=True)) == []  # one per utterance
    actions = talk(Final(0, "what is the capital of france"), at=0.1)
    assert of(actions, StartTurn) == [] and of(actions, AnnounceFinal) == [AnnounceFinal(early.turn_id, 0)]
    assert of(talk(EndOfTurnScored(early.turn_id, 0.9)), ConfirmTurn) == [ConfirmTurn(early.turn_id)]

    talk = Talk()
    early = of(talk(Partial(0, "What is the capital", stable_ending=True)), StartTurn)[0]
    actions = talk(Final(0, "What is the capital of Spain?"), at=0.1)
    dropped = of(actions, TurnOver)[0]
    assert (dropped.turn_id, dropped.preemption, dropped.finish_reason) == (early.turn_id, "dropped", "cancelled")
    assert of(actions, StartTurn)[0].user_text == "What is the capital of Spain?"
    assert talk.machine.counts.preemptions_dropped == 1


def test_playback_reports_move_the_heard_position():
    talk = Talk()
    turn = confirmed_turn(talk)
    talk.speak_reply(turn, ["One", "two", "three", "four."])
    talk(PlaybackReported(turn, 0.3), at=1.5)  # the client started late: it is at 0.3 s
    assert talk.machine.position_s(turn, 1.5) == pytest.approx(0.3)
    talk(VoiceStarted(), at=1.6)
    actions = talk(Final(1, "Wait, no."), at=2.0)
    assert of(actions, InterruptPlayback)[0].heard_text == ""  # paused at 0.4 s: "One" ends at 0.5
    assert of(actions, StartTurn)[0].user_text == "What is the capital of France? Wait, no."


def test_audio_is_paced_ahead_of_playback():
    talk = Talk(audio_lead_s=1.0)
    turn = confirmed_turn(talk)
    talk(AudioSent(turn, 0.2))
    assert talk.machine.may_send_until_s(turn, talk.now) == pytest.approx(1.0)
    assert talk.machine.may_send_until_s(turn, talk.now + 2.0) == pytest.approx(1.2)  # only 0.2 s exists to play
    assert talk.machine.may_send_until_s("other", talk.now) == -1.0
    talk(ClientDone())
    assert talk.machine.may_send_until_s(turn, talk.now) == float("inf")


def test_an_unconfirmed_turn_sends_nothing():
    talk = Talk(end_of_turn_threshold=0.5)
    turn = of(talk(Final(0, "So")), StartTurn)[0].turn_id
    assert talk.machine.may_send_until_s(turn, talk.now) == -1.0


def test_caption_mode_captions_each_final_and_never_pauses():
    ids = iter(["c0", "c1"])
    machine = TurnTaking(caption_mode=True, new_turn_id=lambda: next(ids))
    assert machine.handle(Final(0, "um so the meeting is at ten"), 0.0) == [
        StartCaption("c0", 0, "um so the meeting is at ten")]
    assert machine.handle(SpeechStarted(1), 0.5) == [] and machine.handle(VoiceStarted(), 0.5) == []
    assert machine.handle(Final(1, ""), 1.0) == []


def test_a_caption_turn_ends_through_the_machine_once():
    ids = iter(["c0", "c1"])
    machine = TurnTaking(caption_mode=True, new_turn_id=lambda: next(ids))
    machine.handle(Final(0, "the meeting is at ten"), 0.0)
    machine.handle(Final(1, "bring the slides"), 0.5)
    [over] = machine.handle(CaptionDone("c1", "error"), 1.0)
    assert (over.turn_id, over.finish_reason, over.heard_text, over.end_of_turn_probability) == (
        "c1", "error", "", -1.0)
    assert [a.finish_reason for a in machine.handle(CaptionDone("c0", ""), 1.1)] == ["eos"]  # no reason: eos
    assert machine.handle(CaptionDone("c0", "eos"), 1.2) == []  # over already
    assert machine.handle(CaptionDone("never-started", "eos"), 1.3) == []
