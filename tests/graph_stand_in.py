"""A CPU stand-in for the CUDA graphs a `GraphSet` captures (pipeline/llm/cuda_graph_step.py).

Capturing runs the recorded body once on the static inputs (and sleeps `recording_s`, as a real
recording costs some twenty replays); a replay runs the body again on the static inputs and the
buffers of the call and copies its outputs into the recorded ones. Like a real graph, the stand-in
holds no reference to the buffers (so a `GraphBuffers` buffer is free again once its cache is
dropped). So everything around the graph is the real code: the keys a graph is recorded under, the
inputs copied in before a replay, the outputs read after it, the buffers handed from reply to reply
and the recording clock."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.llm.cuda_graph_step import GraphSet, _Recorded


@dataclass
class StandInGraph:
    body: Any  # the recorded body, its constants bound


class CpuGraphs:
    """`GraphSet._capture` and `_replay` without a GPU."""

    def __init__(self, recording_s: float) -> None:
        self.recording_s = recording_s

    def capture(self, body, static: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...]) -> _Recorded:  # noqa: ANN001
        time.sleep(self.recording_s)
        return _Recorded(StandInGraph(body), static, tuple(body(*static, *buffers)))

    @staticmethod
    def replay(recorded: _Recorded, buffers: tuple[torch.Tensor, ...]) -> None:
        for kept, fresh in zip(recorded.outputs, recorded.graph.body(*recorded.inputs, *buffers), strict=True):
            kept.copy_(fresh)


def stand_in(graphs: GraphSet, recording_s: float = 0.0) -> GraphSet:
    """`graphs` capturing and replaying on the CPU from now on."""
    cpu = CpuGraphs(recording_s)
    graphs._capture = cpu.capture  # type: ignore[method-assign]
    graphs._replay = cpu.replay  # type: ignore[method-assign]
    return graphs
