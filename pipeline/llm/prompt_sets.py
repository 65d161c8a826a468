"""The project's prompt sets (shared/data/prompts.json beside the checkout): what the benchmarks and
tests decode, and what `specvox train-draft` evaluates a head on and never trains on.

A lone clone without shared/ beside it gets a small fallback set of the same shape.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

PROMPTS_FILE = Path(__file__).resolve().parents[3] / "shared" / "data" / "prompts.json"
CAPTION = "Rewrite this transcript as a clean caption, keeping the speaker's words: "
FALLBACK = {
    "dialogue": ["Hello there! How is your day going so far?", "Why do cats purr?", "How do bees make honey?"],
    "caption": [CAPTION + "so uh the next slide shows our sales numbers for the last quarter",
                CAPTION + "hey everyone welcome back to the channel today we are going to build a birdhouse",
                CAPTION + "um okay so the the meeting is moved to thursday at three"],
}


@cache
def load_prompts() -> dict[str, list[str]]:
    """{"dialogue": [...], "caption": [...]}."""
    if not PROMPTS_FILE.exists():
        return FALLBACK
    data = json.loads(PROMPTS_FILE.read_text())
    return {"dialogue": data["dialogue"], "caption": data["caption"]}
