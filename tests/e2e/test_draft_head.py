"""Trained draft heads: the corpus, the unrolled training, the artifact's target check, losslessness.

On the bundled target (float32, the configuration it serves in): a tiny training run (a
handful of prompts, a few steps) writes an artifact that loads and resumes; the artifact
refuses another target; and with the shipped head (pipeline/llm/heads) greedy output is
plain decoding's token for token, alone and in a batch, while the head's drafts are
accepted. The distribution under sampling is tests/e2e/test_lossless.py's (every drafter).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm.batch import BatchedDecoder
from pipeline.llm.draft_corpus import CorpusPrompt, build_corpus, overlapping, usable_user_turn
from pipeline.llm.draft_head import (
    CARD_FILE,
    DraftHeadMismatchError,
    EagleHead,
    HeadShape,
    eagle_unrolled,
    find_heads,
    head_cache,
    load_head,
    rotary,
    target_fingerprint,
)
from pipeline.llm.draft_length import VerifyCost
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model
from pipeline.llm.options import LlmOptions, SamplingOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.llm.train_draft import TrainOptions, autocast_dtype, corpus_for, train, user_turn_prefix

PROMPTS = load_prompts()
BENCHMARK = [*PROMPTS["dialogue"], *PROMPTS["caption"]]
SOME = [PROMPTS["dialogue"][min(3, len(PROMPTS["dialogue"]) - 1)], PROMPTS["caption"][0]]  # a lone clone has 3
FIXED = {"max_draft_tokens": 4, "adaptive_draft": False}  # drafts of 4 every step, whatever they cost


@pytest.fixture(scope="module")
def loaded():
    return load_model(LlmOptions(dtype="float32"))


@pytest.fixture(scope="module")
def shipped(loaded):
    """The generator as the engine builds it: with the head shipped for the bundled target."""
    generator = Generator.from_options(loaded, LlmOptions(dtype="float32"))
    assert "eagle" in generator.draft_heads, "no shipped EAGLE head for the bundled target (specvox train-draft)"
    return generator


def encode(loaded, text: str) -> tuple[int, ...]:
    return tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))


def run(generator: Generator, prompt, drafter: str, max_new: int = 48, **kw) -> list[int]:
    return [t for s in generator.steps(GenerationRequest(tuple(prompt), max_new, drafter, **kw)) for t in s.token_ids]


def test_the_corpus_never_holds_a_benchmark_prompt():
    corpus = build_corpus(6000, seed=0)
    assert len(corpus) == 6000 and len({p.user_text for p in corpus}) > 3000
    assert {p.task for p in corpus} == {Task.DIALOGUE, Task.CAPTION}
    assert overlapping(corpus, BENCHMARK) == []
    # the check itself finds a benchmark prompt, and one sharing a run of six words with it
    planted = [CorpusPrompt(Task.DIALOGUE, BENCHMARK[0]), CorpusPrompt(Task.DIALOGUE, "Well, " + BENCHMARK[-1][-60:])]
    assert overlapping([*corpus[:10], *planted], BENCHMARK) == [p.user_text for p in planted]


@pytest.mark.parametrize(("written", "kept"), [
    ("How do I start a small vegetable garden?", "How do I start a small vegetable garden?"),
    ("  Can you help me plan a party for my sister?  ", "Can you help me plan a party for my sister?"),
    ("I need a new laptop. What kind do you recommend?", "I need a new laptop. What kind do you recommend?"),
    ("Hi, I'm Sam from the bakery! Here's what I wrote so far:\n\nDear customers", "Hi, I'm Sam from the bakery!"),
    ("Can you tell me about trains? I love the old steam ones and I have", "Can you tell me about trains?"),
    (" ".join(["Tell me more about this."] * 7), " ".join(["Tell me more about this."] * 6)),  # to 30 words
    ("Hi there!", None),                                      # under three words
    ("Steroids.", None),
    ("What about this one", None),                            # no sentence end: cut off
    ("Sarah,\n\nI've just got some questions.", None),       # a letter: its first line is no turn
    ("ąem jaką do nikátą pokadovą?", None),                   # not ASCII
    ("Can you rate these? 🌳👥", "Can you rate these?"),
    ("Do you like 🌳 trees as much as I do?", None),
    ("Use **bold** and <b>tags</b> please.", None),
    ("Wait... what did you say?", None),
    (" ".join(["word"] * 31) + ".", None),                   # one sentence over thirty words
])
def test_a_self_written_user_turn_keeps_its_whole_sentences_that_read_as_one(written, kept):
    assert usable_user_turn(written) == kept


def test_self_written_turns_open_where_the_chat_template_puts_the_users_turn(loaded):
    """The target writes a turn after the template's system turn and the user turn's opening,
    and a turn it wrote joins the corpus only if it shares no run of words with a benchmark prompt."""
    tokenizer = loaded.tokenizer
    prefix = user_turn_prefix(tokenizer, "You are a test persona.")
    whole = encode_chat(tokenizer, chat_messages(Task.DIALOGUE, "Why is the sky blue?", "You are a test persona."))
    assert whole[: len(prefix)] == prefix and len(whole) > len(prefix) + 5
    assert "You are a test persona." in tokenizer.decode(prefix) and "Why" not in tokenizer.decode(prefix)
    options = TrainOptions(prompts=40, heldout_prompts=4)
    mine = CorpusPrompt(Task.DIALOGUE, "How do I keep basil alive indoors?")
    train_set, held = corpus_for(options, BENCHMARK, [mine])
    assert mine in train_set and mine not in held and len(held) == 4
    with pytest.raises(ValueError, match="overlap the benchmark"):
        corpus_for(options, BENCHMARK, [CorpusPrompt(Task.DIALOGUE, "Well, " + BENCHMARK[0])])


def test_unrolled_training_steps_are_what_drafting_computes():
    """Step s of `eagle_unrolled` at position j equals drafting from a prefix known up to
    j - s + 1 with the head's cache: the training-time test trains what the drafter runs."""
    torch.manual_seed(0)
    shape = HeadShape(hidden_size=32, heads=4, kv_heads=2, head_dim=8, intermediate_size=48, eps=1e-5,
                      rope_theta=10000.0)
    head = EagleHead(shape).double().eval()
    length, first = 12, 7  # absolute position of the head sequence's first input
    features, embeds = torch.randn(1, length, 32, dtype=torch.float64), torch.randn(1, length, 32, dtype=torch.float64)
    positions = torch.arange(first, first + length)[None]
    unrolled = eagle_unrolled(head, features, embeds, positions, steps=3)
    for m in (0, 4, 8):  # features known up to input m; drafts 1..3 at inputs m, m + 1, m + 2
        cache = head_cache(shape, features[0])
        cos, sin = rotary(positions[0, : m + 1], 8, 10000.0, torch.float64)
        g, k, v = head.block(features[:, : m + 1], embeds[:, : m + 1], cos, sin)
        cache.write(0, cache.extend(m + 1), k, v)
        g = g[:, -1:]
        for s in range(1, 4):
            assert torch.allclose(g[0, 0], unrolled[s - 1][0, m + s - 1], atol=1e-10), (m, s)
            cos, sin = rotary(positions[0, m + s : m + s + 1], 8, 10000.0, torch.float64)
            g, k, v = head.block(g, embeds[:, m + s : m + s + 1], cos, sin, tuple(cache.layers[0]))
            cache.write(0, cache.extend(1), k, v)


