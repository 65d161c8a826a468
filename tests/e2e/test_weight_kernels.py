"""The weight kernels compute each row alone, the 4-bit form keeps Q4_1 weights on their grid,
and in 16-bit dtypes a verification pass reproduces plain decoding bit for bit.

Speculative decoding is lossless only if a token verified inside a pass of several rows
gets the very logits plain decoding would give it; these tests check that at the kernel,
the pass and the generation level, including the 4-bit configuration (`llm.weights=int4`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import load_model, rollback
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.llm.weight_kernels import INT4_GROUP, Int4Linear, pack_int4, quantize_int4, row_invariant_linear

ROW_COUNTS = (2, 5, 9, 16, 17, 33, 72)  # 72: a batch of 8 verifying 9 tokens each


@pytest.mark.parametrize("kind", ("row-invariant", "int4", "int4-without-codes"))
def test_the_16_bit_products_compute_each_row_alone_whatever_the_row_count(kind):
    torch.manual_seed(0)
    weight = torch.randn(320, 576, dtype=torch.bfloat16)
    dtype = torch.bfloat16
    linear = {"row-invariant": row_invariant_linear, "int4": Int4Linear([weight]),
              "int4-without-codes": Int4Linear([])}[kind]  # the output projection has no 4-bit codes
    for rows in ROW_COUNTS:
        x = torch.randn(rows, 576, dtype=dtype)
        together = linear(x, weight)
        alone = torch.cat([linear(x[i : i + 1], weight) for i in range(rows)])
        assert torch.equal(together, alone), f"{kind} {dtype}: {rows} rows differ from one at a time"


def q4_1_weights(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights on a Q4_1 grid (w = scale·q + low, each group using codes 0 and 15), with
    scales and lows that bfloat16 holds exactly, as (w, q, scale, low)."""
    groups = in_features // INT4_GROUP
    q = torch.randint(0, 16, (out_features, groups, INT4_GROUP))
    q[..., 0], q[..., 1] = 0, 15
    scale = torch.randint(1, 6, (out_features, groups)).float() / 128
    low = -torch.randint(1, 5, (out_features, groups)).float() / 4
    w = (q * scale[..., None] + low[..., None]).reshape(out_features, in_features)
    return w, q.reshape(out_features, in_features).int(), scale, low


def test_q4_1_weights_come_back_on_their_own_grid_and_through_the_kernel_exactly():
    torch.manual_seed(0)
    w, q, scale, low = q4_1_weights(96, 128)
    codes, found_scale, found_low = quantize_int4(w)
    assert torch.equal(codes, q)
    assert torch.equal(found_scale, scale) and torch.equal(found_low, low)
    # multiplying the identity reads the kernel's weights back: every weight exactly
    weight = w.bfloat16()
    assert torch.equal(weight.float(), w)  # the grid is exact in bfloat16 too
    read_back = Int4Linear([weight])(torch.eye(128, dtype=torch.bfloat16), weight)
    assert torch.equal(read_back.T.float(), w)


def test_int4_product_of_other_weights_is_their_rounded_product():
    torch.manual_seed(0)
    weight, x = torch.randn(256, 576), torch.randn(7, 576)
    codes, scale, low = quantize_int4(weight)
    groups = codes.reshape(256, -1, INT4_GROUP).float() * scale[..., None] + low[..., None]
    assert (groups.reshape(256, 576) - weight).abs().max() <= scale.max() / 2 + 1e-6  # round to nearest
    dense = weight.bfloat16()  # the kernel finds a weight's codes by its storage: one tensor for both
    ours = Int4Linear([dense])(x.bfloat16(), dense).float()
    exact = F.linear(x, groups.reshape(256, 576))
    torch.testing.assert_close(ours, exact, rtol=0.02, atol=0.05 * exact.abs().max().item())
    assert pack_int4(weight).scales_zeros.shape == (576 // INT4_GROUP, 256, 2)


@pytest.fixture(scope="module")
def tiny_int4(tiny_llm_dir):
    return load_model(LlmOptions(model=str(tiny_llm_dir), dtype="bfloat16", weights="int4"))


@pytest.mark.parametrize("weights", ("dense", "int4"))
def test_a_bfloat16_verification_pass_equals_its_rows_decoded_one_by_one(tiny_llm_dir, tiny_int4, weights):
    loaded = tiny_int4 if weights == "int4" else load_model(LlmOptions(model=str(tiny_llm_dir), dtype="bfloat16"))
    lean = loaded.lean
    assert lean is not None and lean.row_invariant  # on by default in 16-bit dtypes
    assert isinstance(lean.linear, Int4Linear) == (weights == "int4")
    prompt, draft = list(range(40, 80)), [7, 300, 12, 5, 901, 33, 2, 18, 64]
    with torch.inference_mode():
        cache = lean(input_ids=torch.tensor([prompt])).cache
        together = lean(input_ids=torch.tensor([draft]), cache=cache, logits_to_keep=len(draft)).logits[0]
        rollback(cache, len(prompt))
        alone = torch.cat([lean(input_ids=torch.tensor([[t]]), cache=cache, logits_to_keep=1).logits[0]
                           for t in draft])
    assert torch.equal(together, alone)


def test_padded_batch_rows_equal_each_request_decoded_alone(tiny_int4):
    """A batch verification in bfloat16 int4 gives each row what its own request gets alone."""
    lean = tiny_int4.lean
    assert lean is not None
    prompts = [[5, 9, 12, 7, 3], [44, 17, 6]]
    drafts = [[8, 21, 90], [13]]
    with torch.inference_mode():
        alone = []
        for prompt, draft in zip(prompts, drafts, strict=True):
            cache = lean(input_ids=torch.tensor([prompt])).cache
            alone.append(lean(input_ids=torch.tensor([draft]), cache=cache, logits_to_keep=len(draft)).logits[0])
        first = lean(input_ids=torch.tensor([prompts[0], [0, 0, *prompts[1]]]),
                     attention_mask=torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]),
                     position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]))
        step = lean(input_ids=torch.tensor([drafts[0], [drafts[1][0], 0, 0]]),
                    attention_mask=torch.tensor([[1] * 8, [0, 0, 1, 1, 1, 1, 0, 0]]),
                    position_ids=torch.tensor([[5, 6, 7], [3, 4, 5]]), cache=first.cache, logits_to_keep=3).logits
    assert torch.equal(step[0], alone[0])
    assert torch.equal(step[1, :1], alone[1])


