// The page: a face to talk to. It speaks the OpenAI Realtime API (GA) to the gateway's /v1/realtime with
// specvox's extension events on (word cues, visemes, pauses and resumes, turn reports), the same bridge any
// Realtime client uses. What it shows and measures is also kept in `window.specvox` (page clock:
// performance.now() ms; reply timeline: ms of the reply's audio), for the console and for tests.
import { AudioEngine, RATE_HZ } from "./audio.js";
import * as captionDocs from "./captions.js";
import { Face } from "./face.js";
import { pcmOf, RealtimeSocket, realtimeUrl } from "./realtime.js";

const $ = (id) => document.getElementById(id);
const MAX_KEPT = 4000; // measurements kept (lags, drawn shapes, capture chunks)

const state = {
  connected: false,
  session: null,
  events: {}, // server event type → how many
  errors: [],
  input: { samples: 0, chunks: [], micStarts: [] }, // chunks: [input samples sent by then, page ms]
  utterances: {}, // item id → the user's utterance
  turns: [], // one per response
  playback: { total: 0, level: 0, maxLevel: 0, paused: false, item: null },
  visemeLagsMs: [], // played position when a viseme was drawn − the viseme's start
  drawn: [], // {pageMs, item, viseme, weight, atMs, source}
  captionsShown: [], // {item, text, startMs, heardMs, pageMs}
  captionCues: [], // caption mode: the speaker's lines, input timeline
};
window.specvox = state;

let socket = null;
let lastUserItem = null;
const face = new Face($("face"));
const audio = new AudioEngine({ onCapture, onFirstPlayed, onPosition });
state.heard = (item) => audio.heardSamples(item); // samples of a reply heard by now

// ---- the microphone → input_audio_buffer.append ----------------------------------------------------

function onCapture(pcm, rms, pageMs) {
  $("mic-level").value = rms;
  if (!socket || !state.connected) return;
  state.input.samples += pcm.length;
  keep(state.input.chunks, [state.input.samples, pageMs]);
  socket.append(pcm);
}

/** When the page had the input audio up to `ms` (input timeline): the end of speech as the page saw it. */
function pageMsOfInput(ms) {
  const sample = (ms * RATE_HZ) / 1000;
  const hit = state.input.chunks.find(([sent]) => sent >= sample);
  return hit ? hit[1] : performance.now();
}

// ---- reply audio ------------------------------------------------------------------------------------

function onFirstPlayed(item, pageMs) {
  const turn = turnOfItem(item);
  if (turn && !turn.t.firstPlayed) { turn.t.firstPlayed = pageMs; renderWaterfall(turn); }
}

function onPosition(report) {
  const p = state.playback;
  Object.assign(p, { total: report.total, level: report.level, paused: report.paused, item: report.item });
  if (report.item && report.level > p.maxLevel) p.maxLevel = report.level;
  $("played").value = report.total;
  $("play-level").value = report.level;
}

function heardMs(turn) {
  return (audio.heardSamples(turn.itemId) * 1000) / RATE_HZ;
}

function audible(turn) {
  return turn && turn.itemId && !turn.flushed && turn.audioSamples > 0 &&
    (!turn.status || audio.heardSamples(turn.itemId) < turn.audioSamples - 1);
}

/** Stop the reply at once and tell the server where it stopped (the history keeps what was heard). */
function cutOff(turn, why) {
  if (!turn || turn.flushed || !turn.itemId) return;
  const heard = Math.round(heardMs(turn));
  audio.flush(turn.itemId);
  Object.assign(turn, { flushed: true, interrupted: true, cutWhy: why, cutPageMs: performance.now() });
  if (turn.audioSamples > 0) {
    turn.truncatedAtMs = heard;
    socket?.send("conversation.item.truncate", { item_id: turn.itemId, content_index: 0, audio_end_ms: heard });
  }
  turn.el.classList.add("interrupted");
  turn.el.title = `interrupted after ${heard} ms of audio`;
}

// ---- the conversation's events --------------------------------------------------------------------

function newTurn(responseId) {
  const el = document.createElement("div");
  el.className = "reply";
  $("turns").appendChild(el);
  const turn = {
    responseId, itemId: null, userItemId: lastUserItem, status: null, text: "", steps: [], words: [], cues: [],
    visemes: [], audioSamples: 0, pauses: [], resumes: [], interrupted: false, flushed: false, report: null,
    speculative: null, t: {}, el,
  };
  state.turns.push(turn);
  return turn;
}

