"""Decoding as a sequence of verified steps.

A step is what one target forward pass commits: with speculative decoding, the
accepted draft tokens plus the target's own next token; with plain decoding (the
`none` drafter, the only one here yet), exactly one token. Consumers (the Redis
token stream, the gRPC reply) see only steps, so a drafter changes how many tokens
a step carries, never the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pipeline.llm.detokenize import IncrementalDetokenizer
from pipeline.llm.model import LoadedModel
from pipeline.llm.prompts import PromptTooLongError

DRAFTERS = ("none",)


@dataclass(frozen=True)
class DecodeStep:
    seq: int  # 0, 1, 2, … within the reply
    token_ids: tuple[int, ...]  # the tokens this step accepted, in order
    text_delta: str
    finish_reason: str | None = None  # "eos", "length" or "cancelled" on the last step

    @property
    def accepted(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    drafter: str = "none"


def greedy_token(logits: torch.Tensor) -> int:
    """Greedy choice over the last position's logits [vocab]."""
    return int(torch.argmax(logits, dim=-1))


class Generator:
    """Runs a request as decode steps, stopping on EOS, the token limit or `should_stop`."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded

    def check(self, request: GenerationRequest) -> None:
        if request.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {request.drafter!r}: choose one of {', '.join(DRAFTERS)}")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        room = self.loaded.context_tokens - request.max_new_tokens
        if len(request.prompt_ids) > room:
            raise PromptTooLongError(
                f"prompt of {len(request.prompt_ids)} tokens plus {request.max_new_tokens} new tokens "
                f"exceeds the {self.loaded.context_tokens}-token context window"
            )

    def warm_up(self, new_tokens: int = 4) -> None:
        """A short generation, so the first request does not pay for lazy initialisation."""
        prompt = tuple(self.loaded.tokenizer.encode("Hello"))  # type: ignore[attr-defined]
        for _ in self.steps(GenerationRequest(prompt, new_tokens)):
            pass

    @torch.inference_mode()
    def steps(
        self, request: GenerationRequest, should_stop: Callable[[], bool] = lambda: False
    ) -> Iterator[DecodeStep]:
        self.check(request)
        model, device = self.loaded.model, self.loaded.device
        detok = IncrementalDetokenizer(self.loaded.tokenizer)
        input_ids = torch.tensor([request.prompt_ids], device=device)  # [1, S]
        out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1)  # prefill
        cache, logits = out.cache, out.logits[0, -1]
        for seq in range(request.max_new_tokens):
            if should_stop():
                yield DecodeStep(seq, (), "", "cancelled")
                return
            token = greedy_token(logits)
            if token in self.loaded.eos_token_ids:
                yield DecodeStep(seq, (), detok.push([]), "eos")
                return
            last = seq + 1 == request.max_new_tokens
            yield DecodeStep(seq, (token,), detok.push([token]), "length" if last else None)
            if last:
                return
            out = model(input_ids=torch.tensor([[token]], device=device), cache=cache, use_cache=True)
            cache, logits = out.cache, out.logits[0, -1]
