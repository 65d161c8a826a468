"""Loading the target model: any Hugging Face causal LM, a local folder or a GGUF file.

Device and dtype are settings; nothing here assumes a CPU or a float size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.llm.lean_llama import WEIGHT_FORMS, LeanLlama
from pipeline.llm.lean_llama import supports as lean_supports
from pipeline.llm.weight_kernels import INT4_GROUP, Int4Linear
from pipeline.models import ModelRef, not_found_offline, resolve_llm

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class LlmOptions:
    model: str = "bundled"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 96
    torch_threads: int = 0  # 0: torch's default
    offline: bool = True  # never reach a model hub unless told to
    drafter: str = "suffix"  # the default drafter: none, ngram, suffix, early-exit, quantized, draft
    draft_model: str = ""  # a smaller causal LM sharing the target's tokenizer (path or hub id)
    early_exit_layers: int = 8  # depth of the self-speculative drafter
    max_draft_tokens: int = 8
    adaptive_draft: bool = True
    static_cache: bool = False  # preallocated KV cache per request (rollback by length); slower in eager mode here
    # Llama-architecture targets run through pipeline/llm/lean_llama.py (same arithmetic, fewer
    # operations, MKL-packed float32 products on a CPU); false: through transformers' modules.
    lean_forward: bool = True
    pack_weights: bool = True  # lean_forward on a CPU in float32: MKL-packed weight copies (+1.3× their memory)
    # "dense": the weights as loaded, in `dtype`. "int4-exact": kept as the 4- and 8-bit codes a
    # quantized checkpoint (the bundled Q4_1 GGUF) stored them in, dequantized exactly to float32 in
    # the kernel (pipeline/llm/exact_codes.py): float32 outputs, a sixth of the memory traffic; needs
    # lean_forward, dtype=float32, a CPU with AVX-512. "int4": the layers' weights as 4-bit groups of
    # 32 through torch's CPU kernel with bfloat16 activations; needs lean_forward and dtype=bfloat16.
    weights: str = "dense"
    max_batch_size: int = 8  # concurrent replies verified in one target pass (pipeline/llm/batch.py); 1: one at a time


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    context_tokens: int
    eos_token_ids: frozenset[int]
    lean: LeanLlama | None = None  # the lean forward pass over `model`'s weights, where it applies


def load_draft_model(options: LlmOptions, target: LoadedModel) -> LoadedModel | None:
    """The configured draft model, on the target's device and dtype; it must share the vocabulary."""
    if not options.draft_model:
        return None
    draft = load_model(LlmOptions(model=options.draft_model, device=options.device, dtype=options.dtype,
                                  offline=options.offline))
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
    """Shrink a KV cache to its first `keep_tokens` positions (transformers 5 crops by a negative count)."""
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
    _check_weight_form(options)
    try:
        tokenizer, model = _from_pretrained(ref, dtype, options.offline)
    except OSError as e:
        if options.offline:
            raise not_found_offline("llm", options.model, e) from e
        raise
    device = torch.device(options.device)
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers' stubs want a dtype
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        context_tokens=int(getattr(model.config, "max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(model, tokenizer),
        lean=_lean_pass(model, options),
    )


# The weight forms that run only on a CPU, each with the dtype its kernel computes in and why.
CPU_WEIGHT_FORMS = {
    "int4-exact": ("float32", "computes in float32 on a CPU"),
    "int4": ("bfloat16", "runs torch's CPU int4 kernel on bfloat16 activations"),
}


def _check_weight_form(options: LlmOptions) -> None:
    """Refuse a weight form the settings cannot run, before loading anything."""
    if options.weights not in WEIGHT_FORMS:
        raise ValueError(f"unknown llm.weights {options.weights!r}: choose one of {', '.join(WEIGHT_FORMS)}")
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
    return LeanLlama(model, options.pack_weights, options.weights)


def _from_pretrained(ref: ModelRef, dtype: torch.dtype, offline: bool) -> tuple[object, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = {"gguf_file": ref.gguf_file, "local_files_only": offline}
    tokenizer = AutoTokenizer.from_pretrained(ref.name_or_path, **common)
    model = AutoModelForCausalLM.from_pretrained(ref.name_or_path, dtype=dtype, **common)
    return tokenizer, model


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
