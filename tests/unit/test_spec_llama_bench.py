"""bench spec's llama.cpp row: llama.cpp's own llama-bench, run as a process and read from its JSON,
or a row that says why it is missing."""

from __future__ import annotations

import json
import stat

from bench.spec import LLAMA_CPP, LlamaBench, print_table


def fake_llama_bench(tmp_path, n_gen: int, samples_ns: list[int]):
    """A stand-in binary that prints what `llama-bench -o json` prints, and records its arguments."""
    result = [{"build_commit": "0c1e570", "build_number": 1, "cpu_info": "test CPU", "backends": "CPU",
               "n_threads": 1, "n_prompt": 0, "n_gen": n_gen, "samples_ns": samples_ns,
               "avg_ts": 1e9 * n_gen / (sum(samples_ns) / len(samples_ns))}]
    binary = tmp_path / "llama-bench"
    binary.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\ncat <<'EOF'\n{json.dumps(result)}\nEOF\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_the_row_is_timed_by_the_binary_on_the_gguf_and_threads(tmp_path):
    binary = fake_llama_bench(tmp_path, 128, [1_600_000_000])
    bench = LlamaBench(str(binary), "/models/target.Q4_1.gguf", threads=2, tokens=128)
    assert bench.generate() == (128, 1.6)
    assert (tmp_path / "argv").read_text().split() == [
        "-m", "/models/target.Q4_1.gguf", "-p", "0", "-n", "128", "-t", "2", "-r", "1", "-o", "json"]
    described = bench.describe()
    assert described["command"] == "llama-bench -m target.Q4_1.gguf -p 0 -n 128 -t 2 -r 1 -o json"
    assert described["llama_cpp"]["build_commit"] == "0c1e570"


def test_a_missing_binary_is_a_row_that_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPECVOX_LLAMA_BENCH", raising=False)
    runner, why = LlamaBench.for_target("bundled", 128, str(tmp_path / "nowhere" / "llama-bench"))
    assert runner is None
    assert "no llama-bench binary" in why and "build_llama_bench.sh" in why
    print_table([{"workload": "dialogue", "method": LLAMA_CPP, "tokens_per_s": None, "missing": why}])
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.split()[:3] == ["dialogue", LLAMA_CPP, "missing:"] and "no llama-bench binary" in last
