"""The browser page's voice to voice beside the gRPC client's, and its lip-sync lag, on a running stack.

`specvox bench page` (after `specvox up`): Debian's headless Chromium, driven by Selenium, opens the page
(services/gateway/static/) with a fake microphone playing a WAV of the bundled voice asking a question.
Each round the page starts a fresh conversation, speaks once, and is measured on its own clock:

- voice to voice as the page hears it: from when the page had captured the last sample of speech (the
  sample the server's `speech_stopped.audio_end_ms` names) to the first reply sample its playback worklet
  played; also to the first reply audio received, and from the WAV's own end of speech;
- the viseme lag: at each change of the drawn mouth, the heard position less the start of the viseme drawn
  (negative: the mouth ahead of the voice);

and then `services/client.py` (the gRPC reference client) converses the same WAV on the same stack, so
both figures come from the same minutes of the same machine. Rounds alternate page and gRPC. A table is
printed and the rows written as JSON (docs/benchmarks/README.md).

tests/e2e/test_page.py drives the page with the same helpers (`chromium`, `Page`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
RATE_HZ = 24_000  # the page's input and output rate (the Realtime API's audio/pcm)
QUESTION = "Can you tell me a long story about a brave little cat who sailed across the sea?"
LISTEN_S = 3.0  # how long each page round listens to the reply (viseme lags) before hanging up

# What the page showed and measured (window.specvox), as JSON; `full` adds every capture chunk's time.
STATE_JS = """
const s = window.specvox, full = arguments[0];
return JSON.stringify({
  connected: s.connected, events: s.events, errors: s.errors, playback: s.playback,
  input: full ? s.input : {samples: s.input.samples, micStarts: s.input.micStarts},
  utterances: s.utterances, drawnCount: s.drawn.length,
  turns: s.turns.map(t => ({responseId: t.responseId, itemId: t.itemId, userItemId: t.userItemId, status: t.status,
    text: t.text, steps: t.steps.length, stepTokens: t.steps.map(x => x.tokens),
    stepsLabelled: t.steps.filter(x => x.el.dataset.tokens !== undefined).length, words: t.words.length,
    visemes: t.visemes, audioSamples: t.audioSamples,
    heardSamples: t.itemId ? s.heard(t.itemId) : 0, interrupted: t.interrupted, cutWhy: t.cutWhy,
    cutPageMs: t.cutPageMs, truncatedAtMs: t.truncatedAtMs, pauses: t.pauses, resumes: t.resumes,
    report: t.report, speculative: t.speculative, t: t.t, waterfall: t.waterfall || null})),
  now: performance.now(),
});
"""


class PageTimeout(AssertionError):
    pass


def chromium_missing() -> str:
    """What is missing to drive Chromium here ("" when nothing is)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install specvox[test])")
    return " and ".join(missing)