const turnOf = (responseId) => state.turns.find((t) => t.responseId === responseId);
const turnOfItem = (itemId) => state.turns.find((t) => t.itemId === itemId);
const latestTurn = () => state.turns[state.turns.length - 1];

function utterance(itemId) {
  return (state.utterances[itemId] ||= { itemId, partial: "", transcript: null });
}

const HANDLERS = {
  "session.created": (e) => {
    state.session = e.session;
    offer(e.session.specvox?.choices);
    if (e.session.specvox?.mode) $("mode").value = e.session.specvox.mode; // a named session's own
    applySettings();
  },
  "session.updated": (e) => {
    state.session = e.session;
    state.connected = true;
    $("apply").disabled = false;
    status("live", "listening");
  },
  error: (e) => showError(e.error?.message || "error", e.error),
  "input_audio_buffer.speech_started": (e) => {
    utterance(e.item_id).startMs = e.audio_start_ms;
    const turn = latestTurn();
    if (audible(turn) || (turn && !turn.status)) cutOff(turn, "speech_started");
  },
  "input_audio_buffer.speech_stopped": (e) => {
    const u = utterance(e.item_id);
    u.endMs = e.audio_end_ms;
    u.speechEndPageMs = pageMsOfInput(e.audio_end_ms);
  },
  "conversation.item.input_audio_transcription.delta": (e) => {
    const u = utterance(e.item_id);
    u.partial += e.delta;
    $("partial").textContent = u.partial;
  },
  "conversation.item.input_audio_transcription.completed": (e) => {
    const u = utterance(e.item_id);
    Object.assign(u, { transcript: e.transcript, finalPageMs: performance.now() });
    lastUserItem = e.item_id;
    $("partial").textContent = "";
    const el = document.createElement("div");
    el.className = "user";
    el.dataset.item = e.item_id;
    el.textContent = e.transcript;
    $("turns").appendChild(el);
  },
  "response.created": (e) => { if (!turnOf(e.response.id)) newTurn(e.response.id); },
  "response.output_item.added": (e) => { (turnOf(e.response_id) || newTurn(e.response_id)).itemId = e.item.id; },
  "response.output_audio_transcript.delta": (e) => {
    const turn = turnOf(e.response_id);
    if (!turn) return;
    turn.t.firstToken ||= performance.now();
    // one delta per verify step: the tokens that step accepted, shown as one group
    const span = document.createElement("span");
    span.className = "step";
    span.textContent = e.delta;
    turn.el.appendChild(span);
    turn.steps.push({ text: e.delta, tokens: null, el: span });
    turn.text += e.delta;
  },
  // right after its delta: how many tokens that verify step accepted (extension events on)
  "specvox.verify_step": (e) => {
    const step = turnOf(e.response_id)?.steps.at(-1);
    if (!step || step.tokens !== null) return;
    step.tokens = e.accepted_tokens;
    step.el.dataset.tokens = e.accepted_tokens;
    step.el.title = `${e.accepted_tokens} token${e.accepted_tokens === 1 ? "" : "s"} accepted in one verify step`;
  },
  "response.output_audio.delta": (e) => {
    const turn = turnOf(e.response_id);
    if (!turn || turn.flushed) return;
    turn.itemId ||= e.item_id;
    turn.t.firstAudio ||= performance.now();
    const pcm = pcmOf(e.delta);
    turn.audioSamples += pcm.length;
    audio.play(turn.itemId, new Int16Array(pcm));
    renderWaterfall(turn);
  },
  "response.done": (e) => {
    const turn = turnOf(e.response.id);
    if (!turn) return;
    turn.status = e.response.status;
    if (turn.status === "cancelled") cutOff(turn, e.response.status_details?.reason || "cancelled");
  },
  "specvox.word": (e) => { turnOf(e.response_id)?.words.push(e); },
  "specvox.cue": (e) => { turnOf(e.response_id)?.cues.push(e); },
  "specvox.viseme": (e) => {
    const turn = turnOf(e.response_id) || turnOfItem(e.item_id);
    if (!turn) return;
    turn.visemes.push(...(e.visemes || [e]).map(visemeOf));
    turn.visemes.sort((a, b) => a.start_ms - b.start_ms);
  },
  "specvox.playback.paused": (e) => {
    const turn = latestTurn();
    audio.pause();
    turn?.pauses.push({ pageMs: performance.now(), at_s: e.at_s });
  },
  "specvox.playback.resumed": (e) => {
    const turn = latestTurn();
    if (turn && !turn.flushed) audio.resume();
    turn?.resumes.push({ pageMs: performance.now(), reason: e.reason });
  },
  "specvox.turn.report": (e) => {
    const turn = turnOf(e.response_id);
    if (!turn) return;
    Object.assign(turn, { report: e.report, speculative: e.speculative || null });
    if (e.report.cut_off) { // what the history keeps: the words heard before the reply was cut
      turn.el.appendChild(text("div", `heard: ${e.report.heard_text || "(nothing)"}`, "heard"));
    }
    renderWaterfall(turn);
    renderSpeculation(turn);
  },
  // caption mode: the speaker's words as they come (provisional), then each utterance's clean, timed lines
  "specvox.caption": (e) => {
    if (e.provisional) {
      $("captions").textContent = e.text;
      return;
    }
    for (const line of e.lines || []) addCaptionLine(line);
  },
};

