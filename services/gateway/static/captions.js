// Caption documents from timed cues ({start_ms, end_ms, text}): WebVTT and SubRip, for the download in
// caption mode. The same formats pipeline/captions.py writes on the server.
function stamp(ms, separator) {
  const t = Math.max(0, Math.round(ms));
  const h = Math.floor(t / 3600000), m = Math.floor(t / 60000) % 60, s = Math.floor(t / 1000) % 60, r = t % 1000;
  const two = (n) => String(n).padStart(2, "0");
  return `${two(h)}:${two(m)}:${two(s)}${separator}${String(r).padStart(3, "0")}`;
}

export function webvtt(cues) {
  const blocks = cues.map((c) => `${stamp(c.start_ms, ".")} --> ${stamp(c.end_ms, ".")}\n${c.text}`);
  return `WEBVTT\n\n${blocks.join("\n\n")}\n`;
}

export function srt(cues) {
  return cues.map((c, i) => `${i + 1}\n${stamp(c.start_ms, ",")} --> ${stamp(c.end_ms, ",")}\n${c.text}\n`).join("\n");
}

export function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = Object.assign(document.createElement("a"), { href: url, download: name });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}