def tiny_options(tmp_path, kind: str = "eagle", steps: int = 3) -> TrainOptions:
    return TrainOptions(kind=kind, out=str(tmp_path / f"head-{kind}"), work=str(tmp_path / "work"), prompts=24,
                        self_prompts=3, self_prompt_minutes=2.0, heldout_prompts=4, max_new_tokens=10,
                        generation_batch=8, data_minutes=30.0, vocab_size=512,
                        unroll=2, steps=steps, minutes=2.0, batch_sequences=8, checkpoint_s=0.0, medusa_heads=2)


def test_a_tiny_training_run_writes_an_artifact_that_loads_and_resumes(loaded, tmp_path, capsys):
    options = tiny_options(tmp_path)
    card = train(options, BENCHMARK, loaded)
    folder = options.folder()
    assert (folder / "head.safetensors").exists()
    saved = json.loads((folder / CARD_FILE).read_text())
    assert saved == card and card["training"]["steps"] == 3
    assert card["target"]["sha256"] == target_fingerprint("bundled")
    # 20 templated prompts and 3 the target wrote itself (the same 3 on resuming: kept in the work folder)
    assert card["data"]["self_written_prompts"] == 3
    assert card["data"]["train_replies"] == 23 and card["data"]["heldout_replies"] == 4
    written = json.loads((tmp_path / "work" / "self_written.json").read_text())["turns"]
    assert len(written) == 3 and all(usable_user_turn(t["text"]) == t["text"] for t in written)
    assert card["data"]["train_reply_tokens"] > 0 and card["draft_vocab"]["size"] <= 512 + len(loaded.eos_token_ids)
    held = card["heldout"]
    assert len(held["acceptance_by_position"]) == 8 and held["positions"] > 0
    assert held["expected_accepted_length"] == sorted(held["expected_accepted_length"])
    assert all(0 <= a <= 1 for a in held["acceptance_by_position"])
    head = load_head(folder, loaded.model, target_fingerprint("bundled"))
    assert head.kind == "eagle" and len(head.vocab) == card["draft_vocab"]["size"]
    err = capsys.readouterr().err  # progress with an ETA on stderr
    assert "[prompts] " in err and "[data] 1/" in err
    assert "[train] 1/3 steps" in err and "[train] 3/3 steps" in err and " eta " in err

    shards = sorted((tmp_path / "work" / "data").glob("shard-*.pt"))
    resumed = train(dataclasses.replace(options, steps=5), BENCHMARK, loaded)
    err = capsys.readouterr().err
    assert "resumed from" in err and "at step 3" in err
    assert resumed["training"]["steps"] == 5
    assert sorted((tmp_path / "work" / "data").glob("shard-*.pt")) == shards  # the data was not made again
    assert resumed["data"]["train_reply_tokens"] == card["data"]["train_reply_tokens"]
    assert json.loads((tmp_path / "work" / "self_written.json").read_text())["turns"] == written

    medusa_options = tiny_options(tmp_path, "medusa", steps=2)
    medusa = train(medusa_options, BENCHMARK, loaded)  # on the same data
    assert medusa["kind"] == "medusa" and len(medusa["heldout"]["acceptance_by_position"]) == 2
    assert set(find_heads("bundled", loaded.model, tmp_path)) == {"eagle", "medusa"}
    generator, prompt = Generator(loaded), encode(loaded, SOME[0])
    plain = run(generator, prompt, "none", 24)
    for kind, where in (("eagle", folder), ("medusa", medusa_options.folder())):  # barely trained, still lossless
        generator.draft_heads = {kind: load_head(where, loaded.model, target_fingerprint("bundled"))}
        assert kind in generator.drafters and run(generator, prompt, kind, 24, **FIXED) == plain
        assert generator.last_stats.drafted_tokens > 0