function visemeOf(v) {
  const ms = (k) => v[`${k}_ms`] ?? Math.round((v[`${k}_s`] ?? 0) * 1000);
  return { viseme: v.viseme ?? v.name ?? v.id, start_ms: ms("start"), end_ms: ms("end"), weight: v.weight ?? 1 };
}

function onEvent(e) {
  state.events[e.type] = (state.events[e.type] || 0) + 1;
  try {
    HANDLERS[e.type]?.(e);
  } catch (err) {
    showError(`the page failed on ${e.type}: ${err.message}`);
  }
}

// ---- what is drawn each frame: the mouth, the captions ---------------------------------------------

let lastFrame = 0;
let frameMs = 16.7; // the display's frame interval, as requestAnimationFrame sees it

function frame(now) {
  if (lastFrame) frameMs += (Math.min(50, now - lastFrame) - frameMs) * 0.1;
  lastFrame = now;
  const p = state.playback;
  const turn = p.item ? turnOfItem(p.item) : null;
  const speaking = Boolean(turn && !p.paused && audible(turn));
  let viseme = "sil", weight = 1, source = "rest", atMs = null, forMs = null, start = null;
  if (speaking) {
    atMs = heardMs(turn);
    // a frame is on screen for frameMs: show the shape of the sound at its middle, so the mouth is never more
    // than half a frame ahead of or behind the voice (rather than up to a whole frame behind)
    forMs = atMs + frameMs / 2;
    if (turn.visemes.length) {
      const v = visemeAt(turn.visemes, forMs);
      if (v) ({ viseme, weight, start_ms: start } = v);
      source = "viseme";
    } else { // a voice without visemes: the jaw follows the loudness
      viseme = "aa";
      weight = Math.min(1, p.level * 6);
      source = "level";
    }
    showCaptions(turn, atMs, now);
  }
  if (face.show(viseme, weight)) {
    keep(state.drawn, { pageMs: now, item: turn?.itemId ?? null, viseme, weight, atMs, forMs, source });
    // the lag of the mouth behind the voice: where playback is as the shape is drawn, less where the shape begins
    if (source === "viseme" && start !== null && viseme !== "sil") keep(state.visemeLagsMs, atMs - start);
  }
  face.tick(now, speaking);
  requestAnimationFrame(frame);
}

function visemeAt(visemes, ms) {
  let lo = 0, hi = visemes.length - 1, found = null;
  while (lo <= hi) { // the last viseme starting at or before ms
    const mid = (lo + hi) >> 1;
    if (visemes[mid].start_ms <= ms) { found = visemes[mid]; lo = mid + 1; } else hi = mid - 1;
  }
  return found && ms < found.end_ms ? found : null;
}

/** The reply's words as they are heard: the phrase under way, its heard words lit. */
function showCaptions(turn, atMs, now) {
  const shown = turn.captionsShown || 0; // a word shown stays shown, though the estimate of the position wavers
  const count = Math.max(shown, turn.words.filter((w) => w.start_ms <= atMs).length);
  if (count === shown) return;
  for (const w of turn.words.slice(shown, count)) {
    keep(state.captionsShown, { item: turn.itemId, text: w.text, startMs: w.start_ms, heardMs: atMs, pageMs: now });
  }
  turn.captionsShown = count;
  const heard = turn.words.slice(0, count);
  const last = heard[heard.length - 1];
  const cue = turn.cues.find((c) => c.start_ms <= last.start_ms && last.start_ms < c.end_ms);
  const from = cue ? turn.words.findIndex((w) => w.start_ms >= cue.start_ms) : Math.max(0, heard.length - 12);
  const box = $("captions");
  box.replaceChildren(...turn.words.slice(from, cue ? undefined : heard.length).filter(
    (w) => !cue || w.start_ms < cue.end_ms).map((w) => {
    const span = document.createElement("span");
    span.className = w.start_ms <= atMs ? "word heard" : "word";
    span.textContent = `${w.text} `;
    return span;
  }));
}

