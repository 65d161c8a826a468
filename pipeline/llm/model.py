"""Loading the target model: any Hugging Face causal LM, a local folder or a GGUF file.

Device and dtype are settings; nothing here assumes a CPU or a float size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    context_tokens: int
    eos_token_ids: frozenset[int]


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
    )


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