def test_training_products_are_bfloat16_on_cuda_and_float32_on_a_cpu_unless_told():
    assert autocast_dtype("auto", torch.device("cpu")) == "float32"  # bfloat16 products crawl on AVX2
    assert autocast_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert autocast_dtype("bfloat16", torch.device("cpu")) == "bfloat16"


def test_a_head_loads_only_against_the_target_it_was_trained_for(loaded, tiny_llm_dir, shipped):
    folder = shipped.draft_heads["eagle"].folder
    other = target_fingerprint(str(tiny_llm_dir))
    assert other != target_fingerprint("bundled")
    with pytest.raises(DraftHeadMismatchError, match="trained for target weights"):
        load_head(folder, loaded.model, other)
    tiny = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float32"))
    assert find_heads(str(tiny_llm_dir), tiny.model) == {}
    assert "eagle" not in Generator.from_options(tiny, LlmOptions(model=str(tiny_llm_dir))).drafters


@pytest.mark.parametrize("text", SOME)
def test_greedy_with_the_shipped_head_is_plain_decoding(loaded, shipped, text):
    prompt = encode(loaded, text)
    plain = run(shipped, prompt, "none")
    assert run(shipped, prompt, "eagle", **FIXED) == plain
    stats = shipped.last_stats
    assert stats.drafted_tokens > 0 and stats.accepted_draft_tokens > 0  # it drafted, and was right at times
    assert stats.mean_accepted_len > 1.0
    assert run(shipped, prompt, "eagle") == plain  # with the draft length and the guard adapting


def test_beside_a_coded_target_the_head_drafts_through_its_kernels(loaded, shipped):
    """Beside an int4-exact (or int4-q8) target the EAGLE head runs as Q8_0 codes through the target's
    kernels (`CodedEagle`): on the target's real features its outputs are the float head's up to that
    rounding, and it picks the same draft token nearly everywhere. Beside a dense target it stays float."""
    trained = shipped.draft_heads["eagle"]
    if loaded.lean is None or loaded.lean.step is None:
        pytest.skip("the target is not coded on this machine")
    coded = trained.coded
    assert coded is not None
    prompt = encode(loaded, PROMPTS["dialogue"][0])
    with torch.inference_mode():
        hidden = loaded.lean(input_ids=torch.tensor([prompt]), logits_to_keep=0).hidden
        features = trained.normed(hidden[:, :-1])
        embeds = trained.embed[torch.tensor(prompt[1:])][None]
        n = features.shape[1]
        cos, sin = rotary(torch.arange(n), trained.head.shape.head_dim, trained.head.shape.rope_theta, torch.float32)
        exact, _, _ = trained.head.block(features, embeds, cos, sin)
        cache = head_cache(trained.head.shape, features[0])
        rounded = coded.block(features, embeds, 0, cache)
        similar = F.cosine_similarity(rounded[0], exact[0], dim=-1)
        same = [int(coded.logits(rounded[0, i]).argmax()) == int((exact[0, i] @ trained.readout.T).argmax())
                for i in range(n)]
    assert rounded.shape == exact.shape and similar.min() > 0.99, similar.min()
    assert sum(same) >= 0.9 * n, f"{sum(same)} of {n} positions draft the same token"
    options = LlmOptions(dtype="float32", weights="dense")
    assert Generator.from_options(load_model(options), options).draft_heads["eagle"].coded is None


