"""`llm.weights=int4-exact`: the kernel reads back exactly the float32 weights its codes stand
for, computes each row alone, refuses weights that are not codes, and the bundled target run
through it decodes what Hugging Face's float32 greedy `generate()` decodes, with every drafter.
`llm.weights=auto` (the default) takes it wherever it applies, and dense weights elsewhere.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch.utils import cpp_extension

from pipeline.llm import exact_codes
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.exact_codes import (
    ExactCodesLinear,
    checkpoint_reason,
    gguf_tensor_types,
    pack_int4,
    pack_int8,
    unavailable_reason,
)
from pipeline.llm.kv_cache import KVCache, layer_tensors
from pipeline.llm.lean_llama import DECODE_MAX_TOKENS
from pipeline.llm.model import auto_weights, choose_weights, load_model, rollback
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompt_sets import load_prompts
from pipeline.llm.prompts import Task, chat_messages, encode_chat
from pipeline.models import resolve_llm

# The kernel's tests; the choice of `auto` is plain Python and runs on any machine.
needs_kernel = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

GROUP = 32


def bundled_gguf() -> Path:
    ref = resolve_llm("bundled")
    assert ref.gguf_file is not None
    return Path(ref.name_or_path) / ref.gguf_file


def able() -> str | None:
    return None  # nothing rules int4-exact out


def no_avx() -> str | None:
    return "the int4-exact kernel needs a CPU with AVX2 (and FMA) or AVX-512; torch reports DEFAULT"


def not_codes() -> str | None:
    return "the checkpoint's layer weights are stored as Q4_K, not Q4_1"


def test_auto_takes_int4_exact_only_for_a_float32_q4_1_checkpoint_on_a_cpu_that_runs_the_kernel():
    asked: list[str] = []

    def checkpoint() -> str | None:
        asked.append("checkpoint")
        return None

    assert choose_weights("cpu", "float32", True, able, checkpoint)[0] == "int4-exact"
    for settings, machine, stored, why in [
        (("cuda", "float32", True), able, able, "llm.device=cuda"),
        (("cpu", "bfloat16", True), able, able, "llm.dtype=bfloat16"),
        (("cpu", "float32", False), able, able, "llm.lean_forward=false"),
        (("cpu", "float32", True), no_avx, able, "AVX2 (and FMA) or AVX-512"),
        (("cpu", "float32", True), able, not_codes, "Q4_K, not Q4_1"),
    ]:
        form, reason = choose_weights(*settings, machine, stored)
        assert form == "dense" and why in reason, (settings, reason)
    asked.clear()
    choose_weights("cpu", "float32", True, no_avx, checkpoint)
    assert asked == []  # the checkpoint is not read when the machine already rules int4-exact out


def test_the_checkpoints_stored_types_are_read_from_its_header(tmp_path):
    import gguf

    types = gguf_tensor_types(bundled_gguf())
    reader = gguf.GGUFReader(bundled_gguf())
    assert types == {t.name: int(t.tensor_type) for t in reader.tensors}
    assert checkpoint_reason(bundled_gguf()) is None  # every layer matrix is Q4_1
    assert "not a GGUF file" in str(checkpoint_reason(None))  # a folder or hub id: float weights
    writer = gguf.GGUFWriter(tmp_path / "f32.gguf", "llama")
    writer.add_block_count(1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        writer.add_tensor(name, np.zeros((32, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_tensor_types(tmp_path / "f32.gguf") == {"token_embd.weight": 0, "blk.0.attn_q.weight": 0,
                                                        "blk.0.ffn_down.weight": 0}
    assert "stored as F32, not Q4_1" in str(checkpoint_reason(tmp_path / "f32.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    assert "could not be read" in str(checkpoint_reason(tmp_path / "junk.gguf"))


def test_auto_on_this_machine_and_the_bundled_checkpoint():
    form, reason = auto_weights(LlmOptions(), resolve_llm("bundled"))
    assert (form == "int4-exact") == (unavailable_reason() is None), reason
    assert LlmOptions().weights == "auto"


def test_auto_loads_a_float_checkpoint_dense_and_says_why(tiny_llm_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pipeline.llm.model"):
        loaded = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float32"))
    assert loaded.weights == "dense" and not isinstance(loaded.lean.linear, ExactCodesLinear)
    assert [r.getMessage() for r in caplog.records] == [
        "llm weights: dense (llm.weights=auto: the checkpoint is not a GGUF file of Q4_1 codes)"]
    assert load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float64", lean_forward=False)).weights == "dense"


@needs_kernel
def test_auto_falls_back_to_dense_when_the_codes_check_refuses_after_loading(tiny_llm_dir, monkeypatch, caplog):
    monkeypatch.setattr(exact_codes, "checkpoint_reason", lambda path: None)  # as if its header said Q4_1
    with caplog.at_level(logging.INFO, logger="pipeline.llm.model"):
        loaded = load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float32"))
    assert loaded.weights == "dense" and loaded.lean is not None
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert "exactly 4-bit codes" in warning.getMessage()


def test_the_install_step_builds_the_kernel_or_says_why_not(monkeypatch, capsys):
    if unavailable_reason() is None:
        assert exact_codes.main(["--build"]) == 0
        assert "int4-exact kernel ready" in capsys.readouterr().out
    monkeypatch.setattr(exact_codes, "unavailable_reason", no_avx)
    assert exact_codes.main(["--build"]) == 0
    assert f"not built: {no_avx()}" in capsys.readouterr().out


def test_the_kernel_runs_on_avx2_and_avx512_cpus_and_its_build_is_named_by_the_instruction_set(monkeypatch):
    """One source for both instruction sets (kernels/simd16.h); a build is never shared between them."""
    monkeypatch.setattr(exact_codes.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(exact_codes, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    names = {}
    for capability in ("AVX2", "AVX512"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert unavailable_reason() is None, capability
        names[capability] = exact_codes.kernel_name()
    assert names["AVX2"].startswith("specvox_exact_codes_avx2_")
    assert names["AVX512"].startswith("specvox_exact_codes_avx512_")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert unavailable_reason() == no_avx()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(exact_codes, "_cpu_flags", lambda: {"avx2", "fma"})
    assert "F16C" in str(unavailable_reason())
    monkeypatch.setattr(exact_codes.platform, "machine", lambda: "aarch64")
    assert "x86-64 with AVX2 or AVX-512, not aarch64" in str(unavailable_reason())


def test_builds_for_two_torch_installs_or_two_checkouts_are_kept_apart(monkeypatch, tmp_path):
    """The Coqui backend's environment (torch 2.9) shares torch's extensions cache with this one
    (2.13): under one name each rebuilt over the other's build at its next load."""
    here = exact_codes.kernel_name()
    monkeypatch.setattr(exact_codes.torch, "__version__", "2.9.1+cu128")
    assert exact_codes.kernel_name() != here
    monkeypatch.undo()
    shutil.copytree(exact_codes.KERNELS, tmp_path / "kernels")
    monkeypatch.setattr(exact_codes, "KERNELS", tmp_path / "kernels")  # the same sources, another checkout
    assert exact_codes.kernel_name() != here
    monkeypatch.undo()
    assert exact_codes.kernel_name() == here