// ---- per turn: the waterfall and the speculative statistics ---------------------------------------

function renderWaterfall(turn) {
  const u = state.utterances[turn.userItemId];
  const rows = [];
  if (u?.speechEndPageMs) {
    const from = u.speechEndPageMs;
    const at = (t) => (t ? Math.round(t - from) : null);
    rows.push(["ASR final", at(u.finalPageMs), "page"], ["first token", at(turn.t.firstToken), "page"],
      ["first audio", at(turn.t.firstAudio), "page"], ["first played", at(turn.t.firstPlayed), "page"]);
  }
  const r = turn.report;
  if (r?.speech_end_unix_ms) {
    const end = Number(r.speech_end_unix_ms);
    const stage = (name, k) => {
      const s = (r.stages || []).find((x) => x.stage === name);
      return s && Number(s[k]) ? Math.round(Number(s[k]) - end) : null;
    };
    rows.push(["asr final (server)", stage("asr", "last_out_unix_ms"), "server"],
      ["llm first token", stage("llm", "first_out_unix_ms"), "server"],
      ["tts first audio", stage("tts", "first_out_unix_ms"), "server"],
      ["gateway first sent", r.first_audio_sent_unix_ms ? Number(r.first_audio_sent_unix_ms) - end : null, "server"]);
  }
  const known = rows.filter(([, ms]) => ms !== null);
  if (!known.length) return;
  const scale = Math.max(...known.map(([, ms]) => ms), 1);
  const box = $("waterfall");
  box.replaceChildren();
  const title = document.createElement("p");
  title.className = "muted";
  title.textContent = "from the end of speech (ms)" + (r?.budget_ms ? `; budget ${r.budget_ms} ms` : "");
  box.appendChild(title);
  for (const [label, ms, kind] of rows) {
    const row = document.createElement("div");
    row.className = `row ${kind}`;
    row.dataset.label = label;
    row.dataset.ms = ms ?? "";
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = `${ms === null ? 0 : Math.max(1, (100 * Math.max(0, ms)) / scale)}%`;
    row.append(text("span", label), bar, text("span", ms === null ? "…" : `${ms}`, "ms"));
    box.appendChild(row);
  }
  turn.waterfall = Object.fromEntries(rows.map(([label, ms]) => [label, ms]));
}

function renderSpeculation(turn) {
  const s = turn.speculative;
  const drafter = state.session?.specvox?.drafter || $("drafter").value || "the service's default";
  const rows = [["drafter", drafter]];
  if (s) {
    rows.push(["tokens per pass", s.mean_accepted_per_step], ["verify passes", s.verify_steps],
      ["tokens accepted", s.accepted_tokens]);
  }
  if (turn.report) rows.push(["finish", turn.report.finish_reason || "?"]);
  $("speculation").replaceChildren(...rows.flatMap(([k, v]) => [text("dt", k), text("dd", String(v))]));
}

function text(tag, content, className) {
  const node = document.createElement(tag);
  node.textContent = content;
  if (className) node.className = className;
  return node;
}

// ---- caption mode ---------------------------------------------------------------------------------

function addCaptionLine(cue) {
  state.captionCues.push(cue);
  const line = text("p", cue.text);
  line.dataset.start = cue.start_ms;
  $("caption-lines").appendChild(line);
  $("captions").textContent = cue.text;
  $("vtt").disabled = $("srt").disabled = false;
}

$("vtt").onclick = () => captionDocs.download("captions.vtt", captionDocs.webvtt(state.captionCues), "text/vtt");
$("srt").onclick = () => captionDocs.download("captions.srt", captionDocs.srt(state.captionCues), "application/x-subrip");

// ---- settings → session.update --------------------------------------------------------------------

