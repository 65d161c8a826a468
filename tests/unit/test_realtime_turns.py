"""The turn-taking machine's events for client-driven turns (the Realtime API's typed items, commits,
`response.create` and `response.cancel`), as plain Python with a fake clock, in the style of
tests/unit/test_turn_taking.py."""

from __future__ import annotations

from pipeline.turn_taking import (
    REQUESTED_UTTERANCE,
    CancelTurn,
    ConfirmTurn,
    EndOfTurnScored,
    Final,
    InterruptPlayback,
    RecordExchange,
    ReplyCancelled,
    ReplyRequested,
    ScoreEndOfTurn,
    StartTurn,
    Tick,
    TurnOver,
    UserSaid,
    heard_text,
)
from tests.unit.test_turn_taking import Talk


def kinds(actions: list) -> list[type]:
    return [type(a) for a in actions]


def test_a_requested_reply_answers_the_typed_words_confirmed_at_once_without_a_score():
    talk = Talk()
    assert talk(UserSaid("What time is it?")) == []
    actions = talk(ReplyRequested())
    assert kinds(actions) == [StartTurn, ConfirmTurn]
    start = actions[0]
    assert (start.user_text, start.utterance, start.preemptive) == ("What time is it?", REQUESTED_UTTERANCE, False)
    assert not any(isinstance(a, ScoreEndOfTurn) for a in actions)


def test_words_said_before_a_request_join_in_order():
    talk = Talk()
    talk(UserSaid("My name is Anna."))
    talk(UserSaid("  What is mine?  "))
    [start, _] = talk(ReplyRequested())
    assert start.user_text == "My name is Anna. What is mine?"


def test_a_request_over_a_playing_reply_interrupts_it_keeping_what_was_heard():
    talk = Talk()
    talk(UserSaid("Tell me a story."))
    [first, _] = talk(ReplyRequested())
    talk.speak_reply(first.turn_id, ["Once", "upon", "a", "time"])
    talk(Tick(), at=1.2)  # "Once upon" heard (0.5 s a word)
    talk(UserSaid("Shorter, please."))
    actions = talk(ReplyRequested())
    interrupt = next(a for a in actions if isinstance(a, InterruptPlayback))
    assert interrupt.heard_text == "Once upon"
    assert RecordExchange("Tell me a story.", "Once upon", cut_off=True) in actions
    over = next(a for a in actions if isinstance(a, TurnOver))
    assert (over.turn_id, over.finish_reason) == (first.turn_id, "interrupted")
    new = next(a for a in actions if isinstance(a, StartTurn))
    assert new.user_text == "Shorter, please."  # the old words were answered (heard in part)


def test_cancelling_a_reply_not_yet_heard_leaves_its_words_unanswered():
    talk = Talk()
    talk(UserSaid("What time is it?"))
    [first, _] = talk(ReplyRequested())
    actions = talk(ReplyCancelled())
    assert kinds(actions) == [CancelTurn, TurnOver] and actions[1].finish_reason == "cancelled"
    talk(UserSaid("And the date?"))
    [again, _] = talk(ReplyRequested())
    assert again.user_text == "What time is it? And the date?"


def test_cancelling_a_playing_reply_is_an_interruption_at_the_heard_position():
    talk = Talk()
    talk(UserSaid("Count to four."))
    [start, _] = talk(ReplyRequested())
    talk.speak_reply(start.turn_id, ["One,", "two,", "three,", "four."])
    actions = talk(ReplyCancelled(), at=1.05)
    assert next(a for a in actions if isinstance(a, InterruptPlayback)).heard_text == "One, two,"
    assert talk(ReplyCancelled()) == []  # nothing left to cancel


def test_a_voice_final_after_typed_words_answers_both():
    talk = Talk()
    talk(UserSaid("I am in Paris."))
    actions = talk(Final(0, "What should I see?"))
    start = next(a for a in actions if isinstance(a, StartTurn))
    assert start.user_text == "I am in Paris. What should I see?"


def test_heard_text_counts_a_word_heard_once_played_less_the_slack():
    from pipeline.turn_taking import WordTimed

    words = [WordTimed("t", "Sure,", 0.0, 0.4), WordTimed("t", "it", 0.5, 0.9)]
    assert heard_text(words, 0.36) == "Sure,"
    assert heard_text(words, 0.3) == ""
    assert heard_text(words, float("inf")) == "Sure, it"


def test_without_start_turns_a_final_waits_for_the_clients_request():
    talk = Talk(start_turns=False)
    assert talk(Final(0, "What time is it?")) == []
    [start, _] = talk(ReplyRequested())
    assert start.user_text == "What time is it?"


def test_without_interruptions_speech_over_the_avatar_neither_pauses_nor_interrupts_it():
    from pipeline.turn_taking import Partial, SpeechStarted, VoiceStarted

    talk = Talk(interruptions=False)
    [start, *_] = talk(Final(0, "Tell me a story."))
    talk(EndOfTurnScored(start.turn_id, 0.9))
    talk.speak_reply(start.turn_id, ["Once", "upon", "a", "time"])
    talk(Tick(), at=1.0)
    assert talk(VoiceStarted()) == [] and talk(SpeechStarted(1)) == []
    assert talk(Partial(1, "wait wait tell me about dragons", False)) == []
    assert talk(Final(1, "Wait, tell me about dragons.")) == []  # no interrupt, no new turn over the reply
    over = [a for a in talk(Tick(), at=2.5) if isinstance(a, TurnOver)]
    assert [(o.turn_id, o.finish_reason) for o in over] == [(start.turn_id, "eos")]
    [again, _] = talk(ReplyRequested())
    assert again.user_text == "Wait, tell me about dragons."  # the words wait for the next reply
