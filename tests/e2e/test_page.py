"""The browser page (services/gateway/page.py, services/gateway/static/): served by the gateway, and used by a
person in a real Chromium.

First what the gateway serves: the page and its files without an API key when keys are on (the Realtime
WebSocket it opens still needs one), nothing fetched from elsewhere, no path outside the page's folder.

Then one conversation in Debian's headless Chromium, driven by Selenium, against `specvox up` (the `stack`
fixture), with Chromium's fake microphone playing a WAV of speech made here. The assertions are what a
person would notice: the transcript appears; the reply is played (the playback worklet's sample counter
advances, its level is not silence); the mouth moves with the visemes while the reply plays and rests after;
the captions come word by word, in order, as the words are heard; speaking over the reply pauses it within
300 ms and interrupts the turn; the waterfall shows the turn's figures. The second utterance is the same file
again: turning the page's microphone off and on restarts Chromium's fake capture from the file's start.

Then the same page in Firefox (Debian's firefox-esr driven by puppeteer-core over WebDriver BiDi, since Debian
has no geckodriver: tests/clients/firefox/page.mjs), hearing a WAV played into a PulseAudio null device.

Screenshots are kept in test-artifacts/page/. The benchmark (the page's voice to voice beside the gRPC
client's, on the same stack and the same speech; the lag of each drawn viseme behind the sample it belongs
to) is printed and written to test-artifacts/page/bench_page.json (docs/benchmarks/README.md).

A browser missing outside CI: skipped; under CI=true: failed (.ci/run installs them).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from bench.page import Page, chromium, chromium_missing, page_ms_of_input, percentiles, speech_bounds_s, voice_to_voice
from services.gateway import page
from services.gateway.web import http_surfaces
from services.server.auth import AuthOptions, hash_key
from services.settings import Settings
from services.stack import free_port
from services.tls import TlsOptions
from tests.certs import Authority
from tests.conftest import ROOT, write_wav
from tests.inprocess import serve_one

pytestmark = pytest.mark.e2e

KEY = "svk_page-test-key-000000000000000000000000"
ARTIFACTS = Path(os.environ.get("SPECVOX_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "page"
SAY = "Can you tell me a long story about a brave little cat who sailed across the sea?"
RATE_HZ = 24_000  # the page's input and output rate (the Realtime API's audio/pcm)
PAUSE_WITHIN_MS = 300
PLAYED_BEFORE_BARGE_IN_S = 1.5
FACE_CHANGE_WITHIN_S = 6.0


# ---- what the gateway serves -------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def keyed_gateway(redis_url):
    settings = Settings(redis_url=redis_url, auth=AuthOptions(keys=f"acme:{hash_key(KEY)}"), http_port=free_port(),
                        gateway_port=free_port())
    async with serve_one(settings, "gateway"):
        yield f"http://127.0.0.1:{settings.http_port}"


async def test_the_page_and_its_files_answer_without_a_key(keyed_gateway):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{keyed_gateway}/") as r:
            html = await r.text()
            assert r.status == 200 and r.content_type == "text/html", (r.status, html[:300])
        assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
        assert "/static/app.js" in assets and "/static/style.css" in assets
        for path in assets + ["/static/capture-worklet.js", "/static/playback-worklet.js"]:
            async with http.get(f"{keyed_gateway}{path}") as r:
                assert r.status == 200, path
                assert r.content_type in ("text/css", "application/javascript", "text/javascript"), path
        async with http.get(f"{keyed_gateway}/v1/models") as r:  # the data still needs the key
            assert r.status == 401
        async with http.get(f"{keyed_gateway}/v1/realtime") as r:
            assert r.status == 401


async def test_every_module_the_page_imports_is_served_and_nothing_comes_from_elsewhere(keyed_gateway):
    async with aiohttp.ClientSession() as http:
        for source in sorted(page.STATIC_DIR.iterdir()):
            text = source.read_text()
            # the one absolute URL allowed is SVG's namespace name, which is never fetched
            assert not re.findall(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}/(?!2000/svg)", text.replace(
                "http://www.w3.org/2000/svg", "")), f"{source.name} refers to another site"
            for name in re.findall(r'from "\./([^"]+)"|new URL\("([^".]+\.js)"', text):
                name = next(n for n in name if n)
                async with http.get(f"{keyed_gateway}/static/{name}") as r:
                    assert r.status == 200, f"{source.name} imports {name}, not served"


async def test_no_path_outside_the_page_folder_and_no_listing(keyed_gateway):
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        for path in ("/static/", "/static/../page.py", "/static/%2e%2e/page.py", "/static/..%2fpage.py",
                     "/static/nothing-here.js"):
            async with http.get(f"{keyed_gateway}{path}") as r:
                body = await r.text()
                assert r.status in (403, 404), (path, r.status)
                assert "add_routes" not in body and "app.js" not in body, path


async def test_over_tls_the_page_is_https_and_its_websocket_wss_with_the_key(redis_url, tmp_path):
    """The gateway's TLS settings serve the page as https:// (a secure context from any machine, so the browser
    gives it the microphone), and its Realtime socket as wss:// taking the key as the page presents it."""
    ca = Authority(tmp_path / "ca")
    pair = ca.issue("gateway")
    settings = Settings(redis_url=redis_url, auth=AuthOptions(keys=f"acme:{hash_key(KEY)}"), http_port=free_port(),
                        gateway_port=free_port(), tls=TlsOptions(cert_file=str(pair.cert), key_file=str(pair.key)))
    trusted = ssl.create_default_context(cafile=str(ca.ca_file))
    base = f"127.0.0.1:{settings.http_port}"
    async with serve_one(settings, "gateway"), aiohttp.ClientSession() as http:
        async with http.get(f"https://{base}/", ssl=trusted) as r:
            assert r.status == 200 and "app.js" in await r.text()
        for protocols, refused in ((("realtime",), True), (("realtime", f"openai-insecure-api-key.{KEY}"), False)):
            with pytest.raises(aiohttp.WSServerHandshakeError) as handshake:
                # with the key, the upgrade reaches the Realtime route, which finds no stages here (503)
                await http.ws_connect(f"wss://{base}/v1/realtime", ssl=trusted, protocols=protocols)
            assert (handshake.value.status == 401) == refused, handshake.value


