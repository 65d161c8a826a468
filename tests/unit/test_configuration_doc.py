"""docs/configuration.md lists every setting the code reads, with the code's default.

The meanings there are written by hand; which variables exist and what they default to come
from `services.settings.Settings` and the option dataclasses it nests, so this test fails
when a setting is added, renamed, removed or given another default without the doc.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from services.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(SPECVOX_[A-Z0-9_]+)` \| (.*?) \| .* \|$")


def settings_defaults() -> dict[str, object]:
    """Every SPECVOX_* variable the settings read, with its default."""
    out: dict[str, object] = {}

    def nested(prefix: str, options: object) -> None:
        for f in dataclasses.fields(options):  # type: ignore[arg-type]
            value = getattr(options, f.name)
            if dataclasses.is_dataclass(value):
                nested(f"{prefix}{f.name.upper()}__", value)
            else:
                out[f"{prefix}{f.name.upper()}"] = value

    for name, field in Settings.model_fields.items():
        if dataclasses.is_dataclass(field.default):
            nested(f"SPECVOX_{name.upper()}__", field.default)
        else:
            out[f"SPECVOX_{name.upper()}"] = field.default
    return out


def shown(value: object) -> str:
    """A default as the doc writes it: what the variable would be set to."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, dict | tuple | list):
        return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"
    return f"`{value}`" if value != "" else '`""`'


def documented() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        if match := ROW.match(line):
            assert match[1] not in rows, f"{match[1]} is listed twice"
            rows[match[1]] = match[2]
    return rows


def test_every_setting_is_documented_with_its_default() -> None:
    defaults, rows = settings_defaults(), documented()
    assert sorted(set(defaults) - set(rows)) == [], "settings missing from docs/configuration.md"
    assert sorted(set(rows) - set(defaults)) == [], "docs/configuration.md lists variables the settings do not read"
    wrong = {name: (rows[name], shown(value)) for name, value in defaults.items() if rows[name] != shown(value)}
    assert wrong == {}, "documented default (doc, code)"
