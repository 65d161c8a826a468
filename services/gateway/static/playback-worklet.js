// Reply audio in an AudioWorklet: 24 kHz PCM chunks queued per item (one reply), resampled to the context's
// rate as they are rendered, and the samples actually played counted per item. That count is the playback
// position the page reports (conversation.item.truncate's audio_end_ms), and the clock the face and the
// captions follow: they show what is being heard, not what has arrived.
const IN_HZ = 24000;
const REPORT_EVERY_S = 0.02;

class PlaybackProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = IN_HZ / sampleRate; // source samples per output frame
    this.queue = []; // {item, data: Float32Array}
    this.read = 0; // fractional index into queue[0].data
    this.item = null; // the item now playing (or last played)
    this.itemBase = 0; // source samples of `item` in segments already finished
    this.paused = false;
    this.total = 0; // output frames rendered with reply audio in them, since the start
    this.audioTime = 0; // the context time at the end of the last frame rendered with reply audio
    this.sumSq = 0;
    this.frames = 0;
    this.peak = 0;
    this.lastReport = 0;
    this.port.onmessage = (e) => this.command(e.data);
  }

  command(m) {
    if (m.type === "audio") {
      const data = new Float32Array(m.pcm.length);
      for (let i = 0; i < data.length; i++) data[i] = m.pcm[i] / 32768;
      this.queue.push({ item: m.item, data });
    } else if (m.type === "pause") {
      this.paused = true;
    } else if (m.type === "resume") {
      this.paused = false;
    } else if (m.type === "flush") {
      this.queue = m.item ? this.queue.filter((s) => s.item !== m.item) : [];
      if (!this.queue.length || this.queue[0].item !== this.item) this.read = 0;
      this.paused = false;
    }
    this.report(true);
  }

  played() {
    return this.itemBase + Math.floor(this.read);
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    for (let i = 0; i < out.length; i++) {
      const head = this.queue[0];
      if (this.paused || !head) { out[i] = 0; continue; }
      if (head.item !== this.item) { // the first sample of a new reply
        this.item = head.item;
        this.itemBase = 0;
        this.port.postMessage({ type: "first", item: this.item, time: currentTime + i / sampleRate });
      }
      const s = head.data;
      const i0 = Math.floor(this.read);
      const f = this.read - i0;
      const v = f && i0 + 1 < s.length ? s[i0] + f * (s[i0 + 1] - s[i0]) : s[i0];
      out[i] = v;
      this.sumSq += v * v;
      this.peak = Math.max(this.peak, Math.abs(v));
      this.frames++;
      this.total++;
      this.audioTime = currentTime + (i + 1) / sampleRate;
      this.read += this.step;
      while (this.queue.length && this.read >= this.queue[0].data.length) {
        this.read -= this.queue[0].data.length;
        if (this.queue[0].item === this.item) this.itemBase += this.queue[0].data.length;
        this.queue.shift();
        if (this.queue.length && this.queue[0].item !== this.item) this.read = 0;
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.report(false);
    return true;
  }

  report(now) {
    const time = currentTime + 128 / sampleRate; // the end of the block just rendered
    if (!now && time - this.lastReport < REPORT_EVERY_S) return;
    this.lastReport = time;
    let buffered = -this.read;
    for (const s of this.queue) buffered += s.data.length;
    this.port.postMessage({
      type: "pos", item: this.item, played: this.played(), total: this.total, time, audioTime: this.audioTime,
      paused: this.paused,
      buffered: Math.max(0, Math.round(buffered)), level: this.frames ? Math.sqrt(this.sumSq / this.frames) : 0,
      peak: this.peak,
    });
    this.sumSq = 0;
    this.frames = 0;
    this.peak = 0;
  }
}

registerProcessor("playback", PlaybackProcessor);
