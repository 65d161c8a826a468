// The OpenAI Realtime API (GA) over the browser's WebSocket, as OpenAI's own browser clients connect: the
// subprotocol `realtime`, and the API key, where the gateway asks for one, as `openai-insecure-api-key.<key>`
// (a browser cannot set an Authorization header on a WebSocket).
export class RealtimeSocket {
  constructor(url, key, onEvent, onClose) {
    const protocols = ["realtime"];
    if (key) protocols.push(`openai-insecure-api-key.${key}`);
    this.ws = new WebSocket(url, protocols);
    this.opened = new Promise((resolve, reject) => {
      this.ws.onopen = resolve;
      this.ws.onerror = () => reject(new Error(`cannot open ${url} (is the key right? see the gateway's log)`));
    });
    this.ws.onmessage = (e) => onEvent(JSON.parse(e.data));
    this.ws.onclose = (e) => onClose(e);
    this.sent = 0;
  }

  send(type, fields = {}) {
    if (this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify({ type, event_id: `evt_page_${++this.sent}`, ...fields }));
    return true;
  }

  /** 16-bit PCM as `input_audio_buffer.append` (base64 of the little-endian bytes). */
  append(pcm) {
    const bytes = new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
    let binary = "";
    for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return this.send("input_audio_buffer.append", { audio: btoa(binary) });
  }

  close() { this.ws.close(1000); }
}

/** Base64 audio of `response.output_audio.delta` → 16-bit samples. */
export function pcmOf(base64) {
  const binary = atob(base64);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

/** The Realtime address on the server that served this page: wss:// when the page came over https://. */
export function realtimeUrl(location) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/realtime`;
}