function applySettings() {
  const specvox = { extension_events: true };
  if ($("drafter").value.trim()) specvox.drafter = $("drafter").value.trim();
  if ($("budget").value) specvox.budget_ms = Number($("budget").value);
  const session = { type: "realtime", specvox };
  const voice = $("voice").value.trim();
  if (voice) session.audio = { output: { voice } };
  if ($("prompt").value.trim()) session.instructions = $("prompt").value.trim();
  socket.send("session.update", { session });
  $("caption-mode").hidden = $("mode").value !== "caption";
}

/** The voices and drafters the gateway offers, as suggestions in the settings (where it says). */
function offer(choices) {
  for (const [list, names] of [["voices", choices?.voices], ["drafters", choices?.drafters]]) {
    if (Array.isArray(names)) $(list).replaceChildren(...names.map((name) => Object.assign(document.createElement("option"), { value: name })));
  }
}

$("settings-form").onsubmit = async (e) => {
  e.preventDefault();
  if (!socket) return;
  if ($("mode").value !== (state.session?.specvox?.mode || "dialogue")) { // a mode is a connection's, for good
    socket.close();
    await start();
  } else {
    applySettings();
  }
};

// ---- start, microphone, stop ----------------------------------------------------------------------

async function start() {
  $("start").disabled = true;
  hideError();
  try {
    await audio.open();
    status("connecting", "connecting…");
    const opened = new RealtimeSocket(realtimeUrl(window.location) + realtimeQuery(), $("key").value.trim(), onEvent,
      (e) => onClose(opened, e));
    socket = opened;
    await socket.opened;
    await startMic();
    $("mic").disabled = $("stop").disabled = $("typed").disabled = $("send").disabled = false;
  } catch (err) {
    showError(err.message);
    status("error", "not connected");
    socket?.close();
    socket = null;
    $("start").disabled = false;
  }
}

/** Which session: the one this page's address names (`/?session_id=…`, made by a backend with CreateSession),
 * else a new one, in caption mode where the settings say so (a session that captions and never replies). */
function realtimeQuery() {
  const query = new URLSearchParams();
  const named = new URLSearchParams(window.location.search).get("session_id");
  if (named) query.set("session_id", named);
  else if ($("mode").value === "caption") query.set("mode", "caption");
  const text = query.toString();
  return text ? `?${text}` : "";
}

async function startMic() {
  await audio.startMic($("processing").checked);
  keep(state.input.micStarts, { inputSamples: state.input.samples, pageMs: performance.now() });
  $("mic").textContent = "Microphone off";
}

async function toggleMic() {
  if (audio.micOn) {
    audio.stopMic();
    $("mic").textContent = "Microphone on";
  } else {
    await startMic().catch((err) => showError(err.message));
  }
}

function onClose(closed, e) {
  if (closed !== socket) return; // one replaced (a change of mode): the new one carries on
  state.connected = false;
  audio.stopMic();
  audio.flush();
  socket = null;
  $("start").disabled = false;
  $("mic").disabled = $("stop").disabled = $("apply").disabled = $("typed").disabled = $("send").disabled = true;
  status(e.code === 1000 ? "idle" : "error", e.code === 1000 ? "not connected" : `disconnected (${e.code} ${e.reason})`);
}

function status(kind, words) {
  $("status").dataset.state = kind;
  $("status").textContent = words;
}

function showError(message, detail) {
  state.errors.push(detail || { message });
  $("error").textContent = message;
  $("error").hidden = false;
}

function hideError() { $("error").hidden = true; }

function keep(list, item) {
  list.push(item);
  if (list.length > MAX_KEPT) list.splice(0, list.length - MAX_KEPT);
}

// typed words: a user message item and a response for it, as any Realtime client sends them
$("type-form").onsubmit = (e) => {
  e.preventDefault();
  const words = $("typed").value.trim();
  if (!words || !socket) return;
  const turn = latestTurn();
  if (turn && !turn.status) socket.send("response.cancel"); // the new words take the turn
  if (audible(turn)) cutOff(turn, "typed");
  socket.send("conversation.item.create", { item: { type: "message", role: "user", content: [{ type: "input_text", text: words }] } });
  socket.send("response.create");
  const el = text("div", words, "user");
  $("turns").appendChild(el);
  lastUserItem = null;
  $("typed").value = "";
};

$("start").onclick = start;
$("mic").onclick = toggleMic;
$("stop").onclick = () => socket?.close();
$("insecure").hidden = window.isSecureContext;
requestAnimationFrame(frame);