def test_specvox_up_prints_the_page_address():
    lines = http_surfaces(Settings(http_port=50123))
    assert any(line.startswith("http://") and ":50123/ " in line and "page" in line for line in lines), lines


# ---- a conversation in Chromium ------------------------------------------------------------------------

@pytest.fixture(scope="session")
def chromium_installed() -> None:
    """Before the stack starts (a session fixture listed first): no stack for a test that will skip."""
    missing = chromium_missing()
    if missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{missing} missing; CI must install them (apt-get install chromium chromium-driver)")
        pytest.skip(f"{missing} missing (apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def conversation(chromium_installed, stack, speech, tmp_path_factory):
    """One conversation on the page, watched as it happens: what was seen while the reply played, at the
    barge-in, and after; the page's state at each step."""
    folder = tmp_path_factory.mktemp("page")
    samples = speech(SAY, 16_000)
    wav = write_wav(folder / "say.wav", samples, 16_000)
    onset_s, end_s = speech_bounds_s(samples, 16_000)
    driver = chromium(wav, tempfile.mkdtemp(prefix="chromium-", dir=folder))
    seen: dict = {"wav": wav, "onset_s": onset_s, "end_s": end_s, "mouths": [], "faces": [], "played": []}
    try:
        p = Page(driver, ARTIFACTS)
        p.open(f"http://{stack['http']}/")  # echo cancellation off, as Chromium advises for file capture
        seen["rest_mouth"] = p.mouth()
        first = p.wait("the first reply playing", lambda s: bool(s["turns"]) and s["turns"][0]["heardSamples"] > 0,
                       timeout_s=120)
        # while the reply plays: the counter, the mouth, the face. A screenshot can take half a second on a
        # loaded machine and may each time fall between words (the mouth closed): screenshots go on, up to
        # FACE_CHANGE_WITHIN_S, until two differ
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < PLAYED_BEFORE_BARGE_IN_S or (
                len(set(seen["faces"])) < 2 and elapsed < FACE_CHANGE_WITHIN_S):
            seen["played"].append(p.js("return Number(document.getElementById('played').value)"))
            seen["mouths"].append(p.mouth())
            if len(seen["faces"]) < 6 or len(set(seen["faces"])) < 2:
                seen["faces"].append(p.screenshot(f"face-speaking-{len(seen['faces'])}", "face").read_bytes())
            time.sleep(0.05)
        p.screenshot("page-speaking")
        seen["while_playing"] = p.state()
        # the same question again, spoken over the reply: the microphone off and on restarts the file
        p.by_id("mic").click()
        p.by_id("mic").click()
        p.wait("the first reply interrupted",
               lambda s: s["turns"][0]["status"] == "cancelled" and s["turns"][0]["report"] is not None, timeout_s=60)
        seen["after_barge_in"] = p.state(full=True)
        time.sleep(1.0)
        seen["after_barge_in_1s"] = p.state()
        p.screenshot("page-interrupted")
        last = p.wait("the second reply played out", lambda s: len(s["turns"]) >= 2 and s["turns"][-1]["status"]
                      and s["turns"][-1]["report"] is not None
                      and s["turns"][-1]["heardSamples"] >= s["turns"][-1]["audioSamples"] - 1, timeout_s=180)
        time.sleep(0.5)
        seen["mouth_after"] = p.mouth()
        seen["viseme_after"] = p.js("return document.querySelector('#face svg').dataset.viseme")
        p.screenshot("face-at-rest", "face")
        p.screenshot("page")
        seen["final"] = p.state(full=True)
        seen["drawn"] = json.loads(p.js("return JSON.stringify(window.specvox.drawn)"))
        seen["captions"] = json.loads(p.js("return JSON.stringify(window.specvox.captionsShown)"))
        seen["lags_ms"] = p.js("return window.specvox.visemeLagsMs")
        seen["waterfall_rows"] = p.js("return [...document.querySelectorAll('#waterfall .row')].map("
                                      "r => [r.dataset.label, r.dataset.ms])")
        seen["first_state"], seen["last_state"] = first, last
        yield seen
    finally:
        driver.quit()


def test_the_final_transcript_appears(conversation):
    final = conversation["final"]
    shown = [u["transcript"] for u in final["utterances"].values() if u["transcript"]]
    assert shown, final["events"]
    words = set(re.findall(r"[a-z]+", shown[0].lower()))
    assert {"brave", "cat", "sea"} <= words, shown[0]


def test_the_reply_is_played_and_is_not_silence(conversation):
    played = conversation["played"]
    assert played[-1] > played[0] > 0, played  # the page's counter of samples the worklet played
    assert conversation["final"]["playback"]["maxLevel"] > 0.02, conversation["final"]["playback"]


def test_the_mouth_follows_the_visemes_and_rests_after(conversation):
    turns = conversation["final"]["turns"]
    received = {t["itemId"]: t["visemes"] for t in turns}
    assert all(received.values()), "no specvox.viseme events reached the page (Realtime extension events)"
    assert len(set(conversation["mouths"])) >= 3, "the mouth hardly changed while the reply played"
    assert len(set(conversation["faces"])) >= 2, (
        f"the face's {len(conversation['faces'])} screenshots did not change while the reply played")
    drawn = [d for d in conversation["drawn"] if d["source"] == "viseme" and d["viseme"] != "sil"]
    assert len({d["viseme"] for d in drawn}) >= 3, drawn[:20]
    for d in drawn:  # every shape drawn is the viseme of the sound heard as it is on screen
        assert any(v["viseme"] == d["viseme"] and v["start_ms"] <= d["forMs"] < v["end_ms"]
                   for v in received[d["item"]]), d
    assert conversation["viseme_after"] == "sil"
    assert conversation["mouth_after"] == conversation["rest_mouth"]


def test_each_verify_steps_tokens_are_one_labelled_group(conversation):
    """The reply's text in groups, one per verify step (a transcript delta), each labelled with the tokens that
    step accepted (specvox.verify_step); the counts add up to the turn report's speculative statistics."""
    last = conversation["final"]["turns"][-1]
    tokens, speculative = last["stepTokens"], last["speculative"]
    assert tokens and all(isinstance(n, int) for n in tokens), tokens
    assert last["stepsLabelled"] == last["steps"] == len(tokens)
    assert (len(tokens), sum(tokens)) == (speculative["verify_steps"], speculative["accepted_tokens"]), speculative


def test_captions_come_in_order_as_the_words_are_heard(conversation):
    first = conversation["final"]["turns"][0]
    shown = [c for c in conversation["captions"] if c["item"] == first["itemId"]]
    assert len(shown) >= 3, shown
    starts = [c["startMs"] for c in shown]
    assert starts == sorted(starts)
    assert all(c["heardMs"] >= c["startMs"] for c in shown)  # never before the word is heard
    pages = [c["pageMs"] for c in shown]
    assert pages == sorted(pages) and pages[-1] - pages[0] > 300, pages  # word by word, not all at once


def test_speaking_over_the_reply_pauses_it_at_once_and_interrupts_the_turn(conversation):
    state = conversation["after_barge_in"]
    first = state["turns"][0]
    restart = state["input"]["micStarts"][1]
    onset_page_ms = page_ms_of_input(state, restart["inputSamples"] + conversation["onset_s"] * RATE_HZ)
    stopped = [ms for ms in [*(p["pageMs"] for p in first["pauses"]), first["cutPageMs"]] if ms]
    assert stopped, first
    pause_ms = min(stopped) - onset_page_ms
    conversation["pause_ms"] = pause_ms
    assert pause_ms <= PAUSE_WITHIN_MS, f"playback paused {pause_ms:.0f} ms after the speech over it began"
    assert first["interrupted"] and first["truncatedAtMs"] is not None, first
    report = first["report"]
    assert report["interrupts"] >= 1 and report["cut_off"], report
    assert not state["errors"], state["errors"]  # the truncate was taken
    assert report["heard_text"] and report["heard_text"] != report["reply_text"], report
    later = conversation["after_barge_in_1s"]["turns"][0]
    assert later["audioSamples"] == first["audioSamples"], "reply audio still came after the interruption"


def test_the_waterfall_shows_the_turns_figures(conversation):
    rows = dict(conversation["waterfall_rows"])
    page_rows = ("ASR final", "first token", "first audio", "first played")
    figures = [float(rows[label]) for label in page_rows]
    assert figures == sorted(figures) and figures[0] > 0, rows
    last = conversation["final"]["turns"][-1]
    assert all(last["waterfall"][label] == int(rows[label]) for label in page_rows)
    assert rows.get("gateway first sent"), rows  # the server's own figures, from the turn report


def test_benchmark_voice_to_voice_beside_the_grpc_client_and_the_viseme_lag(conversation, stack):
    """Not a check of speed: the figures for docs/benchmarks/README.md, printed and written as JSON."""
    from services.client import ClientOptions, converse

    state = conversation["final"]
    figures = voice_to_voice(state, state["turns"][0], conversation["end_s"], state["input"]["micStarts"][0])
    grpc_turns = asyncio.run(converse(stack["gateway"], str(conversation["wav"]), ClientOptions(chunk_ms=40)))
    lags = np.asarray(conversation["lags_ms"], float)
    figures |= {
        "grpc_client_voice_to_voice_ms": grpc_turns[0].report.get("voice_to_voice_ms"),
        "viseme_lag_ms": percentiles(lags),  # signed: negative, the mouth ahead of the voice
        "viseme_lag_abs_ms": percentiles(np.abs(lags)),
        "pause_after_speech_over_reply_ms": conversation.get("pause_ms"),
    }
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "bench_page.json").write_text(json.dumps(figures, indent=2))
    print("\n" + "\n".join(f"{k:42} {v}" for k, v in figures.items()))
    assert figures["page_voice_to_voice_ms"] > 0


