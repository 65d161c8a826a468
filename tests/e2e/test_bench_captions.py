"""`specvox bench captions --quick`, the benchmark's CI share: a real telephone call (two people, not
synthesized here) and two sentences of the bundled voices, captioned as files by the real models, and
judged against their references. Speed is printed by the benchmark, never asserted."""

from __future__ import annotations

import json

from bench.captions import run
from services.settings import Settings


def test_quick_bench_captions_judges_real_speech_against_its_reference(tmp_path, capsys):
    path = tmp_path / "captions.json"
    results = run(Settings(), ["file"], None, quick=True, voices=True, json_path=str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    rows = {r["clip"]: r for r in results["file"]["rows"]}
    assert set(rows) == {"telephone-diane-sheila", "bundled-voices"}
    assert [c["speakers"] for c in results["clips"]][0] == 2
    for row in rows.values():
        assert row["utterances"] >= 1 and row["reference_words"] > 10
        assert row["asr_wer"] < 0.5 and row["caption_wer"] < 0.5, row["captions"]
        # Faithful captions (issue 34): no caption word that its transcript did not say.
        assert row["unsaid_words"] == 0, row["unsaid_examples"]
        assert row["timed_words_matched"] >= row["timed_words"] // 2 > 0
        assert row["timing_ms_p50"] < 500  # a caption word's start, against where the reference says it starts
        assert row["x_realtime"] > 0 and row["cues"] > 0
    out = capsys.readouterr().out
    assert "### file" in out and "| telephone-diane-sheila | 30.0 |" in out
