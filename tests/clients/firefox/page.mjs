// The browser page in Firefox: Debian's firefox-esr, headless, driven over WebDriver BiDi by puppeteer-core
// (no geckodriver). Firefox hears PulseAudio's default source and plays to its default sink; the test makes
// both null devices and plays a WAV of speech into the source (`paplay`) once the page is listening. The page
// must hear the words, play the reply from its playback worklet, and move the mouth and the captions with it.
// Usage: node page.mjs URL SCREENSHOT.png SPEECH.wav MIC_SINK; prints one JSON object (tests/e2e/test_page.py).
import { execFile } from "node:child_process";
import puppeteer from "puppeteer-core";

const [url, screenshot, wav, micSink] = process.argv.slice(2);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const browser = await puppeteer.launch({
  browser: "firefox", executablePath: process.env.FIREFOX || "/usr/bin/firefox-esr", headless: true, protocolTimeout: 30000,
  dumpio: Boolean(process.env.DUMPIO),
  extraPrefsFirefox: { "media.navigator.permission.disabled": true, "media.autoplay.default": 0 },
});
const out = { errors: [] };
try {
  const page = await browser.newPage();
  page.on("pageerror", (e) => out.errors.push(`pageerror: ${e.message}`));
  await page.setViewport({ width: 1280, height: 900 });
  await page.goto(url);
  await page.click("#processing"); // off: no echo cancellation, noise suppression or gain control on a file
  await page.click("#start");
  const state = () => page.evaluate(() => {
    const s = window.specvox;
    const t = s.turns[s.turns.length - 1];
    return { connected: s.connected, inputSamples: s.input.samples, maxLevel: s.playback.maxLevel, errors: s.errors,
      transcripts: Object.values(s.utterances).map((u) => u.transcript).filter(Boolean),
      heard: t?.itemId ? s.heard(t.itemId) : 0, audioSamples: t?.audioSamples ?? 0, visemes: t?.visemes.length ?? 0,
      words: t?.words.length ?? 0, captionsShown: s.captionsShown.length, secure: window.isSecureContext,
      waterfall: t?.waterfall ?? null,
      drawnVisemes: [...new Set(s.drawn.filter((d) => d.source === "viseme").map((d) => d.viseme))],
      mouth: document.querySelector("#face .lips").getAttribute("d"), userAgent: navigator.userAgent };
  });
  const until = async (test, ms) => {
    for (const end = Date.now() + ms; Date.now() < end; await sleep(100)) if (test(await state())) return true;
    return false;
  };
  out.connected = await until((s) => s.connected && s.inputSamples > 12000, 30000);
  await new Promise((resolve, reject) => execFile("paplay", [`--device=${micSink}`, wav],
    (error) => (error ? reject(error) : resolve())));
  out.playing = await until((s) => s.heard > 12000, 120000);
  const mouths = new Set();
  for (let i = 0; i < 20; i++, await sleep(100)) mouths.add((await state()).mouth);
  out.distinctMouths = mouths.size;
  await page.screenshot({ path: screenshot });
  const last = await state();
  Object.assign(out, last, { errors: [...out.errors, ...last.errors] });
} catch (e) {
  out.errors.push(String(e));
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
