"""services/stack.py's free ports: from the kernel by default, from a block where one is named."""

from __future__ import annotations

import socket

import pytest

from services.stack import PortBlock, free_ports


def test_a_block_hands_out_consecutive_spans_once_and_skips_a_taken_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1] + 10  # near a port the kernel just gave, most likely free
    block = PortBlock(range(base, base + 9))
    assert block.take(3) == base
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 4))  # inside the next span: that span is skipped
        assert block.take(3) == base + 6
    with pytest.raises(RuntimeError, match="used up"):
        block.take(1)


def test_free_ports_are_bindable():
    first = free_ports(4)
    for port in range(first, first + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
