// The microphone in an AudioWorklet: input frames at the context's rate → 16-bit PCM at 24 kHz (the Realtime
// API's `audio/pcm`), posted in 40 ms chunks with their level. Linear interpolation after a one-pole low-pass:
// enough for speech (the asr hears 16 kHz), and the same in every browser.
const OUT_HZ = 24000;
const CHUNK = OUT_HZ / 25; // 40 ms, as `specvox bench e2e` sends

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / OUT_HZ; // input frames per output sample
    this.pos = 0; // where the next output sample lies, in input frames from the start of `prev`
    this.prev = 0; // the last (filtered) input sample of the previous block
    this.lp = 0;
    this.alpha = Math.min(1, (2 * Math.PI * 10000) / sampleRate); // ~10 kHz cut-off below 12 kHz Nyquist
    this.out = new Int16Array(CHUNK);
    this.n = 0;
    this.sumSq = 0;
    this.sent = 0; // samples posted since the start (24 kHz)
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    // filtered block with the previous block's last sample in front, so interpolation spans blocks
    const x = new Float32Array(channel.length + 1);
    x[0] = this.prev;
    for (let i = 0; i < channel.length; i++) {
      this.lp += this.alpha * (channel[i] - this.lp);
      x[i + 1] = this.lp;
    }
    this.prev = x[channel.length];
    while (this.pos <= channel.length) {
      const i = Math.floor(this.pos);
      const f = this.pos - i;
      const v = f && i + 1 < x.length ? x[i] + f * (x[i + 1] - x[i]) : x[i];
      this.sumSq += v * v;
      this.out[this.n++] = Math.max(-32768, Math.min(32767, Math.round(v * 32767)));
      if (this.n === CHUNK) this.flush();
      this.pos += this.step;
    }
    this.pos -= channel.length;
    return true;
  }

  flush() {
    this.sent += this.n;
    const pcm = this.out.slice(0, this.n);
    this.port.postMessage({ pcm, rms: Math.sqrt(this.sumSq / this.n), sent: this.sent, time: currentTime },
      [pcm.buffer]);
    this.n = 0;
    this.sumSq = 0;
  }
}

registerProcessor("capture", CaptureProcessor);
