"""Plain greedy decoding as verified steps, on the bundled SmolLM2 target."""

from __future__ import annotations

import os

import pytest
import torch

from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.lean_llama import LeanLlama
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import PromptTooLongError, Task, chat_messages, encode_chat

PROMPTS = load_prompts()
DEVICE = os.environ.get("SPECVOX_LLM__DEVICE", "cpu")  # bench/gpu_check.sh runs these on cuda


@pytest.fixture(scope="module")
def loaded():
    return load_model(LlmOptions(dtype="float32", device=DEVICE))


@pytest.fixture(scope="module")
def generator(loaded):
    return Generator(loaded)


def prompt_ids(loaded, text: str) -> tuple[int, ...]:
    return tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))


def sample_prompts() -> list[str]:
    return [PROMPTS["dialogue"][0], PROMPTS["dialogue"][1], PROMPTS["caption"][0]]


@pytest.mark.parametrize("text", sample_prompts())
def test_steps_equal_hugging_face_greedy_generate(loaded, generator, text):
    ids = prompt_ids(loaded, text)
    steps = list(generator.steps(GenerationRequest(ids, max_new_tokens=32)))
    ours = [t for s in steps for t in s.token_ids]
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=32, do_sample=False,
                                    eos_token_id=sorted(loaded.eos_token_ids), pad_token_id=0)
    theirs = [t for t in out[0, len(ids):].tolist() if t not in loaded.eos_token_ids]
    assert ours == theirs
    assert "".join(s.text_delta for s in steps) == loaded.tokenizer.decode(ours, skip_special_tokens=True)
    assert [s.seq for s in steps] == list(range(len(steps)))


def test_eos_ends_the_reply_with_an_empty_end_step(loaded, generator):
    steps = list(generator.steps(GenerationRequest(prompt_ids(loaded, "What is the capital of France?"), 64)))
    assert steps[-1].finish_reason == "eos" and steps[-1].token_ids == ()
    assert all(s.finish_reason is None for s in steps[:-1])
    assert len(steps) < 64


def test_max_new_tokens_ends_the_reply_with_length(loaded, generator):
    steps = list(generator.steps(GenerationRequest(prompt_ids(loaded, "Tell me a long story about a dragon."), 5)))
    assert [s.accepted for s in steps] == [1] * 5
    assert steps[-1].finish_reason == "length"


def test_cancellation_stops_within_one_step(loaded, generator):
    produced = []
    request = GenerationRequest(prompt_ids(loaded, "Tell me a long story about a dragon."), 50)
    for step in generator.steps(request, should_stop=lambda: len(produced) >= 3):
        produced.append(step)
    assert len(produced) == 4 and produced[-1].finish_reason == "cancelled"


def test_bad_requests_raise_clear_errors(loaded, generator):
    with pytest.raises(ValueError, match="empty"):
        list(generator.steps(GenerationRequest((), 8)))
    with pytest.raises(ValueError, match="unknown drafter"):
        list(generator.steps(GenerationRequest((1, 2), 8, drafter="telepathy")))
    too_long = tuple([1] * loaded.context_tokens)
    with pytest.raises(PromptTooLongError, match="context window"):
        list(generator.steps(GenerationRequest(too_long, 8)))


def test_the_warm_up_leaves_no_drafting_measurement_behind(loaded):
    """The warm-up's passes are the process's first of each size, cold: the cost of a verified token,
    the guards' verdicts and the match statistics start from their priors after it, as they would
    without it, instead of from what cold passes measured. It writes a caption too: the vocabulary's
    byte trie, which every caption's constraint walks, is built by then."""
    from pipeline.llm.caption_constraint import _TRIES

    _TRIES.pop(loaded.tokenizer, None)
    generator = Generator(loaded)
    generator.warm_up(drafters=("none", "ngram", "suffix"))
    assert loaded.tokenizer in _TRIES
    assert generator.verify_cost.per_token == generator.verify_cost.prior
    assert generator.verify_cost.seconds(1) is None  # no pass remembered at all
    assert not generator.guards and not generator._match_acceptance and not generator._draft_costs
    # and a request afterwards measures again
    list(generator.steps(GenerationRequest(prompt_ids(loaded, PROMPTS["caption"][0]), 16, "suffix")))
    assert generator.verify_cost.seconds(1) is not None and "suffix" in generator.guards
    assert not generator.guards["suffix"].judges_rate  # a model-free drafter's guard: its loss budget alone


def test_a_coded_targets_steps_keep_torchs_operations_on_one_thread(loaded, monkeypatch):
    """The passes of a coded target run in the kernels' own threads; torch's operations around them
    stay on one thread during a step (their OpenMP threads would spin on the kernels' cores), and
    torch's thread count is back as it was between steps and after the reply."""
    if loaded.lean is None or loaded.lean.step is None:
        pytest.skip("the target is not coded on this machine")
    generator = Generator(loaded)
    before = torch.get_num_threads()
    seen: list[tuple[int, int]] = []  # (tokens in the pass, torch threads during it)
    call = LeanLlama.__call__

    def counting(self, *args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], torch.get_num_threads()))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(LeanLlama, "__call__", counting)
    prompt = prompt_ids(loaded, PROMPTS["dialogue"][0])
    for _ in generator.steps(GenerationRequest(prompt, 12, "suffix")):
        assert torch.get_num_threads() == before  # between steps, as the caller left it
    assert torch.get_num_threads() == before
    assert seen[0] == (len(prompt) - 1, before)  # the prompt's prefill keeps torch's threads
    assert len(seen) > 1 and all(threads == 1 for _, threads in seen[1:])
