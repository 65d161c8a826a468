"""A model shipped in parts (whisper base, in two PyPI packages) joined once into the model cache."""

from __future__ import annotations

import os

from pipeline.models import join_parts


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