def test_the_kernel_is_built_by_this_environments_ninja_whatever_path_says_first(monkeypatch):
    """A system ninja (1.11) and the environment's (1.13) hash a build's commands differently:
    each took the other's build for stale and compiled it again."""
    ours = Path(sys.executable).parent / "ninja"
    if not ours.exists():
        pytest.skip("no ninja beside this interpreter")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # as `make test` and a supervised service run
    with exact_codes._this_environments_ninja():
        assert shutil.which("ninja") == str(ours)
    assert os.environ["PATH"] == "/usr/bin:/bin"


def q4_1_matrix(out_features: int, in_features: int) -> torch.Tensor:
    """Weights as GGUF's Q4_1 stores them: w = d·q + m per group of 32, d and m float16, each
    group using codes 0 and 15 (the quantizer maps the group's extremes there)."""
    groups = in_features // GROUP
    q = torch.randint(0, 16, (out_features, groups, GROUP))
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_features, groups, 1) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out_features, groups, 1) * 0.1).half().float()
    return (q * d + m).reshape(out_features, in_features)


def q8_0_matrix(out_features: int, in_features: int) -> torch.Tensor:
    """Weights as GGUF's Q8_0 stores them: w = d·q per group of 32, q in −127..127, d float16."""
    q = torch.randint(-127, 128, (out_features, in_features // GROUP, GROUP))
    q[..., 0] = 127
    d = (torch.rand(out_features, in_features // GROUP, 1) * 0.01 + 1e-4).half().float()
    return (q * d).reshape(out_features, in_features)


@pytest.fixture(scope="module")
def coded():
    torch.manual_seed(0)
    layer, output = q4_1_matrix(96, 1536), q8_0_matrix(160, 576)
    return ExactCodesLinear([layer], output), layer, output


@needs_kernel
def test_the_kernel_reads_back_every_weight_bit_for_bit(coded):
    linear, layer, output = coded
    for weight in (layer, output):
        eye = torch.eye(weight.shape[1])  # row i of the product is column i of W.T: the weights themselves
        assert torch.equal(linear(eye, weight).T, weight)
    assert linear.nbytes < (layer.numel() + output.numel()) * 4 / 3  # 4.6 and 8.5 bits a weight, not 32


@needs_kernel
def test_products_are_float32_products_and_each_row_is_computed_alone(coded):
    linear, layer, output = coded
    for weight in (layer, output):
        # past kRowsPerSweep rows (12 with AVX-512, 4 with AVX2: kernels/codes.h) the kernel sweeps the codes again
        for rows in (1, 2, 4, 5, 9, 12, 13, 40):
            x = torch.randn(rows, weight.shape[1])
            together = linear(x, weight)
            # within float32's bound for a sum of K products (K·2⁻²⁴·Σ|x·w|) of the exact product
            exact = F.linear(x.double(), weight.double())
            bound = weight.shape[1] * 2.0**-24 * F.linear(x.double().abs(), weight.double().abs())
            assert ((together.double() - exact).abs() <= bound).all()
            alone = torch.cat([linear(x[i : i + 1], weight) for i in range(rows)])
            assert torch.equal(together, alone), f"{rows} rows differ from one at a time"


@pytest.fixture
def kernel_threads_restored():
    """The kernels' thread count as the test found it, put back after (the pool is one a process)."""
    before = exact_codes.kernels().threads()
    yield exact_codes.kernels()
    exact_codes.kernels().set_threads(before)


@needs_kernel
@pytest.mark.parametrize("threads", (2, 3))
def test_products_shared_with_helper_threads_are_the_same_bits_as_on_one(coded, kernel_threads_restored, threads):
    linear, layer, output = coded
    kernels = kernel_threads_restored
    for weight in (layer, output):
        for rows in (1, 3, 5, 9, 13):
            x = torch.randn(rows, weight.shape[1])
            assert kernels.set_threads(1) == 1
            alone = linear(x, weight)
            assert kernels.set_threads(threads) == threads
            for _ in range(20):  # chunks land on different threads from call to call
                assert torch.equal(linear(x, weight), alone), f"{rows} rows on {threads} threads"


@needs_kernel
def test_the_pool_times_both_ways_and_either_gives_the_same_bits(coded, kernel_threads_restored):
    """The pool shares a loop or runs it on the caller, whichever its timed epochs of 512 loops
    found faster (kernels/pool.h): the first two epochs run one way each."""
    linear, layer, _ = coded
    kernels = kernel_threads_restored
    x = torch.randn(3, layer.shape[1])
    kernels.set_threads(1)
    alone = linear(x, layer)
    kernels.set_threads(2)
    before = kernels.pool_counts()
    for _ in range(1100):
        assert torch.equal(linear(x, layer), alone)
    after = kernels.pool_counts()
    assert after["shared_loops"] - before["shared_loops"] >= 512
    assert after["solo_loops"] - before["solo_loops"] >= 512
    assert after["shared_work_per_s"] > 0 and after["solo_work_per_s"] > 0


@needs_kernel
def test_products_called_from_two_threads_at_once_each_get_their_own_result(coded, kernel_threads_restored):
    """One caller's loop at a time shares the helpers; a loop posted meanwhile runs on its caller."""
    linear, layer, _ = coded
    kernels = kernel_threads_restored
    inputs = [torch.randn(5, layer.shape[1]) for _ in range(2)]
    kernels.set_threads(1)
    expected = [linear(x, layer) for x in inputs]
    kernels.set_threads(2)
    wrong = []

    def hammer(i: int) -> None:
        for _ in range(200):
            if not torch.equal(linear(inputs[i], layer), expected[i]):
                wrong.append(i)

    callers = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=120)
    assert not any(caller.is_alive() for caller in callers)
    assert not wrong


@needs_kernel
def test_a_forked_child_computes_on_its_own_thread(coded, kernel_threads_restored):
    """A fork copies no helper thread: the child's products run on its caller and do not hang."""
    linear, layer, _ = coded
    kernels = kernel_threads_restored
    x = torch.randn(9, layer.shape[1])
    kernels.set_threads(2)
    expected = linear(x, layer)  # the parent's helpers are up
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when it computed the same bits on one thread
        signal.alarm(60)
        try:
            os._exit(0 if kernels.threads() == 1 and torch.equal(linear(x, layer), expected) else 1)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit status
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(linear(x, layer), expected)


@needs_kernel
def test_kernel_threads_zero_takes_one_a_core_up_to_the_cap(kernel_threads_restored):
    cores = len(os.sched_getaffinity(0))
    assert exact_codes.set_kernel_threads(0) == min(cores, exact_codes.MAX_KERNEL_THREADS)
    assert exact_codes.set_kernel_threads(1) == 1 == exact_codes.kernel_threads()
    with pytest.raises(ValueError, match="llm.kernel_threads must be 0"):
        exact_codes.set_kernel_threads(-1)


@needs_kernel
def test_weights_that_are_not_codes_are_refused():
    torch.manual_seed(0)
    assert pack_int4(torch.randn(32, 64)) is None and pack_int8(torch.randn(32, 64)) is None
    assert pack_int4(q4_1_matrix(32, 64).double()) is None  # float32 only
    assert pack_int4(q4_1_matrix(24, 64)) is None  # not a whole number of 16-feature blocks
    with pytest.raises(ValueError, match="1 of 2 are not"):
        ExactCodesLinear([q4_1_matrix(32, 64), torch.randn(32, 64)])
    # an output matrix off the 8-bit grid stays dense, and still multiplies
    output = torch.randn(48, 64)
    linear = ExactCodesLinear([q4_1_matrix(32, 64)], output)
    x = torch.randn(3, 64)
    torch.testing.assert_close(linear(x, output), F.linear(x, output))


@needs_kernel
@pytest.mark.parametrize(("settings", "message"), [
    ({"weights": "int4-exact", "dtype": "bfloat16"}, "llm.dtype=float32"),
    ({"weights": "int4-exact", "lean_forward": False}, "lean_forward=true"),
])
def test_settings_that_cannot_run_int4_exact_are_refused_before_loading(settings, message):
    with pytest.raises(ValueError, match=message):
        load_model(LlmOptions(**settings))


@needs_kernel
def test_a_model_that_is_not_a_quantized_checkpoint_is_refused(tiny_llm_dir):
    with pytest.raises(ValueError, match="exactly 4-bit codes"):
        load_model(LlmOptions(model=str(tiny_llm_dir), dtype="float32", weights="int4-exact"))


@pytest.fixture(scope="module")
def bundled_exact():
    return Generator(load_model(LlmOptions(dtype="float32", weights="int4-exact")), early_exit_layers=8)


@needs_kernel
def test_the_bundled_target_is_all_codes(bundled_exact):
    lean = bundled_exact.loaded.lean
    assert lean is not None and isinstance(lean.linear, ExactCodesLinear)
    assert bundled_exact.loaded.weights == "int4-exact"
    assert len(lean.linear.coded) == 4 * len(lean.layers) + 1  # every layer matrix, and the output matrix


@pytest.fixture(scope="module")
def hf_float32_greedy(bundled_exact):
    """Transformers' greedy `generate()` on the dequantized float32 model, per prompt."""
    loaded, prompts, outputs = bundled_exact.loaded, load_prompts(), {}
    for task in ("dialogue", "caption"):
        for text in prompts[task][:2]:
            prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text))
            with torch.inference_mode():
                out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                            eos_token_id=sorted(loaded.eos_token_ids), pad_token_id=0)
            outputs[tuple(prompt)] = [t for t in out[0, len(prompt):].tolist() if t not in loaded.eos_token_ids]
    return outputs


