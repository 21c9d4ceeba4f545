// voicewire player: an AudioWorkletProcessor that plays mono float32 chunks gap-free, with a small
// jitter buffer, resampling (linear) from each chunk's rate to the AudioContext's rate.
//
// Contract (messages on the node's port):
//   in  {type: "push", samples: Float32Array, rate}  queue audio (transfer the buffer)
//   in  {type: "flush"}                              no more audio for now: play out what is queued
//                                                    even below the jitter threshold, no underrun at the end
//   in  {type: "cancel", id}                         drop every queued sample at once; answered by
//                                                    {type: "cancelled", id, at, ...counters}, `at` the
//                                                    stream index where playback stopped
//   in  {type: "jitter", ms}                         change the jitter buffer
//   out {type: "position", played, dropped, received, underruns, buffered, playing}
//        every few render quanta while playing, and on each start / stop.
// Counters are in source samples (the rate audio was pushed at): `received` = pushed, `played` = sent to
// the speakers, `dropped` = discarded by cancel. `played + dropped` is the stream index of the next sample;
// when idle, `received == played + dropped`.

const REPORT_EVERY_QUANTA = 4;

class VoicewirePlayerProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = (options && options.processorOptions) || {};
    this.jitterMs = typeof opts.jitterMs === "number" ? opts.jitterMs : 60;
    this.chunks = []; // [{samples: Float32Array, rate}]
    this.pos = 0; // fractional read position in chunks[0]
    this.before = 0; // samples played before chunks[0]
    this.received = 0;
    this.played = 0;
    this.dropped = 0;
    this.underruns = 0;
    this.playing = false;
    this.flushed = false;
    this.quanta = 0;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    switch (msg.type) {
      case "push":
        if (msg.samples.length) {
          this.chunks.push({ samples: msg.samples, rate: msg.rate });
          this.received += msg.samples.length;
          this.flushed = false;
        }
        break;
      case "flush":
        this.flushed = true;
        break;
      case "cancel": {
        const at = this.played + this.dropped;
        this.dropped += this.received - at;
        this.before = this.played;
        this.chunks = [];
        this.pos = 0;
        this.playing = false;
        this.flushed = false;
        this.port.postMessage({ type: "cancelled", id: msg.id, at, ...this.counters() });
        break;
      }
      case "jitter":
        this.jitterMs = msg.ms;
        break;
    }
  }

  bufferedMs() {
    let ms = 0;
    for (let i = 0; i < this.chunks.length; i++) {
      const c = this.chunks[i];
      ms += ((c.samples.length - (i === 0 ? this.pos : 0)) * 1000) / c.rate;
    }
    return ms;
  }

  counters() {
    return {
      played: this.played,
      dropped: this.dropped,
      received: this.received,
      underruns: this.underruns,
      buffered: this.received - this.played - this.dropped,
      playing: this.playing,
    };
  }

  report() {
    this.port.postMessage({ type: "position", ...this.counters() });
  }

  process(_inputs, outputs) {
    const out = outputs[0];
    const left = out[0];
    const frames = left.length;
    if (!this.playing && this.chunks.length && (this.flushed || this.bufferedMs() >= this.jitterMs)) {
      this.playing = true;
      this.report();
    }
    let i = 0;
    if (this.playing) {
      while (i < frames) {
        const head = this.chunks[0];
        if (!head) {
          this.playing = false;
          if (!this.flushed) this.underruns += 1;
          this.report();
          break;
        }
        const step = head.rate / sampleRate;
        const data = head.samples;
        const n = data.length;
        while (i < frames && this.pos < n) {
          const k = Math.floor(this.pos);
          const frac = this.pos - k;
          const s0 = data[k];
          let s1 = s0;
          if (k + 1 < n) s1 = data[k + 1];
          else if (this.chunks.length > 1) s1 = this.chunks[1].samples[0];
          left[i++] = s0 + (s1 - s0) * frac;
          this.pos += step;
        }
        if (this.pos >= n) {
          this.before += n;
          this.chunks.shift();
          this.pos = this.chunks.length ? this.pos - n : 0;
          this.played = this.before;
        } else {
          this.played = this.before + Math.floor(this.pos);
        }
      }
    }
    for (; i < frames; i++) left[i] = 0;
    for (let ch = 1; ch < out.length; ch++) out[ch].set(left);
    if (this.playing && ++this.quanta % REPORT_EVERY_QUANTA === 0) this.report();
    return true;
  }
}

registerProcessor("voicewire-player", VoicewirePlayerProcessor);
