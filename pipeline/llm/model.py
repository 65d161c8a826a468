"""Loading the target model: any Hugging Face causal LM, a local folder or a GGUF file.

Device and dtype are settings; nothing here assumes a CPU or a float size.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.llm import exact_codes, gguf_cache
from pipeline.llm.lean_llama import CODED_FORMS, WEIGHT_FORMS, LeanLlama
from pipeline.llm.lean_llama import supports as lean_supports
from pipeline.llm.options import LlmOptions
from pipeline.llm.weight_kernels import INT4_GROUP, Int4Linear
from pipeline.models import ModelRef, not_found_offline, resolve_llm

log = logging.getLogger(__name__)

AUTO = "auto"  # llm.weights: int4-exact where it applies, else dense (`auto_weights`)

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    context_tokens: int
    eos_token_ids: frozenset[int]
    lean: LeanLlama | None = None  # the lean forward pass over `model`'s weights, where it applies
    weights: str = "dense"  # the form it runs in (llm.weights, "auto" resolved): dense, int4-exact, int4-q8, int4


def load_draft_model(options: LlmOptions, target: LoadedModel) -> LoadedModel | None:
    """The configured draft model, on the target's device and dtype; it must share the vocabulary."""
    if not options.draft_model:
        return None
    draft = load_model(LlmOptions(model=options.draft_model, device=options.device, dtype=options.dtype,
                                  offline=options.offline, cuda_graphs=options.cuda_graphs,
                                  cuda_graph_tokens=options.cuda_graph_tokens))
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():  # type: ignore[attr-defined]
        raise ValueError(f"draft model {options.draft_model!r} does not share the target's tokenizer")
    return draft


def early_exit_model(model: Any, layers: int) -> torch.nn.Module:
    """The target truncated to its first `layers` decoder layers, sharing every weight.

    Self-speculation (Elhoushi et al. 2024, "LayerSkip"; Zhang et al. 2024, "Draft &
    Verify"): the shallow model drafts, the full one verifies. Nothing is copied but the
    module objects' attribute tables and the config, so the cost is a few kilobytes.
    """
    total = int(model.config.num_hidden_layers)
    if not 0 < layers < total:
        raise ValueError(f"early exit needs 1 to {total - 1} layers, not {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    inner = copy.copy(model.model)
    inner._modules = dict(inner._modules)
    inner.config = config
    shallow = copy.copy(model)
    shallow._modules = dict(shallow._modules)
    shallow.model = inner
    shallow.config = config
    return shallow


def quantized_draft_applies(loaded: LoadedModel) -> bool:
    """The `quantized` drafter needs a lean pass with dense weights on a CPU (the int4 kernel's)."""
    lean = loaded.lean
    return (lean is not None and loaded.device.type == "cpu" and not isinstance(lean.linear, Int4Linear)
            and int(lean.config.hidden_size) % INT4_GROUP == 0 and int(lean.config.intermediate_size) % INT4_GROUP == 0)


def quantized_self_draft(loaded: LoadedModel) -> LeanLlama:
    """The target's own weights as 4-bit codes with bfloat16 activations: a drafter from the target.

    Quantized self-speculation (in the spirit of Zhao et al. 2024, "QSpec", and of drafting
    with a low-bit copy of the target): the same weights in the 4-bit configuration
    (`llm.weights=int4`) take ~22 ms a token against ~40 ms for a float32 step here, and
    pick the float32 target's next token ~98 % of the time, where the lookup drafters
    match far less on open dialogue. Costs a bfloat16 copy of the model plus its codes
    (about 340 MB for the bundled target), built at the first request that asks for it.
    """
    model = copy.deepcopy(loaded.model).to(torch.bfloat16)
    return LeanLlama(model, packed=False, weights="int4", row_invariant=False)


def rollback(cache: object, keep_tokens: int) -> None:
    """Shrink a KV cache to its first `keep_tokens` positions (transformers 5 crops by a negative count;
    the lean pass's `KVCache` takes the same call and only moves its length)."""
    extra = cache.get_seq_length() - keep_tokens  # type: ignore[attr-defined]
    if extra > 0:
        cache.crop(-extra)  # type: ignore[attr-defined]


def new_kv_cache(model: Any, max_tokens: int, static: bool) -> object | None:
    """A KV cache for one request: preallocated for `max_tokens` positions when `static`.

    A static cache (transformers' StaticCache) writes each step's keys and values in place
    and rolls back by moving its length, where the dynamic one concatenates and slices every
    layer's tensors each step. None lets the model make its own dynamic cache; so does an
    architecture whose cache layout StaticCache does not know.
    """
    if not static:
        return None
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    try:
        cache = StaticCache(config=model.config, max_cache_len=max_tokens)
    except (ValueError, KeyError, NotImplementedError, AttributeError):
        return None
    # Sliding-window and linear-attention layers do not roll back by length alone.
    return cache if all(type(layer) is StaticLayer for layer in cache.layers) else None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}") from None


