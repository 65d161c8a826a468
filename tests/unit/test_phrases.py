from pipeline.captions import Cue, webvtt_document
from pipeline.tts.phrases import PhraseCutter, PhraseOptions


def feed_words(cutter: PhraseCutter, text: str) -> list[str]:
    out: list[str] = []
    for word in text.split(" "):
        out += cutter.feed(word + " ")
    return out + cutter.flush()


def test_first_phrase_is_cut_at_the_first_clause_later_ones_at_sentences():
    phrases = feed_words(PhraseCutter(), "Well, I think so, and honestly it is fine. Then again, maybe not. Bye")
    assert phrases == ["Well, I think so,", "and honestly it is fine.", "Then again, maybe not.", "Bye"]


def test_first_phrase_is_emitted_before_the_reply_ends():
    cutter = PhraseCutter()
    assert cutter.feed("Hello there") == []
    assert cutter.feed(", my friend") == ["Hello there,"]


def test_abbreviations_and_initials_do_not_end_a_sentence():
    phrases = feed_words(PhraseCutter(PhraseOptions(first_phrase_min_chars=1)),
                         "Hi. Dr. Smith met J. Doe at noon. Done.")
    assert phrases == ["Hi.", "Dr. Smith met J. Doe at noon.", "Done."]


def test_a_long_first_clause_is_capped_at_a_word_boundary():
    cutter = PhraseCutter(PhraseOptions(first_phrase_max_chars=30))
    phrases = cutter.feed("one two three four five six seven eight nine ten eleven")
    assert phrases and len(phrases[0]) <= 30 and not phrases[0].endswith(("tw", "thre"))


def test_line_breaks_end_phrases_and_never_reach_a_phrase():
    phrases = feed_words(PhraseCutter(), "Sure, here are some:\n\n1. Dune\n2. Emma. That is all")
    assert phrases == ["Sure, here are some:", "1. Dune", "2. Emma.", "That is all"]
    assert all("\n" not in p for p in phrases)


def test_cue_text_is_made_valid_webvtt():
    doc = webvtt_document([Cue(0.0, 1.0, "one\n\ntwo --> three")])
    assert "one two -> three" in doc


def test_punctuation_only_text_is_not_spoken():
    assert feed_words(PhraseCutter(), "... !!! ,,,") == []


def test_webvtt_document_lists_cues_in_order():
    doc = webvtt_document([Cue(0.0, 1.25, "Hello there,"), Cue(1.25, 3.0, "how are you?")])
    assert doc.startswith("WEBVTT")
    assert "00:00:00.000 --> 00:00:01.250\nHello there," in doc
    assert "00:00:01.250 --> 00:00:03.000\nhow are you?" in doc


def test_the_first_phrase_is_a_clause_or_a_few_words_whichever_comes_first():
    assert feed_words(PhraseCutter(), "The capital of France is Paris, a lovely city.") == [
        "The capital of France is", "Paris, a lovely city."]
    assert feed_words(PhraseCutter(), "Oh, I see what you mean.") == ["Oh, I see what you", "mean."]
    assert feed_words(PhraseCutter(), "Sure thing, here it is.") == ["Sure thing,", "here it is."]
    assert feed_words(PhraseCutter(PhraseOptions(first_phrase_max_words=0)), "The capital of France is Paris.") == [
        "The capital of France is Paris."]


def test_a_late_turn_cuts_its_first_phrase_after_three_words():
    cutter = PhraseCutter()
    assert cutter.feed("Well I ") == []
    assert cutter.hurry() and cutter.hurried
    assert cutter.feed("think ") == ["Well I think"]
    assert not cutter.hurry()  # the first phrase is out: nothing left to hurry
    assert cutter.feed("that is right. ") == ["that is right."]