def chromium(microphone_wav: Path, profile: str, downloads: Path | None = None):
    """Headless Chromium whose microphone plays `microphone_wav` once (then silence), autoplay allowed;
    what the page offers for download lands in `downloads`."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900",
                 "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
                 f"--use-file-for-fake-audio-capture={microphone_wav}%noloop",
                 "--autoplay-policy=no-user-gesture-required", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    if downloads is not None:
        options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                                  "download.prompt_for_download": False})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


class Page:
    """The page in Chromium, read as a person and a test would: its DOM, its screenshots, `window.specvox`."""

    def __init__(self, driver, artifacts: Path | None = None) -> None:
        self.driver, self.artifacts = driver, artifacts

    def open(self, url: str, api_key: str = "", echo_cancellation: bool = False) -> None:
        """Load the page, set the key and the microphone's processing, press Start."""
        self.driver.get(url)
        self.wait("its script", lambda s: True)
        if api_key:
            self.by_id("key").send_keys(api_key)
        if self.by_id("processing").is_selected() != echo_cancellation:
            self.by_id("processing").click()  # off: Chromium's advice for file capture (no AEC, AGC, NS)
        self.by_id("start").click()

    def state(self, full: bool = False) -> dict:
        """What the page shows; `full`: with every capture chunk's time (large: not while polling)."""
        return json.loads(self.driver.execute_script(STATE_JS, full))

    def js(self, script: str):
        return self.driver.execute_script(script)

    def by_id(self, element_id: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def wait(self, what: str, test, timeout_s: float = 60.0, every_s: float = 0.05) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if test(state):
                return state
            if time.monotonic() > deadline:
                brief = {k: state[k] for k in ("connected", "events", "errors")}
                raise PageTimeout(f"the page never showed {what} within {timeout_s:.0f} s: {json.dumps(brief)[:3000]}")
            time.sleep(every_s)

    def mouth(self) -> str:
        return self.js("return document.querySelector('#face .lips').getAttribute('d')")

    def screenshot(self, name: str, element_id: str | None = None) -> Path:
        assert self.artifacts is not None
        self.artifacts.mkdir(parents=True, exist_ok=True)
        path = self.artifacts / f"{name}.png"
        if element_id:
            self.by_id(element_id).screenshot(str(path))
        else:
            self.driver.save_screenshot(str(path))
        return path


def page_ms_of_input(state: dict, sample: float) -> float:
    """When the page had captured input sample `sample` (its state must be `full`)."""
    return next(ms for sent, ms in state["input"]["chunks"] if sent >= sample)


def speech_bounds_s(samples: np.ndarray, rate_hz: int) -> tuple[float, float]:
    """Where the speech in `samples` begins and ends (20 ms frames above 1 % of full scale)."""
    frame = rate_hz // 50
    rms = np.sqrt(np.mean(samples[: len(samples) // frame * frame].reshape(-1, frame) ** 2, axis=1))
    loud = np.flatnonzero(rms > 0.01)
    return loud[0] * frame / rate_hz, (loud[-1] + 1) * frame / rate_hz


def percentiles(values) -> dict:
    v = np.asarray([x for x in values if x is not None], float)
    if not v.size:
        return {"n": 0, "p50": None, "p95": None}
    return {"n": int(v.size), "p50": round(float(np.percentile(v, 50)), 1),
            "p95": round(float(np.percentile(v, 95)), 1)}


def voice_to_voice(state: dict, turn: dict, file_speech_end_s: float, mic_start: dict) -> dict:
    """The page's figures for one turn, on its own clock, from the end of speech."""
    u = state["utterances"][turn["userItemId"]]
    t = turn["t"]
    file_end = page_ms_of_input(state, mic_start["inputSamples"] + file_speech_end_s * RATE_HZ)
    return {"page_voice_to_voice_ms": round(t["firstPlayed"] - u["speechEndPageMs"]),
            "page_first_audio_received_ms": round(t["firstAudio"] - u["speechEndPageMs"]),
            "page_file_speech_end_to_first_played_ms": round(t["firstPlayed"] - file_end)}


def page_round(page: Page, url: str, api_key: str, speech_end_s: float) -> tuple[dict, list[float]]:
    page.open(url, api_key)
    page.wait("a reply playing", lambda s: bool(s["turns"]) and s["turns"][0]["heardSamples"] > 0, timeout_s=120)
    time.sleep(LISTEN_S)
    state = page.state(full=True)
    lags = page.js("return window.specvox.visemeLagsMs")
    page.by_id("stop").click()
    return voice_to_voice(state, state["turns"][0], speech_end_s, state["input"]["micStarts"][0]), lags


def grpc_round(settings, wav: Path) -> int | None:
    from services.client import ClientOptions, converse

    options = ClientOptions(chunk_ms=40, api_key=settings.auth.api_key, tls=settings.tls)  # 40 ms, as the page
    turns = asyncio.run(converse(settings.address("gateway"), str(wav), options))
    return turns[0].report.get("voice_to_voice_ms") if turns else None


def make_question_wav(folder: Path) -> tuple[Path, float]:
    from pipeline.audio import float_to_pcm16, wav_bytes
    from pipeline.tts.piper_backend import PiperSynthesizer, TtsOptions

    rate = 16_000
    pad = np.zeros(int(0.4 * rate), np.float32)
    speech = PiperSynthesizer(TtsOptions(noise_scale=0.0, noise_w_scale=0.0)).synthesize(QUESTION, rate)
    samples = np.concatenate([pad, speech, pad])
    path = folder / "question.wav"
    path.write_bytes(wav_bytes(float_to_pcm16(samples), rate, 1))
    return path, speech_bounds_s(samples, rate)[1]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {cpu}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run(settings, rounds: int, json_path: str | None) -> int:
    missing = chromium_missing()
    if missing:
        print(f"bench page: {missing} missing (apt-get install chromium chromium-driver)")
        return 2
    scheme = "https" if settings.tls.server_on else "http"
    url = f"{scheme}://{settings.host}:{settings.http_port}/"
    try:
        socket.create_connection((settings.host, settings.http_port), timeout=5).close()
    except OSError as e:
        print(f"bench page: nothing answers at {url} ({e}); it drives a running stack: start `specvox up` first")
        return 2
    rows: list[dict] = []
    lags: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-page-") as folder:
        wav, speech_end_s = make_question_wav(Path(folder))
        driver = chromium(wav, str(Path(folder) / "profile"))
        try:
            page = Page(driver)
            for i in range(rounds):
                figures, round_lags = page_round(page, url, settings.auth.api_key, speech_end_s)
                figures["grpc_client_voice_to_voice_ms"] = grpc_round(settings, wav)
                rows.append(figures)
                lags += round_lags
                print(f"round {i + 1}/{rounds}: page {figures['page_voice_to_voice_ms']} ms, "
                      f"gRPC client {figures['grpc_client_voice_to_voice_ms']} ms", flush=True)
        finally:
            driver.quit()
    keys = ("page_voice_to_voice_ms", "page_first_audio_received_ms", "page_file_speech_end_to_first_played_ms",
            "grpc_client_voice_to_voice_ms")
    summary = {k: percentiles(r[k] for r in rows) for k in keys}
    summary["viseme_lag_ms"] = percentiles(lags)
    summary["viseme_lag_abs_ms"] = percentiles(np.abs(np.asarray(lags, float)))
    result = {"command": f"specvox bench page --rounds {rounds}", "machine": machine(), "commit": commit(),
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rounds": rows, "summary": summary}
    print(f"\n{'ms':45} {'n':>3} {'p50':>8} {'p95':>8}")
    for name, p in summary.items():
        print(f"{name:45} {p['n']:>3} {p['p50']!s:>8} {p['p95']!s:>8}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="page rounds, each followed by a gRPC client round")
    parser.add_argument("--json", dest="json_path", default="docs/benchmarks/results/page.json",
                        help="write the rows here (default: %(default)s, the current figures)")


def run_from_args(settings, args: argparse.Namespace) -> int:
    return run(settings, args.rounds, args.json_path)