@needs_kernel
@pytest.mark.parametrize("drafter", ("none", "ngram", "suffix", "quantized"))
def test_int4_exact_decoding_equals_hugging_face_float32_greedy(bundled_exact, hf_float32_greedy, drafter):
    """The codes are the float32 weights, so greedy decoding through them is float32 greedy
    decoding: token for token what transformers' `generate()` gives on the dequantized model.
    Every other prompt drafts a fixed length, which the guard leaves alone (it may turn an
    adaptive request's drafting off on a loaded machine), so drafting is always exercised."""
    accepted = 0
    for i, (prompt, expected) in enumerate(hf_float32_greedy.items()):
        fixed = {"max_draft_tokens": 4, "adaptive_draft": False} if i % 2 == 0 else {}
        request = GenerationRequest(prompt, 64, drafter, **fixed)
        ours = [t for step in bundled_exact.steps(request) for t in step.token_ids]
        accepted += bundled_exact.last_stats.accepted_draft_tokens
        assert ours == expected, bundled_exact.loaded.tokenizer.decode(prompt)
    assert drafter == "none" or accepted > 0, f"{drafter} never had a token accepted: the test exercised nothing"


@needs_kernel
def test_the_default_settings_load_the_bundled_target_as_codes(caplog):
    """On a CPU with AVX2 or AVX-512, `llm.weights` left at its default runs the bundled target as int4-exact."""
    with caplog.at_level(logging.INFO, logger="pipeline.llm.model"):
        loaded = load_model(LlmOptions())
    assert loaded.weights == "int4-exact" and isinstance(loaded.lean.linear, ExactCodesLinear)
    assert [r.getMessage() for r in caplog.records if r.name == "pipeline.llm.model"] == [
        "llm weights: int4-exact (llm.weights=auto: a float32 Q4_1 checkpoint on a CPU with AVX2 or AVX-512: "
        "float32 outputs from the stored codes)",
        f"int4-exact kernels on {min(len(os.sched_getaffinity(0)), exact_codes.MAX_KERNEL_THREADS)} thread(s) "
        "(llm.kernel_threads=0)"]


