"""The GGUF conversion cache (pipeline/llm/gguf_cache.py): a load read back from the cache is the
GGUF load, bit for bit, in every dtype; a cache that cannot be written costs time, never a load."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from pipeline.llm import gguf_cache
from pipeline.llm.engine import GenerationRequest, Generator
from pipeline.llm.model import LoadedModel, load_model
from pipeline.llm.options import LlmOptions
from pipeline.llm.prompts import Task, chat_messages, encode_chat

MESSAGES = [{"role": "user", "content": "Could you tell me, in a sentence or two, why the sky looks blue?"}]


def assert_same_load(cached: LoadedModel, direct: LoadedModel) -> None:
    a, b = cached.model.state_dict(), direct.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    buffers = dict(direct.model.named_buffers())
    for name, buffer in cached.model.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    config, expected = cached.model.config.to_dict(), direct.model.config.to_dict()
    # Where it was read from, the GGUF quantizer's own, and the class save_pretrained records.
    for key in ("_name_or_path", "quantization_config", "architectures"):
        config.pop(key, None), expected.pop(key, None)
    assert config == expected
    assert cached.model.generation_config.to_dict() == direct.model.generation_config.to_dict()
    assert cached.tokenizer.get_vocab() == direct.tokenizer.get_vocab()
    assert cached.tokenizer.apply_chat_template(MESSAGES) == direct.tokenizer.apply_chat_template(MESSAGES)
    assert (cached.eos_token_ids, cached.context_tokens, cached.weights) == (
        direct.eos_token_ids, direct.context_tokens, direct.weights)
    replies = []
    for loaded in (cached, direct):
        prompt = tuple(encode_chat(loaded.tokenizer, chat_messages(Task.DIALOGUE, MESSAGES[0]["content"])))
        replies.append([t for step in Generator(loaded).steps(GenerationRequest(prompt, 24, "none"))
                        for t in step.token_ids])
    assert replies[0] == replies[1] and len(replies[0]) > 0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A cache folder holding the bundled target's conversion, made by a first load (float32),
    and what that load returned."""
    root = tmp_path_factory.mktemp("gguf-cache")
    return root, load_model(LlmOptions(gguf_cache=str(root)))


def test_the_cached_float32_load_is_the_gguf_load_and_converts_once(tmp_path, caplog, converted):
    root, first = converted
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    with caplog.at_level(logging.INFO, logger="pipeline.llm.gguf_cache"):
        direct = load_model(LlmOptions(gguf_cache=str(unwritable / "cache")))  # converted, not saved
        assert "the GGUF conversion is not cached" in caplog.text
        caplog.clear()
        later = load_model(LlmOptions(gguf_cache=str(root)))
    assert "converted" not in caplog.text  # read back, not converted again
    (entry,) = root.iterdir()  # nothing left half-written beside it
    assert json.loads((entry / gguf_cache.SOURCE_FILE).read_text())["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())
    assert direct.weights == "int4-exact"  # the stored codes are recognized in the read-back weights too
    assert_same_load(first, direct)
    assert_same_load(later, direct)


def test_the_cached_bfloat16_load_is_the_gguf_load(converted):
    root = converted[0]
    options = {"dtype": "bfloat16", "weights": "int4"}
    direct = load_model(LlmOptions(**options, gguf_cache=gguf_cache.OFF))
    assert_same_load(load_model(LlmOptions(**options, gguf_cache=str(root))), direct)


def test_an_entry_is_keyed_by_the_files_version_and_an_older_one_is_removed(tmp_path):
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    root = tmp_path / "cache"
    first = gguf_cache.entry_dir(root, gguf)
    assert gguf_cache.entry_dir(root, gguf) == first
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 1_000_000))
    second = gguf_cache.entry_dir(root, gguf)
    assert second != first and second.parent == first.parent == root
    other = root / "model.Q4_1-0123456789abcdef"  # another file with the same name, elsewhere
    for folder, source in ((first, gguf), (second, gguf), (other, tmp_path / "elsewhere" / gguf.name)):
        folder.mkdir(parents=True)
        (folder / gguf_cache.SOURCE_FILE).write_text(json.dumps({"gguf": str(source.resolve())}))
    gguf_cache._remove_stale(second, str(gguf.resolve()))
    assert sorted(root.iterdir()) == sorted([second, other])


@pytest.mark.parametrize(("setting", "expected"), [
    ("off", None), ("/srv/specvox-cache", "/srv/specvox-cache"), ("", "XDG/specvox/gguf")])
def test_the_setting_names_the_folder(monkeypatch, setting, expected):
    monkeypatch.setenv("XDG_CACHE_HOME", "XDG")
    root = gguf_cache.cache_root(setting)
    assert (None if root is None else str(root)) == expected