def test_greedy_with_the_head_in_a_batch_is_plain_decoding(loaded, shipped):
    kind = "eagle"
    prompts = [encode(loaded, t) for t in SOME]
    decoder = BatchedDecoder(shipped, 3)
    rows = {id(decoder.add(GenerationRequest(p, 32, kind, **FIXED))): i for i, p in enumerate(prompts)}
    out: list[list[int]] = [[] for _ in prompts]
    while decoder.rows:
        for row, step in decoder.step():
            out[rows[id(row)]] += step.token_ids
    assert out == [run(shipped, p, "none", 32) for p in prompts]


@pytest.mark.parametrize("text", SOME)
def test_greedy_with_the_heads_token_tree_is_plain_decoding(loaded, shipped, text, monkeypatch):
    """The head's top-k siblings verified as a tree (EAGLE-2's dynamic tree): the output is plain
    decoding's, and the trees had more nodes than depth. A verified row is made free here, so
    that every sibling pays its row and the trees are as wide as `draft_branches` lets them be."""
    monkeypatch.setattr(shipped, "verify_cost", VerifyCost(prior=0.0, frozen=True))
    prompt = encode(loaded, text)
    plain = run(shipped, prompt, "none")
    steps = list(shipped.steps(GenerationRequest(prompt, 48, "eagle", draft_branches=3, **FIXED)))
    assert [t for s in steps for t in s.token_ids] == plain
    stats = shipped.last_stats
    assert stats.drafted_tokens >= 2 * sum(stats.drafted_at)  # tree nodes beyond the depth of each step


def test_the_heads_siblings_are_offered_by_path_probability_above_the_threshold(loaded, shipped):
    trained = shipped.draft_heads["eagle"]
    prompt = encode(loaded, SOME[0])
    out = shipped.forward(input_ids=torch.tensor([prompt[:-1]]), logits_to_keep=0)
    drafter = trained.drafter(SamplingOptions())
    drafter.branches = 2
    drafter.observe(0, out.hidden[0])
    chain = drafter.propose(prompt, 3)
    assert len(chain.tokens) == 3 and chain.branches
    assert all(len(b) <= 3 and b[:-1] == chain.tokens[: len(b) - 1] and b[-1] != chain.tokens[len(b) - 1]
               for b in chain.branches)  # siblings of the chain's tokens
    assert len(chain.branches) <= 2 * 3
    drafter.min_value = 0.999  # no sibling is that likely: a plain chain
    assert drafter.propose(prompt, 3) == dataclasses.replace(chain, branches=())


def test_greedy_with_the_heads_tree_in_a_batch_is_plain_decoding(loaded, shipped):
    prompts = [encode(loaded, t) for t in SOME]
    decoder = BatchedDecoder(shipped, 3)
    rows = {id(decoder.add(GenerationRequest(p, 32, "eagle", draft_branches=2, **FIXED))): i
            for i, p in enumerate(prompts)}
    out: list[list[int]] = [[] for _ in prompts]
    while decoder.rows:
        for row, step in decoder.step():
            out[rows[id(row)]] += step.token_ids
    assert out == [run(shipped, p, "none", 32) for p in prompts]


def test_sampled_drafts_carry_their_distribution_over_the_whole_vocabulary(loaded, shipped):
    """q is the distribution each draft token was drawn from: zero outside the draft vocabulary,
    summing to 1; so the verifier's rule keeps the target's distribution (tests/e2e/test_lossless.py)."""
    trained = shipped.draft_heads["eagle"]
    sampling = SamplingOptions(temperature=0.8, top_p=0.95, seed=3)
    prompt = encode(loaded, SOME[1])
    steps = list(shipped.steps(GenerationRequest(prompt, 24, trained.kind, sampling)))
    assert sum(len(s.token_ids) for s in steps) > 0
    drafter = trained.drafter(sampling, torch.Generator().manual_seed(0))
    out = shipped.forward(input_ids=torch.tensor([prompt[:-1]]), logits_to_keep=0)
    drafter.observe(0, out.hidden[0])
    draft = drafter.propose(prompt, 4)
    assert len(draft.tokens) == 4 and draft.q is not None and draft.q.shape == (4, trained.vocab_size)
    assert torch.allclose(draft.q.sum(-1), torch.ones(4, dtype=draft.q.dtype), atol=1e-5)
    outside = torch.ones(trained.vocab_size, dtype=torch.bool)
    outside[trained.vocab] = False
    assert float(draft.q[:, outside].abs().sum()) == 0.0
    assert all(float(draft.q[i, t]) > 0 for i, t in enumerate(draft.tokens))
