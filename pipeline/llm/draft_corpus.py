"""The prompt corpus a draft head is trained on: made here, offline, from templates × topics × styles.

A trained draft head (pipeline/llm/draft_head.py) learns to predict what the target says,
so its training text is the target's own replies (pipeline/llm/train_draft.py) to prompts
like those the service answers: dialogue turns under the avatar's persona (some after an
earlier exchange, some under another persona) and caption requests (rewrite a spoken
transcript, shorten an announcement, repeat a sentence, simplify or correct one). None
of it is a benchmark prompt: `overlapping` finds a corpus prompt that shares a run of
`OVERLAP_WORDS` words with one, and train_draft refuses to train on such a corpus.

`build_corpus(n, seed)` draws n distinct prompts, the same ones for the same seed.

Templates give a narrow spread of prompts, and a head trained on replies to them drafted far
worse on other questions (1.55 tokens a pass on the benchmark's dialogue prompts against 2.55
on held-out templated ones). So a corpus can also hold user turns the target writes itself
(Magpie, Xu et al. 2024, arXiv 2406.08464: an instruction-tuned model, given a chat's system
turn and an open user turn, writes what users say to it); train_draft samples them and
`usable_user_turn` keeps the ones that read as a turn.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline.llm.prompts import CAPTION_INSTRUCTION, DEFAULT_PERSONA, Exchange, Task, chat_messages

OVERLAP_WORDS = 6  # a shared run of this many words with a benchmark prompt is an overlap

TOPICS = (
    "growing tomatoes on a balcony", "baking sourdough bread", "learning the guitar", "saving money for a trip",
    "the history of the bicycle", "volcanoes", "the deep ocean", "solar panels", "electric cars",
    "learning a second language", "chess openings", "writing a short story", "public speaking",
    "the first airplanes", "making coffee at home", "training a puppy", "keeping fish in an aquarium",
    "the rainforest", "desert animals", "how rainbows form", "the northern lights", "the pyramids of Egypt",
    "ancient Rome", "the printing press", "recycling plastic", "composting kitchen scraps", "hiking in the mountains",
    "swimming technique", "stretching after exercise", "drinking enough water", "cooking rice",
    "making a budget", "job interviews", "working from home", "time management", "planning a wedding",
    "moving to a new city", "making new friends", "photography for beginners", "drawing faces",
    "painting with watercolors", "knitting a scarf", "fixing a flat tire", "building a birdhouse",
    "the solar system", "Mars", "the international space station", "dinosaurs", "the human heart",
    "how vaccines work", "the immune system", "why we dream", "memory and learning", "meditation",
    "yoga for beginners", "jazz music", "classical music", "playing the piano", "singing in a choir",
    "the Olympic games", "football tactics", "basketball", "tennis", "cycling to work", "marathon training",
    "electric guitars", "video games", "board games", "card tricks", "magic shows", "the circus",
    "trains", "sailing", "lighthouses", "bridges", "skyscrapers", "castles", "museums", "libraries",
    "ice cream", "chocolate", "tea", "spicy food", "vegetarian cooking", "making pancakes", "pizza dough",
    "soup on a cold day", "picnics", "birthday parties", "holidays by the sea", "snow", "thunderstorms",
    "autumn leaves", "spring flowers", "honeybees' cousins, the wasps", "butterflies", "owls", "penguins",
    "elephants", "dolphins", "octopuses", "sharks", "horses", "rabbits as pets", "parrots",
    "the internet", "smartphones", "robots", "artificial intelligence", "passwords and online safety",
    "email etiquette", "spreadsheets", "learning to type faster", "3D printing", "drones",
    "the moon landing", "ancient Greece", "the Vikings", "the Silk Road", "maps and navigation",
    "clocks and time zones", "calendars", "money and coins", "banks", "the stock market", "taxes",
    "voting", "volunteering", "kindness", "gratitude", "staying motivated", "dealing with stress",
    "a morning routine", "tidying a small room", "houseguests", "neighbors", "grandparents",
    "teenagers and phones", "homework", "exams", "university life", "choosing a career",
    "starting a small business", "selling things online", "cooking for a crowd", "table manners",
)

QUESTIONS = (
    "What do you know about {topic}?", "Can you give me a quick tip about {topic}?",
    "I'm curious about {topic}. Where should I start?", "Explain {topic} in simple words.",
    "What is one surprising fact about {topic}?", "Why do so many people enjoy {topic}?",
    "How would you describe {topic} to a friend?", "Do you have any advice on {topic}?",
    "What's the story behind {topic}?", "Is {topic} hard to get into?",
    "What are common mistakes people make with {topic}?", "Tell me a fun little story about {topic}.",
    "My friend keeps talking about {topic}. What's so special about it?",
    "Could you say a few words about {topic}?", "What should a total beginner know about {topic}?",
    "I have five minutes. Teach me something about {topic}.", "What's your opinion on {topic}?",
    "Give me two ideas related to {topic}.", "How has {topic} changed over the years?",
    "What would a child find exciting about {topic}?", "Any quick thoughts on {topic}?",
    "I just got interested in {topic}. Is that a good hobby?", "What is the hardest part of {topic}?",
    "Why does {topic} matter?", "Can you make {topic} sound fun?",
)

STYLES = ("", "", "", " Keep it short, please.", " Just one sentence.", " Explain it like I'm seven.",
          " Give me an example.", " Be cheerful about it.", " Make it quick, I'm in a hurry.",
          " Please be honest.", " Use simple words.")

SMALL_TALK = (
    "Good morning! Did you sleep well?", "I'm feeling a little tired today.", "Thanks for your help earlier.",
    "What's your favorite color, and why?", "Do you like music?", "It's raining here. What's the weather like "
    "where you are?", "I just finished a long day at work.", "Can you cheer me up a bit?",
    "What do you do for fun?", "I'm bored. Any ideas?", "Do you ever get tired of talking?",
    "Tell me about yourself.", "What's the nicest thing someone could say today?", "I passed my driving test!",
    "I lost my keys again.", "My cat knocked a glass off the table.", "I can't decide what to eat for dinner.",
    "Say hi to my little brother, he's right here.", "I have an exam tomorrow and I'm nervous.",
    "Good evening! How are you feeling tonight?", "What's a good way to start the weekend?",
    "Can you tell me a riddle?", "Do you know any tongue twisters?", "What should I name my new plant?",
    "I'm learning to cook. Wish me luck!", "It's my friend's birthday today.", "Are you a real person?",
    "What makes a good conversation?", "I think I need a holiday.", "Can we talk about something happy?",
)

PERSONAS = (
    DEFAULT_PERSONA, DEFAULT_PERSONA, DEFAULT_PERSONA, DEFAULT_PERSONA,
    "You are a cheerful museum guide avatar. Answer visitors in one to three short spoken sentences.",
    "You are a patient cooking assistant on a kitchen screen. Speak in short, clear sentences.",
    "You are a friendly language tutor. Reply in simple English, one to three sentences.",
    "You are a calm customer service avatar for a train company. Keep answers short and polite.",
)

EARLIER = (
    Exchange("Hi, can you hear me?", "Yes, I can hear you clearly. How can I help?"),
    Exchange("What's your name?", "I'm your friendly avatar. It's nice to meet you!"),
    Exchange("I'm planning my week.", "That sounds like a good idea. What's on your list?"),
    Exchange("Let's chat for a while.", "I'd love to. What's on your mind?"),
    Exchange("I had pasta for lunch.", "Pasta is a great choice. Was it tasty?"),
)

# Caption requests: spoken transcripts (fillers, repeats, numbers as words) and written lines.
SPEAKERS = ("so", "okay so", "um", "uh", "alright", "well", "right so", "so basically", "and", "yeah so")
SUBJECTS = ("the team", "our school", "the city council", "my neighbor", "the new manager", "the weather service",
            "the museum", "our family", "the bakery down the street", "the football club", "the hospital",
            "the science class", "the band", "the airline", "the local library", "our company")
ACTIONS = (
    "is planning a big event for next saturday", "decided to open an hour earlier starting in june",
    "has raised about fifteen thousand dollars for the new playground", "will be closed on monday for repairs",
    "wants everyone to bring their own cup from now on", "just hired three new people for the summer",
    "is looking for volunteers to help with the cleanup", "moved the concert to the big hall upstairs",
    "says the storm should pass by tomorrow afternoon", "is testing a new app for booking appointments",
    "finished painting the whole building in two weeks", "changed the bus timetable for the winter",
    "is giving free lessons every thursday evening", "sold out all the tickets in less than an hour",
    "found a small problem with the heating system", "is collecting old books for a charity sale",
)
TAILS = ("", " you know", " and uh yeah", " so that's that", " I think", " which is pretty cool", " or something like "
         "that", " if I remember right", " um anyway")
CAPTION_REQUESTS = (
    CAPTION_INSTRUCTION, CAPTION_INSTRUCTION, "Turn this spoken sentence into a tidy subtitle: ",
    "Clean up this speech for on-screen text: ", "Write this as a neat caption without the filler words: ",
)
WRITTEN_REQUESTS = (
    "Shorten this announcement into one caption line: ", "Say this back word for word, then add 'got it': ",
    "Make this sentence easier to understand: ", "Correct the mistakes in this sentence: ",
)
NOTICES = (
    "The swimming pool will reopen next week after the new filters have been installed.",
    "Our opening hours change on Sunday, when the shop will close at four in the afternoon.",
    "Visitors are asked to leave their bags at the front desk before entering the gallery.",
    "The school trip to the science centre is on Friday, and lunch will be provided for everyone.",
    "Road works on the bridge mean that buses will take a longer route for the next ten days.",
    "The concert in the park has been moved indoors because of the strong wind forecast.",
    "Members can now borrow up to twelve books at a time, and keep them for three weeks.",
    "The lift on the east side is out of order, so please use the stairs or the west lift.",
)
ERRORS = (
    "me and him goes to the market every sundays", "the childrens was playing in the garden all day",
    "she have three cat and a dog what barks loud", "we was late because the train were delayed",
    "he don't like vegetables but he eat them anyway", "there is many reasons why I likes this city",
)


@dataclass(frozen=True)
class CorpusPrompt:
    """One prompt: the messages it becomes (`messages(tokenizer)` in the project's chat template)."""

    task: Task
    user_text: str
    persona: str = DEFAULT_PERSONA
    history: tuple[Exchange, ...] = ()

    def messages(self) -> list[dict[str, str]]:
        return chat_messages(self.task, self.user_text, self.persona, self.history)


def _transcript(rng: random.Random) -> str:
    subject = rng.choice(SUBJECTS)
    words = f"{rng.choice(SPEAKERS)} {subject} {rng.choice(ACTIONS)}{rng.choice(TAILS)}".split()
    if rng.random() < 0.4:  # a stutter: one word said twice
        i = rng.randrange(len(words))
        words.insert(i, words[i])
    return " ".join(words)


def _dialogue(rng: random.Random) -> CorpusPrompt:
    roll = rng.random()
    if roll < 0.2:
        text = rng.choice(SMALL_TALK)
    else:
        text = rng.choice(QUESTIONS).format(topic=rng.choice(TOPICS)) + rng.choice(STYLES)
    history = (rng.choice(EARLIER),) if rng.random() < 0.2 else ()
    return CorpusPrompt(Task.DIALOGUE, text, rng.choice(PERSONAS), history)


def _caption(rng: random.Random) -> CorpusPrompt:
    if rng.random() < 0.6:
        text = rng.choice(CAPTION_REQUESTS) + _transcript(rng)
    else:
        request = rng.choice(WRITTEN_REQUESTS)
        body = rng.choice(ERRORS) if request.startswith("Correct") else rng.choice(NOTICES)
        text = request + body
    # the service sends caption work as Task.CAPTION; the benchmark sends such requests as dialogue turns
    return CorpusPrompt(Task.CAPTION if rng.random() < 0.5 else Task.DIALOGUE, text)


def build_corpus(n: int, seed: int = 0, caption_share: float = 0.3) -> list[CorpusPrompt]:
    """n distinct prompts (fewer if the templates run out), about `caption_share` of them caption requests."""
    rng = random.Random(seed)
    seen: set[CorpusPrompt] = set()
    out: list[CorpusPrompt] = []
    for _ in range(50 * n):
        if len(out) >= n:
            break
        prompt = _caption(rng) if rng.random() < caption_share else _dialogue(rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


SELF_WRITTEN_WORDS = (3, 30)  # a self-written user turn's length in words, bounds included
# Markup, links, trailing off: not something said to the avatar
_NOT_A_TURN = re.compile(r"[\t<>|#*_`\\{}\[\]@]|https?:|\.\.\.")


def usable_user_turn(text: str) -> str | None:
    """What of `text`, a user turn the target wrote, reads as one, or None: its first line's
    longest run of whole sentences (ending in . ? or !) within SELF_WRITTEN_WORDS words, in
    printable ASCII without markup. Cut there, about half of what the bundled target writes at
    temperature 1 is kept (kept whole or not at all, a fifth was: most run on into stories,
    letters, lists, other languages or emoji)."""
    line = text.strip().split("\n", 1)[0].strip()
    low, high = SELF_WRITTEN_WORDS
    ends = [m.end() for m in re.finditer(r"[.?!](?=\s|$)", line)]
    kept = next((line[:end] for end in reversed(ends) if len(line[:end].split()) <= high), "")
    if len(kept.split()) < low or not kept.isascii() or not kept.isprintable() or _NOT_A_TURN.search(kept):
        return None
    return kept


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _shingles(text: str, n: int) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def overlapping(prompts: Iterable[CorpusPrompt], excluded: Sequence[str], n: int = OVERLAP_WORDS) -> list[str]:
    """The corpus prompts equal to an excluded prompt (a benchmark's) or sharing a run of n words with
    one; the project's caption instruction, which every caption request starts with, is not counted."""
    instruction = CAPTION_INSTRUCTION.strip()

    def body(text: str) -> str:
        return text.replace(instruction, " ")

    banned = set().union(*(_shingles(body(text), n) for text in excluded)) if excluded else set()
    exact = {text.strip() for text in excluded}
    return [p.user_text for p in prompts
            if p.user_text.strip() in exact or _shingles(body(p.user_text), n) & banned]