# ---- the same page in Firefox --------------------------------------------------------------------------

FIREFOX_CLIENT = ROOT / "tests" / "clients" / "firefox"
FIREFOX_TOOLS = ("firefox-esr", "pulseaudio", "pactl", "paplay", "node")


@pytest.fixture(scope="session")
def firefox_installed() -> None:
    """Before the stack starts: Debian's firefox-esr and PulseAudio, and puppeteer-core (`make firefox-client`)."""
    missing = [tool for tool in FIREFOX_TOOLS if not shutil.which(tool)]
    if not (FIREFOX_CLIENT / "node_modules" / "puppeteer-core").is_dir():
        missing.append("tests/clients/firefox/node_modules (make firefox-client)")
    if missing:
        what, install = ", ".join(missing), "apt-get install firefox-esr pulseaudio pulseaudio-utils"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{what} missing; CI must install them ({install}; make firefox-client)")
        pytest.skip(f"{what} missing ({install}; make firefox-client)")


@pytest.fixture
def pulse(tmp_path):
    """A PulseAudio of the test's own with two null devices: `speakers` (Firefox plays there: without an audio
    output it never starts an AudioContext) and `mic`, whose monitor is the default source (Firefox hears it)."""
    runtime = tmp_path / "pulse"
    runtime.mkdir()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), HOME=str(runtime),
               PULSE_SERVER=f"unix:{runtime}/pulse/native")
    server = subprocess.Popen(["pulseaudio", "-n", "--daemonize=no", "--exit-idle-time=-1",
                               "-L", "module-null-sink sink_name=speakers", "-L", "module-null-sink sink_name=mic",
                               "-L", "module-native-protocol-unix"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and server.poll() is None, "pulseaudio did not start"
            time.sleep(0.2)
        subprocess.run(["pactl", "set-default-sink", "speakers"], env=env, check=True)
        subprocess.run(["pactl", "set-default-source", "mic.monitor"], env=env, check=True)
        yield env
    finally:
        server.terminate()
        server.wait(10)


def test_in_firefox_the_page_hears_speaks_and_moves_its_mouth(firefox_installed, stack, speech, pulse, tmp_path):
    """Firefox (Debian's firefox-esr, over WebDriver BiDi): the words spoken into its microphone are transcribed,
    the reply plays from the worklet, not silent, and the mouth and the captions follow it."""
    wav = write_wav(tmp_path / "say.wav", speech(SAY, 16_000), 16_000)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["node", "page.mjs", f"http://{stack['http']}/", str(ARTIFACTS / "firefox.png"), str(wav),
                          "mic"], cwd=FIREFOX_CLIENT, env=pulse, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert not seen["errors"] and seen["connected"] and "Firefox" in seen["userAgent"], seen
    heard = set(re.findall(r"[a-z]+", " ".join(seen["transcripts"]).lower()))
    assert {"brave", "cat", "sea"} <= heard, seen["transcripts"]
    assert seen["playing"] and seen["maxLevel"] > 0.02, seen
    assert seen["visemes"], "no specvox.viseme events reached the page (Realtime extension events)"
    assert seen["distinctMouths"] >= 3 and len(set(seen["drawnVisemes"]) - {"sil"}) >= 3, seen
    assert seen["captionsShown"] >= 3, seen
    figures = [seen["waterfall"][k] for k in ("ASR final", "first token", "first audio", "first played")]
    assert figures == sorted(figures) and figures[0] > 0, seen["waterfall"]


# ---- caption mode ----------------------------------------------------------------------------------------

def test_in_caption_mode_the_page_shows_the_speakers_captions_and_downloads_them(chromium_installed, stack, speech,
                                                                                 tmp_path):
    """A caption session (made by a backend with CreateSession, named in the page's address): no reply, the
    speaker's words live, then timed lines, and WebVTT and SRT files with those lines."""
    from services.channels import open_channel
    from services.gateway.convert import Config
    from services.protos import load

    pb, pb_grpc = load("gateway")

    async def caption_session() -> str:
        async with open_channel(stack["gateway"]) as channel:
            made = await pb_grpc.GatewayStub(channel).CreateSession(
                pb.CreateSessionRequest(config=Config(mode=Config.CAPTION)))
            return made.session_id

    session_id = asyncio.run(caption_session())
    wav = write_wav(tmp_path / "say.wav", speech(SAY, 16_000), 16_000)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    driver = chromium(wav, str(tmp_path / "profile"), downloads)
    try:
        p = Page(driver, ARTIFACTS)
        p.open(f"http://{stack['http']}/?session_id={session_id}")
        p.wait("the caption lines", lambda s: s["events"].get("specvox.caption", 0) > 0 and p.js(
            "return window.specvox.captionCues.length") > 0, timeout_s=120)
        time.sleep(1.0)  # the utterance's other lines, if any
        cues = p.js("return window.specvox.captionCues")
        shown = p.js("return document.getElementById('caption-lines').textContent")
        assert p.js("return document.getElementById('mode').value") == "caption"
        assert not p.by_id("caption-mode").get_attribute("hidden")
        p.by_id("vtt").click()
        p.by_id("srt").click()
        deadline = time.monotonic() + 20
        while not ((downloads / "captions.vtt").exists() and (downloads / "captions.srt").exists()):
            assert time.monotonic() < deadline, list(downloads.iterdir())
            time.sleep(0.2)
        p.screenshot("page-captions")
        state = p.state()
    finally:
        driver.quit()
    words = set(re.findall(r"[a-z]+", " ".join(c["text"] for c in cues).lower()))
    assert {"brave", "cat", "sea"} <= words, cues
    assert all(" ".join(c["text"].split()) in " ".join(shown.split()) for c in cues), (cues, shown)
    assert all(0 <= c["start_ms"] < c["end_ms"] for c in cues), cues
    assert not state["turns"] and not state["events"].get("response.output_audio.delta"), "a caption session replied"
    vtt, srt = (downloads / "captions.vtt").read_text(), (downloads / "captions.srt").read_text()
    assert vtt.startswith("WEBVTT") and srt.startswith("1\n")
    for cue in cues:
        assert cue["text"] in vtt and cue["text"] in srt
    first = cues[0]["start_ms"]
    stamp = f"{first // 3_600_000:02}:{first // 60_000 % 60:02}:{first // 1000 % 60:02}"
    assert f"{stamp}.{first % 1000:03} --> " in vtt and f"{stamp},{first % 1000:03} --> " in srt
