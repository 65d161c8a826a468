"""A GGUF checkpoint converted once into transformers' own format, so that a load reads it back.

transformers loads a GGUF file by parsing its metadata three times (config, tokenizer,
weights) and dequantizing every tensor: ~21 s for the bundled 135M target on this 2-core
machine, paid by every llm worker start, restart and test. The result (float32 weights, the
config, the tokenizer) saved as safetensors loads in under a second, bit for bit the same
tensors. The copy lives in a cache folder (`llm.gguf_cache`), one entry per GGUF file, keyed
by the file's path, size and modification time and by the transformers version that
converted it, written whole to a temporary folder and renamed into place, so that workers
starting together never read half an entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

OFF = "off"
FORMAT = 1  # bump when what an entry holds changes: older entries are then ignored
SOURCE_FILE = "specvox-source.json"


def cache_root(setting: str) -> Path | None:
    """The folder the `llm.gguf_cache` setting names: "" the user's cache folder, "off" none."""
    if setting == OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specvox" / "gguf"


def entry_dir(root: Path, gguf: Path) -> Path:
    """Where the conversion of this version of `gguf` by this transformers lives under `root`."""
    import transformers

    stat = gguf.stat()
    key = json.dumps([str(gguf.resolve()), stat.st_size, stat.st_mtime_ns, transformers.__version__, FORMAT])
    return root / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load(folder: str, gguf_file: str | None, dtype: torch.dtype, offline: bool,
         root: Path | None) -> tuple[Any, Any]:
    """(tokenizer, model) of a checkpoint. A local GGUF file comes from the cache where it holds
    the file's conversion; else it is converted and, when `root` is set, saved there and read
    back, so that the first load and every later one hand out the same thing. Any other
    checkpoint (a folder, a hub id, a GGUF file in the hub's cache) loads as transformers loads it."""
    gguf = Path(folder) / (gguf_file or "")
    entry = entry_dir(root, gguf) if root is not None and gguf_file and gguf.is_file() else None
    if entry is None:
        return _from_pretrained(folder, dtype, gguf_file=gguf_file, local_files_only=offline)
    if not (entry / SOURCE_FILE).is_file():
        started = time.perf_counter()
        # Dequantized to float32 whatever `dtype` is: the entry then serves every dtype.
        tokenizer, model = _from_pretrained(folder, torch.float32, gguf_file=gguf_file, local_files_only=offline)
        if not _save(entry, gguf, tokenizer, model, time.perf_counter() - started):
            return (tokenizer, model) if dtype == torch.float32 else _from_pretrained(
                folder, dtype, gguf_file=gguf_file, local_files_only=offline)
    return _from_pretrained(str(entry), dtype, local_files_only=True)


def _from_pretrained(folder: str, dtype: torch.dtype, **common: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, **common)
    return tokenizer, AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **common)


def _save(entry: Path, gguf: Path, tokenizer: Any, model: Any, convert_s: float) -> bool:
    """Write the entry beside it and rename it into place: whether it is there now. A failure
    only costs the next load its time."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as e:
        log.warning("llm: the GGUF conversion is not cached (%s); set llm.gguf_cache to a writable folder", e)
        return False
    try:
        # transformers refuses to save a model it loaded through its GGUF quantizer. The weights are
        # plain dequantized tensors by now, so the model is saved as the unquantized one it is,
        # without the quantizer's config (which would send the read back through the quantizer).
        quantizer = getattr(model, "hf_quantizer", None)
        quantization = model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer = None
        try:
            model.save_pretrained(staging)
        finally:
            model.hf_quantizer = quantizer
            if quantization is not None:
                model.config.quantization_config = quantization
        tokenizer.save_pretrained(staging)
        source = str(gguf.resolve())
        (staging / SOURCE_FILE).write_text(json.dumps(
            {"gguf": source, "bytes": gguf.stat().st_size, "convert_s": round(convert_s, 1)}, indent=1))
        os.rename(staging, entry)
        log.info("llm: converted %s once in %.1f s; later loads read %s", gguf.name, convert_s, entry)
        _remove_stale(entry, source)
    except (OSError, ValueError, RuntimeError) as e:
        if not (entry / SOURCE_FILE).is_file():  # not another worker having saved it first
            log.warning("llm: the GGUF conversion is not cached (%s)", e)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return (entry / SOURCE_FILE).is_file()


def _remove_stale(entry: Path, gguf: str) -> None:
    """Drop the entries of earlier versions of the same file (or of an earlier transformers)."""
    for other in entry.parent.glob(f"{entry.name.rsplit('-', 1)[0]}-*"):
        source = other / SOURCE_FILE
        if other != entry and source.is_file() and json.loads(source.read_text()).get("gguf") == gguf:
            shutil.rmtree(other, ignore_errors=True)
