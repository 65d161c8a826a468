// The page's audio: one AudioContext at the device's own rate (Firefox will not connect a microphone to a
// context of another rate), the capture worklet on the microphone and the playback worklet on the speakers.
// Both worklets convert to and from 24 kHz, the Realtime API's `audio/pcm`.
export const RATE_HZ = 24000;
const SYNC_AUDIO_QUERIES_STALL = /\bFirefox\//.test(navigator.userAgent);

export class AudioEngine {
  constructor({ onCapture, onFirstPlayed, onPosition }) {
    this.onCapture = onCapture; // (Int16Array pcm, rms, pageMs)
    this.onFirstPlayed = onFirstPlayed; // (item, pageMs)
    this.onPosition = onPosition; // (report)
    this.ctx = null;
    this.stream = null;
    this.source = null;
    this.capture = null;
    this.latency = 0;
    this.latencyReadAt = -Infinity;
    this.report = { item: null, played: 0, total: 0, time: 0, audioTime: 0, paused: false, buffered: 0, level: 0, peak: 0 };
  }

  /** The context and the speakers; within a user gesture (autoplay rules). */
  async open() {
    if (this.ctx) return this.ctx.resume();
    this.ctx = new AudioContext({ latencyHint: "interactive" });
    const base = new URL(".", import.meta.url);
    await this.ctx.audioWorklet.addModule(new URL("capture-worklet.js", base));
    await this.ctx.audioWorklet.addModule(new URL("playback-worklet.js", base));
    this.playback = new AudioWorkletNode(this.ctx, "playback", { numberOfInputs: 0, outputChannelCount: [1] });
    this.playback.port.onmessage = (e) => this.fromPlayback(e.data);
    this.playback.connect(this.ctx.destination);
    await this.ctx.resume();
  }

  /** The microphone: echo cancellation (with noise suppression and gain control) on unless `processing` is false. */
  async startMic(processing) {
    if (!navigator.mediaDevices?.getUserMedia) {
      throw new Error("this browser gives no microphone to this page (not a secure context: open it over " +
        "https://, or on localhost)");
    }
    this.stopMic();
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: processing, noiseSuppression: processing, autoGainControl: processing },
    });
    this.source = this.ctx.createMediaStreamSource(this.stream);
    this.capture = new AudioWorkletNode(this.ctx, "capture", { numberOfOutputs: 0 });
    this.capture.port.onmessage = (e) => this.onCapture(e.data.pcm, e.data.rms, performance.now());
    this.source.connect(this.capture);
  }

  stopMic() {
    if (this.capture) { this.source.disconnect(); this.capture.port.onmessage = null; }
    if (this.stream) for (const track of this.stream.getTracks()) track.stop();
    this.stream = this.source = this.capture = null;
  }

  get micOn() { return Boolean(this.stream); }

  play(item, pcm) { this.playback.port.postMessage({ type: "audio", item, pcm }, [pcm.buffer]); }
  pause() { this.playback?.port.postMessage({ type: "pause" }); }
  resume() { this.playback?.port.postMessage({ type: "resume" }); }
  flush(item) { this.playback?.port.postMessage({ type: "flush", item }); }

  fromPlayback(m) {
    if (m.type === "first") this.onFirstPlayed(m.item, this.pageMs(m.time));
    else { this.report = m; this.onPosition(m); }
  }

  /** Samples of `item` heard by now: those the worklet had rendered by the moment now heard at the speakers
   * (the context's clock less the output latency), carried forward from its last report while it plays. */
  heardSamples(item) {
    const r = this.report;
    if (!this.ctx || r.item !== item) return 0;
    const heardTime = this.ctx.currentTime - this.outputLatency();
    let n = r.played;
    if (heardTime < r.audioTime) n -= (r.audioTime - heardTime) * RATE_HZ;
    else if (!r.paused && r.buffered > 0) n += Math.min(r.buffered, (heardTime - r.audioTime) * RATE_HZ);
    return Math.max(0, Math.min(n, r.played + r.buffered));
  }

  /** The output latency in seconds: how far what the speakers play now lags what has been rendered, from
   * getOutputTimestamp(), twice a second. Firefox (153) answers both that and the outputLatency getter by waiting
   * on its audio thread, and now and then the page stalled for good: there the latency is taken as 0. */
  outputLatency() {
    const now = performance.now();
    if (SYNC_AUDIO_QUERIES_STALL) return 0;
    if (!(now < this.latencyReadAt + 500)) {
      const ts = this.ctx.getOutputTimestamp();
      const heardNow = ts.contextTime + (now - ts.performanceTime) / 1000;
      this.latency = Math.max(0, Math.min(0.5, this.ctx.currentTime - heardNow));
      this.latencyReadAt = now;
    }
    return this.latency;
  }

  /** The page clock (performance.now()) of the moment a time on the audio context's clock is heard. In Firefox
   * (see outputLatency) the moment the page hears of it: called as the worklet's message arrives. */
  pageMs(contextTime) {
    if (SYNC_AUDIO_QUERIES_STALL) return performance.now();
    const ts = this.ctx.getOutputTimestamp();
    return ts.performanceTime + (contextTime - ts.contextTime) * 1000;
  }
}
