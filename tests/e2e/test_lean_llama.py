"""The lean Llama forward pass computes what transformers' model computes.

Token-for-token equality of whole generations with transformers' `generate()` is checked in
tests/e2e/test_speculative.py (the engine decodes through the lean pass); these check the
logits and the cache directly, including the padded rows a batched verification passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm.kv_cache import CHUNK_TOKENS, KVCache
from pipeline.llm.lean_llama import LeanLlama, supports
from pipeline.llm.model import load_model, rollback
from pipeline.llm.options import LlmOptions
from pipeline.llm.weight_kernels import PackedLinear


@pytest.fixture(scope="module")
def tiny64(tiny_llm_dir):
    return load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64"))


def test_float64_logits_and_cache_equal_transformers_over_a_prefill_and_a_step(tiny64):
    model, lean = tiny64.model, tiny64.lean
    assert lean is not None
    prompt, step = torch.tensor([[5, 9, 12, 7, 3, 8, 40]]), torch.tensor([[11, 2, 600, 31]])
    with torch.inference_mode():
        theirs = model(input_ids=prompt, use_cache=True)
        ours = lean(input_ids=prompt)
        torch.testing.assert_close(ours.logits, theirs.logits, rtol=0, atol=1e-12)
        theirs_step = model(input_ids=step, cache=theirs.cache, use_cache=True, logits_to_keep=3)
        ours_step = lean(input_ids=step, cache=ours.cache, logits_to_keep=3)
    assert ours_step.logits.shape == (1, 3, model.config.vocab_size)
    torch.testing.assert_close(ours_step.logits, theirs_step.logits, rtol=0, atol=1e-12)
    for mine, reference in zip(ours_step.cache.layers, theirs_step.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, reference.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(mine.values, reference.values, rtol=0, atol=1e-12)


def test_padded_rows_with_their_own_positions_equal_transformers(tiny64):
    """A batch verification: rows of different lengths, padding slots masked, positions given."""
    model, lean = tiny64.model, tiny64.lean
    assert lean is not None
    prompts = torch.tensor([[5, 9, 12, 7, 3], [0, 0, 44, 17, 6]])  # row 2 has two padding slots in front
    kept = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]])
    step = torch.tensor([[8, 21, 0], [13, 0, 0]])  # a draft of 2 and one of 0, padded to 3
    live = torch.tensor([[1, 1, 1], [1, 0, 0]])
    step_positions = torch.tensor([[5, 6, 7], [3, 4, 5]])
    results = []
    with torch.inference_mode():
        for forward in (model, lean):
            first = forward(input_ids=prompts, attention_mask=kept, position_ids=positions, cache=None,
                            use_cache=True)
            second = forward(input_ids=step, attention_mask=torch.cat([kept, live], dim=1),
                             position_ids=step_positions, cache=first.cache, use_cache=True, logits_to_keep=3)
            results.append((first.logits, second.logits))
    (theirs_first, theirs_step), (ours_first, ours_step) = results
    real = kept.bool()
    torch.testing.assert_close(ours_first[real], theirs_first[real], rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_step[live.bool()], theirs_step[live.bool()], rtol=0, atol=1e-12)


def test_transformers_model_computes_the_same_after_its_weights_were_fused(tiny_llm_dir):
    """LeanLlama makes q/k/v and gate/up views of fused tensors: the model must not notice."""
    loaded = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64", lean_forward=False))
    assert loaded.lean is None
    ids = torch.tensor([[5, 9, 12, 7, 3, 8]])
    with torch.inference_mode():
        before = loaded.model(input_ids=ids).logits
        lean = LeanLlama(loaded.model)
        after = loaded.model(input_ids=ids).logits
    assert torch.equal(before, after)
    layer = loaded.model.model.layers[0]
    assert layer.self_attn.k_proj.weight.data_ptr() == lean.layers[0].qkv[64:].data_ptr()  # a view, not a copy
    assert not isinstance(lean.linear, PackedLinear)  # MKL packs float32 only


def test_the_bundled_target_in_float32_uses_packed_products_and_agrees_with_transformers():
    loaded = load_model(LlmOptions(dtype="float32", weights="dense"))  # auto would run the GGUF's codes
    lean = loaded.lean
    assert lean is not None
    assert isinstance(lean.linear, PackedLinear) == torch.backends.mkl.is_available()  # float32 on a CPU: packed
    prompt = torch.tensor([loaded.tokenizer.encode("The weather in Paris is lovely today, and")])
    draft = torch.tensor([[253, 1127, 30, 2365, 288, 260, 3267, 28, 347]])  # a nine-token verification
    with torch.inference_mode():
        theirs = loaded.model(input_ids=prompt, use_cache=True)
        ours = lean(input_ids=prompt)
        theirs_step = loaded.model(input_ids=draft, cache=theirs.cache, use_cache=True, logits_to_keep=9).logits
        ours_step = lean(input_ids=draft, cache=ours.cache, logits_to_keep=9).logits
    # float32 sums in another order: equal to rounding, and the same token chosen at every position
    torch.testing.assert_close(ours_step, theirs_step, rtol=1e-4, atol=1e-3)
    assert torch.equal(ours_step.argmax(-1), theirs_step.argmax(-1))


def test_other_architectures_run_through_transformers():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    assert not supports(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    scaled = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                 "rope_theta": 10000.0})
    assert not supports(LlamaForCausalLM(scaled))
    with pytest.raises(ValueError, match="not a plain Llama"):
        LeanLlama(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))


def test_the_kv_cache_rolls_back_by_moving_its_length_and_grows_by_chunks(tiny64):
    """A rejected tail is dropped without a copy; decoding on after it computes what a fresh prefill
    of the kept tokens computes; past its capacity the cache grows by a chunk and stays right."""
    from transformers import DynamicCache

    lean = tiny64.lean
    assert lean is not None
    prompt = [5, 9, 12, 7, 3, 8, 40]
    with torch.inference_mode():
        cache = lean(input_ids=torch.tensor([prompt])).cache
        assert isinstance(cache, KVCache) and cache.get_seq_length() == 7 and cache.capacity == CHUNK_TOKENS
        buffer = cache.keys.data_ptr()
        lean(input_ids=torch.tensor([[11, 2, 600, 31]]), cache=cache, logits_to_keep=4)
        rollback(cache, 8)  # a draft of three, none accepted: 11 is kept
        assert cache.get_seq_length() == 8 and cache.keys.data_ptr() == buffer
        resumed = lean(input_ids=torch.tensor([[21]]), cache=cache, logits_to_keep=1).logits
        fresh = lean(input_ids=torch.tensor([[*prompt, 11, 21]]), logits_to_keep=1).logits
        torch.testing.assert_close(resumed, fresh, rtol=0, atol=1e-12)
        # one token at a time past the first chunk, beside transformers' DynamicCache filled by the same pass
        dynamic = lean(input_ids=torch.tensor([[*prompt, 11, 21]]), cache=DynamicCache(config=lean.config)).cache
        assert isinstance(dynamic, DynamicCache)
        for i in range(CHUNK_TOKENS):
            token = torch.tensor([[(7 * i) % 500 + 1]])
            ours = lean(input_ids=token, cache=cache, logits_to_keep=1).logits
            theirs = lean(input_ids=token, cache=dynamic, logits_to_keep=1).logits
        assert cache.get_seq_length() == dynamic.get_seq_length() == 9 + CHUNK_TOKENS
        assert cache.capacity == 2 * CHUNK_TOKENS
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
        for mine, reference in zip(cache.layers, dynamic.layers, strict=True):
            torch.testing.assert_close(mine.keys, reference.keys, rtol=0, atol=1e-12)
            torch.testing.assert_close(mine.values, reference.values, rtol=0, atol=1e-12)


def test_the_pass_hands_out_the_last_layers_output_before_the_final_norm(tiny64):
    """`hidden` is what the last decoder layer of transformers' model outputs at the kept positions,
    and the logits are the output matrix times its final norm."""
    model, lean = tiny64.model, tiny64.lean
    assert lean is not None
    ids = torch.tensor([[5, 9, 12, 7, 3, 8, 40]])
    captured: list[torch.Tensor] = []

    def keep(module, inputs, output):
        captured.append(output[0] if isinstance(output, tuple) else output)

    hook = model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.inference_mode():
            model(input_ids=ids)
            ours = lean(input_ids=ids, logits_to_keep=3)
    finally:
        hook.remove()
    assert ours.hidden is not None and ours.hidden.shape == (1, 3, model.config.hidden_size)
    torch.testing.assert_close(ours.hidden, captured[0][:, -3:], rtol=0, atol=1e-12)
    assert torch.equal(F.linear(lean.normed(ours.hidden), lean.lm_head), ours.logits)
