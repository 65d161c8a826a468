"""Chat prompts: the persona, the session's history and the task, in the model's chat template."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

DEFAULT_PERSONA = (
    "You are a friendly avatar in a live spoken conversation. "
    "Answer in one to three short sentences of plain speech, without lists or markup."
)
# A caption's words are held to the transcript's by pipeline/llm/caption_constraint.py whatever the model
# would write; the instruction only asks for what the constraint leaves to it: casing, punctuation, fillers.
CAPTION_INSTRUCTION = (
    "You write captions. Repeat the user's words exactly, in the same order, adding capital letters and "
    "punctuation, and leaving out filler words such as um and uh."
)


class Task(Enum):
    DIALOGUE = "dialogue"
    CAPTION = "caption"


@dataclass(frozen=True)
class Exchange:
    user: str
    assistant: str  # what the user heard of the reply
    # The user spoke over the reply: `assistant` is the part they heard. The prompt shows those
    # words as they are: marked with a dash, the bundled 135M model took to ending every later
    # reply with one ("The answer is —").
    cut_off: bool = False



class PromptTooLongError(ValueError):
    """The prompt leaves no room for the reply inside the model's context window."""


def chat_messages(
    task: Task, user_text: str, persona: str = DEFAULT_PERSONA, history: tuple[Exchange, ...] = ()
) -> list[dict[str, str]]:
    if task is Task.CAPTION:
        return [{"role": "system", "content": CAPTION_INSTRUCTION}, {"role": "user", "content": user_text}]
    messages = [{"role": "system", "content": persona}]
    for exchange in history:
        messages.append({"role": "user", "content": exchange.user})
        messages.append({"role": "assistant", "content": exchange.assistant})
    messages.append({"role": "user", "content": user_text})
    return messages


def encode_chat(tokenizer: object, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)  # type: ignore[attr-defined]
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def fit_history(
    tokenizer: object,
    task: Task,
    user_text: str,
    persona: str,
    history: tuple[Exchange, ...],
    budget_tokens: int,
) -> list[int]:
    """Encode the prompt, dropping the oldest exchanges until it fits `budget_tokens`."""
    for start in range(len(history) + 1):
        ids = encode_chat(tokenizer, chat_messages(task, user_text, persona, history[start:]))
        if len(ids) <= budget_tokens:
            return ids
    raise PromptTooLongError(
        f"the prompt is {len(ids)} tokens; at most {budget_tokens} fit beside the reply"
    )
