"""When each stretch of the input audio reached the gateway: a turn's budget runs from the
arrival of the end of the user's speech, not from when the ASR got round to it."""

from __future__ import annotations

import bisect
from typing import Any

from pipeline.audio import AudioStreamReader, PcmFormat
from services.gateway.ports import Clock

# The arrival times of the latest stretch of audio only, so an hour-long stream holds no more than a short one.
KEPT_AUDIO_S = 120.0


class AudioArrivalClock:
    """Maps a time in the input audio to when the gateway received it (Unix ms).

    It keeps the last KEPT_AUDIO_S of audio: a stream open for an hour would otherwise hold two list
    entries per chunk (~6 MB an hour at 40 ms chunks). `received` raises AudioFormatError (a
    ValueError) for audio that does not match the declared format."""

    def __init__(self, fmt: Any, clock: Clock) -> None:
        declared = PcmFormat(fmt.sample_rate_hz, fmt.channels or 1, fmt.sample_width_bytes or 2)
        self.reader = AudioStreamReader(fmt.encoding, declared)
        self._clock = clock
        self._audio_bytes = 0
        self._ends_s: list[float] = []
        self._arrivals_ms: list[int] = []

    def received(self, chunk: bytes) -> None:
        self._audio_bytes += len(self.reader.feed(chunk))
        if self.reader.format is not None:
            end_s = self._audio_bytes / self.reader.format.bytes_per_s
            self._ends_s.append(end_s)
            self._arrivals_ms.append(self._clock.unix_ms())
            if self._ends_s[0] < end_s - 2 * KEPT_AUDIO_S:  # dropped in halves: amortised O(1) a chunk
                cut = bisect.bisect_left(self._ends_s, end_s - KEPT_AUDIO_S)
                del self._ends_s[:cut], self._arrivals_ms[:cut]

    def arrival_ms(self, audio_s: float) -> int:
        i = bisect.bisect_left(self._ends_s, audio_s - 1e-6)
        return self._arrivals_ms[min(i, len(self._arrivals_ms) - 1)] if self._arrivals_ms else 0