def load_model(options: LlmOptions) -> LoadedModel:
    if options.torch_threads:
        torch.set_num_threads(options.torch_threads)
    ref = resolve_llm(options.model)
    dtype = torch_dtype(options.dtype)
    auto = options.weights == AUTO
    if auto:
        form, reason = auto_weights(options, ref)
        options = replace(options, weights=form)
    _check_weight_form(options)
    try:
        tokenizer, model = gguf_cache.load(ref.name_or_path, ref.gguf_file, dtype, options.offline,
                                           gguf_cache.cache_root(options.gguf_cache))
    except OSError as e:
        if options.offline:
            raise not_found_offline("llm", options.model, e) from e
        raise
    device = torch.device(options.device)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs want a dtype
    if auto:
        lean, form, reason = _auto_lean_pass(model, options, reason)
        log.info("llm weights: %s (llm.weights=auto: %s)", form, reason)
    else:
        lean, form = _lean_pass(model, options), options.weights
    if form in CODED_FORMS:
        threads = exact_codes.set_kernel_threads(options.kernel_threads)
        log.info("%s kernels on %d thread(s) (llm.kernel_threads=%d)", form, threads, options.kernel_threads)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        context_tokens=int(getattr(model.config, "max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(model, tokenizer),
        lean=lean,
        weights=form,
    )


def auto_weights(options: LlmOptions, ref: ModelRef) -> tuple[str, str]:
    """The weight form `llm.weights=auto` loads (int4-exact or dense) and why, before loading:
    `choose_weights` on this machine's kernel support and the checkpoint's stored tensor types."""
    gguf = str(Path(ref.name_or_path) / ref.gguf_file) if ref.gguf_file else None
    return choose_weights(options.device, options.dtype, options.lean_forward, exact_codes.unavailable_reason,
                          lambda: exact_codes.checkpoint_reason(gguf))


def choose_weights(device: str, dtype: str, lean_forward: bool, machine_reason: Callable[[], str | None],
                   checkpoint_reason: Callable[[], str | None]) -> tuple[str, str]:
    """("int4-exact" or "dense", the reason) for `llm.weights=auto`.

    int4-exact computes what dense float32 computes, token for token, reading a sixth of the
    bytes, so it is taken wherever it runs: a float32 target on a CPU, through the lean pass,
    on a machine that runs the kernel (`machine_reason() is None`: x86-64 with AVX2 or AVX-512), from a
    checkpoint stored as Q4_1 codes (`checkpoint_reason() is None`). The reasons are asked in
    that order, each only when the ones before allow int4-exact (reading a checkpoint costs).
    """
    if torch.device(device).type != "cpu":
        return "dense", f"llm.device={device}: the int4-exact kernel runs on a CPU"
    if dtype != "float32":
        return "dense", f"llm.dtype={dtype}: int4-exact computes in float32"
    if not lean_forward:
        return "dense", "llm.lean_forward=false: int4-exact runs in the lean forward pass"
    for reason in (machine_reason, checkpoint_reason):
        why = reason()
        if why:
            return "dense", why
    return "int4-exact", ("a float32 Q4_1 checkpoint on a CPU with AVX2 or AVX-512: "
                          "float32 outputs from the stored codes")


# The weight forms that run only on a CPU, each with the dtype its kernel computes in and why.
CPU_WEIGHT_FORMS = {
    "int4-exact": ("float32", "computes in float32 on a CPU"),
    "int4-q8": ("float32", "takes float32 activations on a CPU"),
    "int4": ("bfloat16", "runs torch's CPU int4 kernel on bfloat16 activations"),
}


def _check_weight_form(options: LlmOptions) -> None:
    """Refuse a weight form the settings cannot run, before loading anything ("auto" is resolved)."""
    if options.weights not in WEIGHT_FORMS:
        raise ValueError(f"unknown llm.weights {options.weights!r}: choose one of {', '.join((*WEIGHT_FORMS, AUTO))}")
    if options.weights != "dense" and not options.lean_forward:
        raise ValueError(f"llm.weights={options.weights} runs in the lean forward pass: set llm.lean_forward=true")
    needs = CPU_WEIGHT_FORMS.get(options.weights)
    if needs and (options.dtype != needs[0] or torch.device(options.device).type != "cpu"):
        raise ValueError(f"llm.weights={options.weights} {needs[1]}: "
                         f"set llm.device=cpu and llm.dtype={needs[0]} (not {options.device}, {options.dtype})")


def _lean_pass(model: Any, options: LlmOptions) -> LeanLlama | None:
    if not (options.lean_forward and lean_supports(model)):
        if options.weights != "dense":
            raise ValueError(f"llm.weights={options.weights} needs a plain Llama target (the lean forward "
                             f"pass); {options.model!r} is a {type(model).__name__}")
        return None
    return LeanLlama(model, options.pack_weights, options.weights, fused=options.fused_step,
                     graphs=options.cuda_graphs, graph_tokens=options.cuda_graph_tokens)


def _auto_lean_pass(model: Any, options: LlmOptions, reason: str) -> tuple[LeanLlama | None, str, str]:
    """The lean pass in the form `auto_weights` chose, the form it runs and why. Where int4-exact
    was chosen but cannot run after all (not a plain Llama target, weights that are not exactly
    codes, a kernel that does not compile), the dense pass, with a warning that says why."""
    if options.weights == "int4-exact":
        if options.lean_forward and not lean_supports(model):
            reason = f"{type(model).__name__} has no lean forward pass, which int4-exact runs in"
        else:
            try:
                return _lean_pass(model, options), "int4-exact", reason
            except Exception as e:  # noqa: BLE001 - a codes check or the kernel's build: dense still runs
                reason = f"int4-exact did not load ({type(e).__name__}: {e})"
        log.warning("llm weights: int4-exact does not apply after all: %s", reason)
    return _lean_pass(model, replace(options, weights="dense")), "dense", reason


def _eos_ids(model: torch.nn.Module, tokenizer: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    if isinstance(end_of_turn, int) and end_of_turn != getattr(tokenizer, "unk_token_id", None):
        ids.add(end_of_turn)
    return frozenset(ids)
