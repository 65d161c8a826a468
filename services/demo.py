"""`specvox demo`: one spoken turn through `specvox up` and the reference client.

Makes a spoken question with the bundled voice unless given a WAV, starts the whole
stack as a user would, streams the question in real time, prints what happened and
writes reply.wav, captions.vtt and report.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

DEFAULT_QUESTION = "Can you recommend a good book for a long train ride?"
READY_LINE = "all services ready"
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 30  # Ctrl-C drains every service (their drain grace, 10 s by default), then SIGKILL
PROGRESS_EVERY_S = 10.0


def run_demo(settings, wav: str | None, out_dir: str, question: str = DEFAULT_QUESTION) -> int:
    from services.cli import say_to_file
    from services.client import ClientOptions, converse, write_outputs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not wav:
        wav = str(out / "question.wav")
        say_to_file(settings, question, wav, sample_rate_hz=16_000, pad_s=0.5)
    with specvox_up(out / "up.log"):
        print(f"streaming {wav} to the gateway in real time …", flush=True)
        options = ClientOptions(max_message_bytes=settings.max_message_bytes, api_key=settings.auth.api_key,
                                tls=settings.tls)
        turns = asyncio.run(converse(settings.address("gateway"), wav, options))
        report = write_outputs(turns, str(out))
    print_summary(report, out)
    return 0


@contextlib.contextmanager
def specvox_up(log_path: Path) -> Iterator[subprocess.Popen]:
    """`specvox up` (its output in `log_path`) from ready until the block ends, then Ctrl-C, and
    SIGKILL if it has not stopped in STOP_TIMEOUT_S. The demo's and the benchmarks' one way to run
    the stack. A SIGTERM to this process meanwhile ends the block too, so that the stack is not
    left running without its parent."""
    print(f"starting specvox up (log: {log_path}) …", flush=True)
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], stdout=log,
                              stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        with _terminate_as_interrupt():
            _wait_ready(up, log_path)
            yield up
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so `finally` blocks run (in the main
    thread only, where Python delivers signals; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _wait_ready(up: subprocess.Popen, log_path: Path) -> None:
    """Until the log says every service is ready; the time so far on one line rewritten on a
    terminal, a line every PROGRESS_EVERY_S otherwise (a log file)."""
    started, said = time.monotonic(), 0.0
    on_terminal = sys.stdout.isatty()
    while READY_LINE not in log_path.read_text(errors="replace"):
        elapsed = time.monotonic() - started
        if up.poll() is not None or elapsed > START_TIMEOUT_S:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise SystemExit(f"specvox up did not become ready:\n{tail}")
        if on_terminal:
            print(f"\r  loading models … {elapsed:4.0f} s", end="", flush=True)
        elif elapsed - said >= PROGRESS_EVERY_S:
            said = elapsed
            print(f"  loading models … {elapsed:.0f} s", flush=True)
        time.sleep(0.5)
    print(f"{chr(13) if on_terminal else ''}  all four services ready after {time.monotonic() - started:.0f} s",
          flush=True)


def print_summary(report: dict, out: Path) -> None:
    print()
    print(f"you said        {report['transcript']}")
    print(f"avatar said     {report['reply_text']}")
    print(f"voice to voice  {report['voice_to_voice_ms']} ms  (end of your speech → first reply audio; "
          f"budget {report['budget_ms']} ms)")
    print(f"reply audio     {report['reply_audio_s']} s")
    print("stage timings, ms after the end of your speech:")
    print(f"  {'stage':<8} {'first in':>9} {'first out':>10} {'last out':>9}")
    for stage, times in report["stages"].items():
        rel = times["ms_after_speech_end"]
        print(f"  {stage:<8} {rel['first_in']:>9} {rel['first_out']:>10} {rel['last_out']:>9}")
    print(f"wrote {out}/reply.wav, {out}/captions.vtt, {out}/report.json")