DRAFT = [253, 1127, 30, 2365, 288, 260, 3267, 28]  # eight drafted tokens after the prompt


def prefilled(loaded, text: str) -> tuple[list[int], KVCache]:
    """A dialogue prompt's ids and the lean pass's cache holding all of them but the last."""
    prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, text))
    with torch.inference_mode():
        cache = loaded.lean(input_ids=torch.tensor([prompt[:-1]]), logits_to_keep=1).cache
    return prompt, cache


@pytest.fixture(scope="module")
def loaded_exact(bundled_exact):
    return bundled_exact.loaded


@needs_kernel
def test_the_fused_step_computes_each_row_of_a_verification_as_its_own_one_token_pass(loaded_exact):
    """Nine tokens in one C++ pass: every row's logits, hidden state, keys and values are bit for bit
    what nine one-token passes compute, so speculative decoding equals plain decoding."""
    fused = loaded_exact.lean
    assert fused.step is not None
    prompt, cache = prefilled(loaded_exact, "Why do cats purr?")
    held, tokens = cache.get_seq_length(), torch.tensor([[prompt[-1], *DRAFT]])
    with torch.inference_mode():
        together = fused(input_ids=tokens, cache=cache, logits_to_keep=9)
        keys, values = cache.keys[:, :, :, held : held + 9].clone(), cache.values[:, :, :, held : held + 9].clone()
        rollback(cache, held)
        alone = [fused(input_ids=tokens[:, i : i + 1], cache=cache, logits_to_keep=1) for i in range(9)]
    assert torch.equal(together.logits, torch.cat([out.logits for out in alone], dim=1))
    assert torch.equal(together.hidden, torch.cat([out.hidden for out in alone], dim=1))
    assert torch.equal(cache.keys[:, :, :, held : held + 9], keys) and torch.equal(
        cache.values[:, :, :, held : held + 9], values)
    assert torch.equal(fused.linear(fused.normed(together.hidden), fused.lm_head), together.logits)


