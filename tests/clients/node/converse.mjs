// A Node.js client of the specvox gateway, built the way any Node user would: @grpc/proto-loader
// loads protos/ as shipped (includeDirs only, no mapping of import paths) and @grpc/grpc-js calls
// the Gateway service. tests/e2e/test_node_client.py runs it against the real stack and checks the
// JSON it prints on stdout.
//
//   node converse.mjs converse --address HOST:PORT --protos DIR --pcm FILE [--rate HZ] [--speed X]
//     CreateSession, then Converse: StreamStart, the file's 16-bit mono PCM in 100 ms chunks
//     (paced in real time, or X times faster), a second of silence, half-close; prints what came
//     back: transcripts, reply text, reply audio bytes, turn reports, the final status.
//   node converse.mjs malformed --address HOST:PORT --protos DIR
//     Converse streams the gateway must refuse (each one's status code and message), then a
//     well-formed CreateSession and Converse on the same channel, to show it still serves.
//   node converse.mjs services --protos DIR
//     Loads every specvox/*/v1/*.proto under DIR; prints each service's methods.

import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { parseArgs } from "node:util";

import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const { values: args, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    address: { type: "string" },
    protos: { type: "string" },
    pcm: { type: "string" },
    rate: { type: "string", default: "16000" },
    speed: { type: "string", default: "1" },
  },
});

const CHUNK_MS = 100;
const TRAILING_SILENCE_MS = 1000;
const CALL_TIMEOUT_MS = 180_000;

const LOAD_OPTIONS = {
  includeDirs: [args.protos],
  keepCase: true, // fields as the .proto spells them: session_id, text_delta
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true, // each decoded ServerEvent names its oneof member in `event`
};
const definition = protoLoader.loadSync("specvox/gateway/v1/gateway.proto", LOAD_OPTIONS);
const { Gateway } = grpc.loadPackageDefinition(definition).specvox.gateway.v1;
const client = args.address ? new Gateway(args.address, grpc.credentials.createInsecure()) : null;

const deadline = () => ({ deadline: Date.now() + CALL_TIMEOUT_MS });

function createSession(request = {}) {
  return new Promise((resolve, reject) =>
    client.CreateSession(request, deadline(), (error, session) => (error ? reject(error) : resolve(session))));
}

function pcmStart(sessionId, rate, width = 2) {
  return {
    start: {
      session_id: sessionId,
      format: { encoding: "PCM_S16LE", sample_rate_hz: rate, channels: 1, sample_width_bytes: width },
    },
  };
}

// One Converse call: `send(call, ready)` writes the client's messages (ready resolves at the
// gateway's StreamReady); resolves with every event received and the call's final status.
function converse(send) {
  return new Promise((resolve) => {
    const call = client.Converse(deadline());
    const events = [];
    let status = null;
    let ended = false;
    let readySeen;
    const ready = new Promise((r) => (readySeen = r));
    const finish = () => ended && status && resolve({ events, status });
    call.on("data", (event) => {
      events.push(event);
      if (event.event === "ready") readySeen();
    });
    call.on("error", () => {}); // a non-OK status; `status` below carries it
    call.on("status", (s) => {
      status = { code: s.code, code_name: grpc.status[s.code], details: s.details };
      ended = true; // no `end` follows an error
      finish();
    });
    call.on("end", () => {
      ended = true;
      finish();
    });
    send(call, ready).catch((error) => {
      process.stderr.write(`sending failed: ${error}\n`);
      call.cancel();
    });
  });
}

function summary({ events, status }) {
  const of = (kind) => events.filter((e) => e.event === kind).map((e) => e[kind]);
  const finals = of("transcript").filter((t) => t.is_final);
  const audio = of("audio");
  return {
    ready: of("ready").length > 0,
    partial_transcripts: of("transcript").length - finals.length,
    final_transcripts: finals.map((t) => t.text),
    reply_text: of("reply_text").map((r) => r.text_delta).join(""),
    audio_bytes: audio.reduce((n, a) => n + a.pcm_s16le.length, 0),
    audio_sample_rates_hz: [...new Set(audio.map((a) => a.sample_rate_hz))],
    reports: of("report").map((r) => ({
      finish_reason: r.finish_reason,
      transcript: r.transcript,
      reply_text: r.reply_text,
      heard_text: r.heard_text,
      first_audio_sent_unix_ms: r.first_audio_sent_unix_ms,
      speech_end_unix_ms: r.speech_end_unix_ms,
    })),
    event_kinds: [...new Set(events.map((e) => e.event))],
    status,
  };
}

async function converseFile() {
  const rate = Number(args.rate);
  const speed = Number(args.speed);
  const pcm = readFileSync(args.pcm);
  const session = await createSession();
  const chunkBytes = ((rate * CHUNK_MS) / 1000) * 2;
  const audio = Buffer.concat([pcm, Buffer.alloc(((rate * TRAILING_SILENCE_MS) / 1000) * 2)]);
  const result = await converse(async (call, ready) => {
    call.write(pcmStart(session.session_id, rate));
    await ready;
    const started = performance.now();
    for (let i = 0, at = 0; at < audio.length; i++, at += chunkBytes) {
      const wait = started + (i * CHUNK_MS) / speed - performance.now();
      if (wait > 0) await sleep(wait);
      call.write({ audio: audio.subarray(at, at + chunkBytes) });
    }
    call.end(); // the microphone closes: the gateway finishes the turn and ends the stream
  });
  return { session_id: session.session_id, ...summary(result) };
}

async function malformed() {
  const session = await createSession();
  const silence = { audio: Buffer.alloc(3200) };
  const cases = {
    audio_first: [silence],
    unknown_session: [pcmStart("no-such-session", 16000), silence],
    sample_width_1: [pcmStart(session.session_id, 16000, 1), silence],
    oversize_audio: [pcmStart(session.session_id, 16000), { audio: Buffer.alloc(50 * 1024 * 1024) }],
  };
  const refused = {};
  for (const [name, messages] of Object.entries(cases)) {
    const { status } = await converse(async (call) => {
      for (const message of messages) call.write(message);
      call.end();
    });
    refused[name] = status;
  }
  // Then the gateway serves a well-formed call: a new session, and silence (nothing to answer).
  const after = await createSession();
  const served = await converse(async (call, ready) => {
    call.write(pcmStart(after.session_id, 16000));
    await ready;
    call.write(silence);
    call.end();
  });
  return { refused, after: { session_id: after.session_id, ...summary(served) } };
}

async function services() {
  const files = readdirSync(join(args.protos, "specvox"))
    .flatMap((name) => readdirSync(join(args.protos, "specvox", name, "v1")).map((f) => `specvox/${name}/v1/${f}`))
    .filter((path) => path.endsWith(".proto"))
    .sort();
  const methods = {};
  for (const [name, value] of Object.entries(protoLoader.loadSync(files, LOAD_OPTIONS))) {
    if (!value.format) methods[name] = Object.keys(value).sort(); // a service: its methods by their proto names
  }
  return { files, services: methods };
}

const modes = { converse: converseFile, malformed, services };
const mode = positionals[0];
if (!modes[mode] || !args.protos || (mode !== "services" && !args.address) || (mode === "converse" && !args.pcm)) {
  process.stderr.write("usage: node converse.mjs converse|malformed|services --protos DIR [--address HOST:PORT] [--pcm FILE]\n");
  process.exit(2);
}
try {
  process.stdout.write(JSON.stringify(await modes[mode]()) + "\n");
} finally {
  client?.close();
}