@pytest.fixture(scope="module")
def bundled_int4():
    return Generator(load_model(LlmOptions(dtype="bfloat16", weights="int4")), early_exit_layers=8)


@pytest.mark.parametrize("drafter", ("ngram", "suffix"))
def test_int4_speculative_decoding_equals_int4_plain_decoding(bundled_int4, drafter):
    """Every other prompt drafts a fixed length: the guard may turn an adaptive request's drafting off
    on a loaded machine (a CI run had suffix accept nothing so), and drafting must be exercised."""
    prompts = load_prompts()
    accepted = 0
    for task in ("dialogue", "caption"):
        for i, text in enumerate(prompts[task][:2]):
            prompt = tuple(encode_chat(bundled_int4.loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))
            fixed = {"max_draft_tokens": 4, "adaptive_draft": False} if i % 2 == 0 else {}
            outputs = []
            for name in (drafter, "none"):
                steps = bundled_int4.steps(GenerationRequest(prompt, 64, name, **fixed))
                outputs.append([t for step in steps for t in step.token_ids])
                accepted += bundled_int4.last_stats.accepted_draft_tokens
            assert outputs[0] == outputs[1], text
    assert accepted > 0, f"{drafter} never had a token accepted: the test exercised nothing"


def test_the_int4_target_predicts_what_the_float32_target_predicts(bundled_int4):
    """Same weights (the GGUF's Q4_1 codes), coarser arithmetic: nearly the same next tokens
    along the float32 target's own replies (measured: 98 % on eight bench prompts)."""
    float32 = Generator(load_model(LlmOptions(dtype="float32")))
    agree = total = 0
    for text in ("Tell me something interesting about the moon.", "How do bees make honey?"):
        prompt = encode_chat(float32.loaded.tokenizer, chat_messages(Task.DIALOGUE, text))
        reply = [t for step in float32.steps(GenerationRequest(tuple(prompt), 48, "none")) for t in step.token_ids]
        predictions = []
        with torch.inference_mode():
            for lean in (float32.loaded.lean, bundled_int4.loaded.lean):
                cache = lean(input_ids=torch.tensor([prompt])).cache
                rows = [lean(input_ids=torch.tensor([reply[i : i + 8]]), cache=cache,
                             logits_to_keep=len(reply[i : i + 8])).logits[0]
                        for i in range(0, len(reply) - 1, 8)]  # passes of 8: the int4 kernel's path
                predictions.append(torch.cat(rows)[: len(reply) - 1].argmax(-1))
        agree += int((predictions[0] == predictions[1]).sum())
        total += len(predictions[0])
    assert agree / total >= 0.9, f"the int4 target agreed on {agree} of {total} tokens"


@pytest.mark.parametrize(("settings", "message"), [
    ({"weights": "int4", "dtype": "float32"}, "llm.dtype=bfloat16"),
    ({"weights": "int4", "dtype": "bfloat16", "lean_forward": False}, "lean_forward=true"),
    ({"weights": "int3"}, "choose one of dense, int4"),
])
def test_weight_forms_the_settings_cannot_run_are_refused_before_loading(settings, message):
    with pytest.raises(ValueError, match=message):
        load_model(LlmOptions(**settings))


def test_specvox_generate_runs_the_int4_configuration_and_refuses_it_in_float32(bundled_int4):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    text = "Why do cats purr?"
    command = [sys.executable, "-m", "services.cli", "generate", "--prompt", text, "--max-new-tokens", "24"]
    done = subprocess.run([*command, "--dtype", "bfloat16", "--weights", "int4", "--drafter", "ngram", "--json"],
                          capture_output=True, text=True, timeout=300, check=True, cwd=root)
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    prompt = tuple(encode_chat(bundled_int4.loaded.tokenizer, chat_messages(Task.DIALOGUE, text)))
    plain = [t for step in bundled_int4.steps(GenerationRequest(prompt, 24, "none")) for t in step.token_ids]
    assert reply["token_ids"] == plain  # speculative in a fresh process = plain in this one
    refused = subprocess.run([*command, "--weights", "int4"], capture_output=True, text=True, timeout=300, cwd=root)
    assert refused.returncode == 2
    assert "llm.dtype=bfloat16" in refused.stderr and "Traceback" not in refused.stderr