@pytest.fixture(scope="module")
def loaded_q8():
    return load_model(LlmOptions(weights="int4-q8"))


@needs_kernel
@pytest.mark.parametrize("form", ["int4-q8", "int4-exact"])
def test_a_prompt_is_prefilled_by_the_fused_pass_each_row_as_its_own_one_token_pass(request, form):
    """A prompt past DECODE_MAX_TOKENS goes through the C++ pass too (up to lean_llama.FUSED_PREFILL_TOKENS
    by form: faster than torch's batched pass over the dense weights there), every row alone: its cache and
    last logits are bit for bit what one-token steps compute."""
    loaded = request.getfixturevalue({"int4-q8": "loaded_q8", "int4-exact": "loaded_exact"}[form])
    lean = loaded.lean
    assert loaded.weights == form and lean.step is not None
    prompt = encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, "Tell me how a rainbow forms, in two lines."))
    assert DECODE_MAX_TOKENS < len(prompt) <= lean.fused_prefill_tokens
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        whole = lean(input_ids=ids, logits_to_keep=1)
        cache = KVCache(len(lean.layers), 1, lean.kv_heads, lean.head_dim, torch.float32, torch.device("cpu"))
        steps = [lean(input_ids=ids[:, i : i + 1], cache=cache, logits_to_keep=1) for i in range(len(prompt))]
    assert torch.equal(whole.logits, steps[-1].logits)
    n = len(prompt)
    assert torch.equal(whole.cache.keys[..., :n, :], cache.keys[..., :n, :])
    assert torch.equal(whole.cache.values[..., :n, :], cache.values[..., :n, :])


