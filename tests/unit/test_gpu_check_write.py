"""bench/gpu_check.sh's last step on this machine (no GPU needed): the figures of bench spec and bench batch
JSON files written under the docs' marker, each batch row against its drafter's one reply."""

from __future__ import annotations

import json
import os
import subprocess

from tests.conftest import ROOT

MARKER = "<!-- gpu_check.sh writes its dated figures below this line -->"


def batch_row(drafter: str, sessions: int, tokens_per_s: float) -> dict:
    return {"drafter": drafter, "max_verify_tokens": None, "sessions": sessions, "max_new_tokens": 64,
            "dtype": "float32", "device": "cuda", "one_at_a_time_tokens_per_s": 170.0,
            "batched_tokens_per_s": tokens_per_s, "mean_rows_per_step": float(sessions), "identical": True,
            "batched_speedup": tokens_per_s / 170.0}


def test_the_write_step_puts_the_batch_table_under_the_marker(tmp_path):
    docs = tmp_path / "history.md"
    docs.write_text(f"# history\n{MARKER}\n\n#### an older check\n")
    batch = tmp_path / "batch_float32.json"
    batch.write_text(json.dumps([batch_row("none", 1, 160.0), batch_row("none", 32, 1760.0)]))
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--write", str(batch)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "DOCS": str(docs),
                                                       "PYTHON": str(ROOT / ".venv" / "bin" / "python")})
    assert done.returncode == 0, done.stderr
    text = docs.read_text()
    assert text.index("#### GPU check") < text.index("#### an older check")  # the newest first
    assert "| none | none | 1 | 160.0 | 1.00× | 170.0 | 1.00 | yes |" in text
    assert "| none | none | 32 | 1760.0 | 11.00× | 170.0 | 32.00 | yes |" in text