@needs_kernel
def test_the_fused_step_computes_what_torchs_operations_compute_on_the_same_codes(loaded_exact):
    """The C++ pass and the torch-ops pass over the same codes sum in other orders: equal to float32
    rounding, the same token at every position of a verification."""
    fused = loaded_exact.lean
    plain = fused.unfused()
    assert plain.step is None
    prompt, cache = prefilled(loaded_exact, "How do bees make honey?")
    held, tokens = cache.get_seq_length(), torch.tensor([[prompt[-1], *DRAFT]])
    with torch.inference_mode():
        ours = fused(input_ids=tokens, cache=cache, logits_to_keep=9).logits
        ours_keys = [k[:, :, held:].clone() for k, _ in layer_tensors(cache)]
        rollback(cache, held)
        theirs = plain(input_ids=tokens, cache=cache, logits_to_keep=9).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-3)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    for mine, (reference, _) in zip(ours_keys, layer_tensors(cache), strict=True):
        torch.testing.assert_close(mine, reference[:, :, held:], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_padded_batch_row_through_the_fused_step_is_the_request_alone(loaded_exact):
    """Two requests of different lengths in one cache, left-padded, the shorter draft padded too: each
    row's live logits are bit for bit its own pass's (the holes are skipped, not attended to)."""
    fused = loaded_exact.lean
    (a, cache_a), (b, cache_b) = prefilled(loaded_exact, "Why do cats purr?"), prefilled(loaded_exact,
                                                                                        "Tell me about bees.")
    la, lb = cache_a.get_seq_length(), cache_b.get_seq_length()
    total = max(la, lb)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.new_zeros((*t.shape[:2], total - t.shape[2], t.shape[3])), t], dim=2)

    pairs = [(torch.cat([padded(ka), padded(kb)]), torch.cat([padded(va), padded(vb)]))
             for (ka, va), (kb, vb) in zip(layer_tensors(cache_a), layer_tensors(cache_b), strict=True)]
    batch = KVCache.from_tensors(pairs)
    kept = torch.zeros((2, total), dtype=torch.long)
    kept[0, total - la :], kept[1, total - lb :] = 1, 1
    ids = torch.tensor([[a[-1], *DRAFT[:2]], [b[-1], 0, 0]])
    live = torch.tensor([[1, 1, 1], [1, 0, 0]])
    positions = torch.tensor([[la, la + 1, la + 2], [lb, lb + 1, lb + 2]])
    with torch.inference_mode():
        both = fused(input_ids=ids, cache=batch, attention_mask=torch.cat([kept, live], dim=1),
                     position_ids=positions, logits_to_keep=3).logits
        alone_a = fused(input_ids=ids[:1], cache=cache_a, logits_to_keep=3).logits
        alone_b = fused(input_ids=ids[1:, :1], cache=cache_b, logits_to_keep=1).logits
    assert torch.equal(both[0], alone_a[0]) and torch.equal(both[1, :1], alone_b[0])


@needs_kernel
def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's build lock is a plain file: a build killed midway leaves it, and torch's own loader
    then waits on it forever. Ours takes it for stale under an flock no live builder holds."""
    built = Path(exact_codes.kernels().__file__).parent  # the build this machine already has
    name = exact_codes.kernel_name()
    assert built.name == name
    shutil.copytree(built, tmp_path / name, ignore=shutil.ignore_patterns("lock"))
    (tmp_path / name / "lock").touch()  # as a killed build leaves it
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert Path(cpp_extension._get_build_directory(name, False)).parent != tmp_path  # the copy, not the cache
    loaded = subprocess.run([sys.executable, "-c", "from pipeline.llm.exact_codes import kernels; "
                             "print(kernels().__file__)"], env=env, capture_output=True, text=True, timeout=240,
                            cwd=Path(__file__).resolve().parent.parent)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip().startswith(str(tmp_path / name)), loaded.stdout
    assert "left by a kernel build that did not finish" in loaded.stderr
    assert not (tmp_path / name / "lock").exists()
