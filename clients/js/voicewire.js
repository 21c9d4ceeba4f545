// voicewire browser client: an ES module with no dependencies and no build step.
//
//   import { VoicewireClient, PcmPlayer, Speaker } from "/clients/voicewire.js";
//   const client = new VoicewireClient({ token });          // URL defaults to this page's server
//   await client.connect();
//   await client.configure({ voice: "heart", word_timestamps: true });
//   const player = await PcmPlayer.create();                // in a click handler (autoplay rules)
//   const speaker = new Speaker(client, player);
//   speaker.on("word", ({ word }) => highlight(word));      // follows what is audible, not arrival
//   client.sendText("Hello "); client.sendText("there."); client.done();
//   speaker.cancel();                                       // barge-in: silent at once
//
// Types: voicewire.d.ts. Wire contract: docs/protocol.md. Guide: docs/clients.md.

export const STREAM_PATH = "/v1/audio/speech/stream";

/** What `configure()` sends unless told otherwise: pcm16 streamed in binary frames, a unit per sentence. */
export const STREAMING_DEFAULTS = Object.freeze({
  response_format: "pcm",
  stream_audio: true,
  split_granularity: "sentence",
  audio_frames: "binary",
});

/** An error of this client; `kind` says what to fix. */
export class VoicewireError extends Error {
  /**
   * @param {string} kind  "unreachable" | "unauthorized" | "not_ready" | "refused" | "closed" | "server" | "state"
   * @param {string} message  a sentence for people
   * @param {object} [detail]  the server's error event, close code, HTTP status, ...
   */
  constructor(kind, message, detail = {}) {
    super(message);
    this.name = "VoicewireError";
    this.kind = kind;
    this.detail = detail;
  }
}

/** A minimal typed event emitter: `on(type, fn)` returns the function that unsubscribes. */
class Emitter {
  constructor() {
    this._handlers = new Map();
  }

  on(type, handler) {
    if (!this._handlers.has(type)) this._handlers.set(type, new Set());
    this._handlers.get(type).add(handler);
    return () => this.off(type, handler);
  }

  off(type, handler) {
    this._handlers.get(type)?.delete(handler);
  }

  emit(type, detail) {
    for (const handler of [...(this._handlers.get(type) ?? [])]) handler(detail);
  }
}

/** Binary audio received between two `session.ack`s at most (acks also follow every JSON event); less on a
 * server whose `replay_buffer_bytes` is small: a quarter of it (the server stops sending once that much is
 * unacknowledged, so acking less often would stall the session). */
export const ACK_EVERY_BYTES = 64 * 1024;
const RECONNECT_FIRST_DELAY_MS = 50;
const RECONNECT_MAX_DELAY_MS = 2000;
/** How long `close()` goes on resuming a dropped socket to deliver `session.close` (past it the server ends
 * the session when its resume window passes). */
const CLOSE_RESUME_MS = 10000;

/** Binary bytes between two acks for a server that keeps `replayBytes` of unacknowledged frames (0: unknown). */
function ackEvery(replayBytes) {
  return replayBytes > 0 ? Math.min(ACK_EVERY_BYTES, Math.floor(replayBytes / 4)) : ACK_EVERY_BYTES;
}

/** `ws(s)://` URL of the speech stream of the server that served this page. */
export function defaultUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${STREAM_PATH}`;
}

/**
 * One WebSocket session with a voicewire server.
 *
 * Events (`client.on(type, fn)`): every server event under its `type` ("session.updated",
 * "audio.start", "audio.words", "audio.done", "session.done", "audio.cancelled", "error", ...), and "*" for
 * all of them; "audio" for each piece of audio {utteranceIndex, sentenceIndex, format, sampleRate, data};
 * "close" {code, reason, message, error} when the socket closes.
 *
 * After `cancel()`, no "audio" event of the cancelled utterances is emitted, even for frames the server
 * sent before it saw the cancel.
 *
 * Resume (on unless `resume: false`): the client acknowledges what it receives (`session.ack`) and keeps
 * what it sent until the server says it applied it. When the socket drops without a close frame (close code
 * 1006: a network blip), it emits "reconnecting" {attempt, delayMs}, reconnects with backoff for up to the
 * server's `resume_window_s`, sends `session.resume`, resends what the server had not applied, and emits
 * "resumed" {replayFrames, replayBytes}; the server replays exactly the frames that were lost, so every
 * "audio" event is emitted once, in order. "close" comes only when the session is over (or the resume
 * failed: the server's refusal comes first as an "error").
 *
 * `close()` ends the session on the server also when the socket has dropped (a resume under way, or a drop
 * not noticed yet): the client resumes only to deliver `session.close` (for up to CLOSE_RESUME_MS; no
 * "resumed", "error" or server event is emitted for it), then "close" follows.
 */
export class VoicewireClient extends Emitter {
  /** @param {{url?: string, token?: string, resume?: boolean}} [options] */
  constructor({ url, token, resume = true } = {}) {
    super();
    this.url = url || defaultUrl();
    this.token = token || null;
    this.resume = resume;
    this.reconnects = 0;
    this.reconnecting = false;
    this._resetStream();
    this.socket = null;
    this.updated = null;
    this._unit = null;
    this._pendingConfig = null;
    this._opened = 0;
    this._open = false;
    this._dropBefore = 0;
    this._fatal = null;
    this._unitOffsetMs = new Map();
  }

  /** The URL actually dialled: `url` with `?token=` when a token is set (browsers cannot send headers). */
  get socketUrl() {
    const u = new URL(this.url, location.href);
    if (this.token) u.searchParams.set("token", this.token);
    return u.toString();
  }

  /** Connected, or resuming a connection that dropped (messages sent meanwhile go out on the resume). */
  get connected() {
    return this.reconnecting || (this.socket !== null && this.socket.readyState === WebSocket.OPEN);
  }

  _resetStream() {
    this._seq = 0; // server frames received: the number of the last one
    this._ackedBytes = 0;
    this._ackEvery = ACK_EVERY_BYTES; // binary bytes between two acks (less for a small replay buffer)
    this._sentCount = 0; // client messages sent, numbered as the server counts them
    this._unapplied = []; // [number, text] sent but not yet applied by the server
    this._sessionId = null;
    this._resumeToken = null;
    this._windowS = 0;
    this._userClosed = false;
    this._closeBy = 0; // when close() stops trying to deliver session.close over a resume (Date.now())
  }

  /** The utterance index the next `sendText()` (or `done()`) belongs to. */
  get currentUtteranceIndex() {
    return this._open ? this._opened - 1 : this._opened;
  }

  /**
   * Open the socket. Resolves when it is open; rejects with a `VoicewireError` whose message says what
   * went wrong: server unreachable, token refused (HTTP 401/403), server not ready (503), ...
   */
  connect() {
    if (this.connected) return Promise.resolve(this);
    this._opened = 0;
    this._open = false;
    this._dropBefore = 0;
    this._unit = null;
    this._fatal = null;
    this._unitOffsetMs.clear();
    this._resetStream();
    return new Promise((resolve, reject) => {
      let opened = false;
      const socket = new WebSocket(this.socketUrl);
      socket.binaryType = "arraybuffer";
      this.socket = socket;
      socket.onopen = () => {
        opened = true;
        resolve(this);
      };
      socket.onmessage = (event) => this._onFrame(event.data);
      socket.onclose = (event) => {
        if (this.socket === socket) this.socket = null;
        if (!opened) {
          diagnoseRefusal(this.url, this.token).then(reject);
          return;
        }
        this._onClose(event);
      };
    });
  }

  _onClose(event) {
    if (this._canResume(event.code)) {
      this._reconnect();
      return;
    }
    const detail = {
      code: event.code,
      reason: event.reason,
      error: this._fatal,
      message: closeMessage(event.code, event.reason, this._fatal),
    };
    this._failConfig(new VoicewireError("closed", detail.message, detail));
    this.emit("close", detail);
  }

  /** A drop without a close frame (1006) of a session the server lets us resume (also after `close()`:
   * the resume then delivers `session.close`). */
  _canResume(code) {
    return this.resume && code === 1006 && this._sessionId !== null && this._resumeToken !== null
      && !this._fatal && this._windowS > 0;
  }

  /** Reconnect with backoff until the server's resume window passes (or, after `close()`, CLOSE_RESUME_MS);
   * resume on the first socket that opens. */
  async _reconnect() {
    this.reconnecting = true;
    const giveUp = Date.now() + this._windowS * 1000;
    const timeLeft = () => Math.min(giveUp, this._userClosed ? this._closeBy : giveUp) - Date.now();
    let delay = RECONNECT_FIRST_DELAY_MS;
    for (let attempt = 1; timeLeft() > 0; attempt++) {
      this.emit("reconnecting", { attempt, delayMs: delay });
      const outcome = await this._tryResume();
      if (outcome === "resumed") return;
      if (outcome === "refused") break;
      await new Promise((r) => setTimeout(r, Math.max(0, Math.min(delay, timeLeft()))));
      delay = Math.min(delay * 2, RECONNECT_MAX_DELAY_MS);
    }
    this.reconnecting = false;
    const message = this._userClosed
      ? "Closed while the connection was down."
      : this._fatal
        ? closeMessage(1008, "", this._fatal)
        : "The connection was lost and could not be resumed.";
    const detail = { code: 1006, reason: "", error: this._fatal, message };
    this._failConfig(new VoicewireError("closed", message, detail));
    this.emit("close", detail);
  }

  /** One resume attempt: "resumed" (the stream goes on), "refused" (the server said no), or "failed". */
  _tryResume() {
    return new Promise((resolve) => {
      const u = new URL(this.socketUrl);
      u.searchParams.set("session_id", this._sessionId);
      let socket;
      try {
        socket = new WebSocket(u.toString());
      } catch {
        resolve("failed");
        return;
      }
      socket.binaryType = "arraybuffer";
      let answered = false;
      socket.onopen = () => {
        socket.send(JSON.stringify({ type: "session.resume", session_id: this._sessionId, token: this._resumeToken, seq: this._seq }));
      };
      socket.onmessage = (event) => {
        if (answered) {
          if (!this._userClosed) this._onFrame(event.data); // else it only delivered session.close
          return;
        }
        answered = true;
        const answer = JSON.parse(event.data);
        if (answer.type !== "session.resumed") {
          if (!this._userClosed) { // after close() a refusal means the session is over, as asked
            this._fatal = answer;
            this.emit("error", answer);
            this.emit("*", answer);
          }
          resolve("refused");
          return;
        }
        this.socket = socket;
        this.reconnecting = false;
        this.reconnects += 1;
        this._applied(answer.input_seq);
        for (const [, text] of this._unapplied) socket.send(text);
        if (!this._userClosed) {
          this.emit("resumed", { replayFrames: answer.replay_frames, replayBytes: answer.replay_bytes });
        }
        resolve("resumed");
      };
      socket.onclose = (event) => {
        if (!answered) {
          resolve("failed");
          return;
        }
        if (this.socket === socket) {
          this.socket = null;
          this._onClose(event);
        }
      };
    });
  }

  /** The server applied the first `inputSeq` messages: forget them. */
  _applied(inputSeq) {
    let drop = 0;
    while (drop < this._unapplied.length && this._unapplied[drop][0] <= inputSeq) drop++;
    if (drop) this._unapplied.splice(0, drop);
  }

  _acknowledge(data) {
    if (!this.resume || this._sessionId === null || !this.socket) return;
    if (typeof data !== "string") {
      this._ackedBytes += data.byteLength;
      if (this._ackedBytes < this._ackEvery) return;
    }
    this._ackedBytes = 0;
    if (this.socket.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify({ type: "session.ack", seq: this._seq }));
  }

  /**
   * Send `session.config` (STREAMING_DEFAULTS overridden by `config`; null/undefined fields dropped) and
   * resolve with the server's `session.updated`. Rejects with the server's error (the old config stays).
   */
  configure(config = {}) {
    const fields = Object.fromEntries(
      Object.entries({ ...STREAMING_DEFAULTS, ...config }).filter(([, v]) => v !== undefined && v !== null),
    );
    return new Promise((resolve, reject) => {
      this._failConfig(new VoicewireError("state", "superseded by a newer configure()"));
      this._pendingConfig = { resolve, reject };
      try {
        this._send({ type: "session.config", ...fields });
      } catch (err) {
        this._pendingConfig = null;
        reject(err);
      }
    });
  }

  /** Append a text delta (a token, a word, a sentence); opens an utterance if none is open. */
  sendText(text, contextId) {
    if (!this._open) {
      this._open = true;
      this._opened += 1;
    }
    this._send({ type: "input.text", text, ...ctx(contextId) });
  }

  /** End the utterance: the server speaks what is left, then sends `session.done`. */
  done(contextId) {
    if (!this._open) this._opened += 1;
    this._open = false;
    this._send({ type: "input.done", ...ctx(contextId) });
  }

  /** True for utterances stopped by `cancel()`: their audio is dropped. */
  isCancelled(utteranceIndex) {
    return utteranceIndex < this._dropBefore;
  }

  /** Barge-in: stop every utterance in progress. No "audio" event of them follows this call. */
  cancel(contextId) {
    this._dropBefore = this._opened;
    this._open = false;
    if (this.connected) this._send({ type: "input.cancel", ...ctx(contextId) });
  }

  /** Send `session.close`; the server closes the socket with 1000. While the socket is down the resume
   * delivers it (see the class doc). */
  close() {
    if (this._userClosed) return;
    if (this.connected) this._send({ type: "session.close" });
    this._userClosed = true;
    this._closeBy = Date.now() + CLOSE_RESUME_MS;
  }

  /** Send a numbered message; while resuming it is only kept, and the resume sends it. */
  _send(message) {
    if (!this.connected) throw new VoicewireError("state", "not connected: call connect() first");
    const text = JSON.stringify(message);
    this._sentCount += 1;
    if (this.resume) this._unapplied.push([this._sentCount, text]);
    if (!this.reconnecting && this.socket && this.socket.readyState === WebSocket.OPEN) this.socket.send(text);
  }

  _failConfig(error) {
    const pending = this._pendingConfig;
    this._pendingConfig = null;
    if (pending) pending.reject(error);
  }

  _onFrame(data) {
    this._seq += 1;
    this._handleFrame(data);
    this._acknowledge(data);
  }

  _handleFrame(data) {
    if (typeof data !== "string") {
      this._emitAudio(this._unit, data);
      return;
    }
    const event = JSON.parse(data);
    if (event.input_seq !== undefined) this._applied(event.input_seq);
    switch (event.type) {
      case "session.updated":
        this.updated = event;
        this._sessionId = event.session_id;
        this._resumeToken = event.resume_token ?? null;
        this._windowS = event.limits?.resume_window_s ?? 0;
        this._ackEvery = ackEvery(event.limits?.replay_buffer_bytes ?? 0);
        if (this._pendingConfig) {
          this._pendingConfig.resolve(event);
          this._pendingConfig = null;
        }
        break;
      case "error":
        if (event.fatal) this._fatal = event;
        if (this._pendingConfig && event.utterance_index === undefined) {
          this._failConfig(new VoicewireError("server", event.message, event));
        }
        break;
      case "audio.start":
        this._unit = event;
        break;
      case "audio.done":
        this._unit = null;
        this._unitOffsetMs.set(
          event.utterance_index,
          (this._unitOffsetMs.get(event.utterance_index) ?? 0) + event.audio_ms,
        );
        break;
      case "audio.chunk":
        this._onChunk(event);
        break;
    }
    this.emit(event.type, event);
    this.emit("*", event);
  }

  /** vllm-omni's JSON audio frame: audio as an "audio" event, timestamps as "audio.words" (utterance timeline). */
  _onChunk(event) {
    if (event.audio_b64) {
      const bytes = Uint8Array.from(atob(event.audio_b64), (c) => c.charCodeAt(0));
      this._emitAudio(this._unit, bytes.buffer);
    }
    if (event.timestamps && event.timestamps.length) {
      const offset = this._unitOffsetMs.get(event.utterance_index) ?? 0;
      const words = event.timestamps.map((w) => ({ ...w, start_ms: w.start_ms + offset, end_ms: w.end_ms + offset }));
      const synthetic = {
        type: "audio.words",
        utterance_index: event.utterance_index,
        sentence_index: event.sentence_index,
        words,
      };
      this.emit("audio.words", synthetic);
    }
  }

  _emitAudio(unit, data) {
    if (!unit || this.isCancelled(unit.utterance_index)) return;
    this.emit("audio", {
      utteranceIndex: unit.utterance_index,
      sentenceIndex: unit.sentence_index,
      format: unit.format,
      sampleRate: unit.sample_rate,
      data,
    });
  }
}

function ctx(contextId) {
  return contextId === undefined || contextId === null ? {} : { context_id: contextId };
}

/** Why a socket closed before it opened: browsers hide it, so ask the same URL over plain HTTP. */
async function diagnoseRefusal(url, token) {
  const ws = new URL(url, location.href);
  if (token) ws.searchParams.set("token", token);
  const http = new URL(ws.toString());
  http.protocol = ws.protocol === "wss:" ? "https:" : "http:";
  const shown = new URL(ws.toString());
  shown.searchParams.delete("token");
  let status = 0;
  try {
    status = (await fetch(http.toString(), { cache: "no-store" })).status;
  } catch {
    return new VoicewireError(
      "unreachable",
      `Could not connect to ${shown}: the server is not reachable. Is it running, and is the URL right?`,
      { url: shown.toString() },
    );
  }
  if (status === 401 || status === 403) {
    return new VoicewireError(
      "unauthorized",
      token
        ? `The server rejected the token (HTTP ${status}). Check the token and try again.`
        : `The server needs a token (HTTP ${status}). Add ?token=YOUR_KEY to the page URL.`,
      { status },
    );
  }
  if (status === 503) {
    return new VoicewireError("not_ready", "The server is not ready yet (HTTP 503): its engine is loading. Try again shortly.", { status });
  }
  if (status === 404) {
    return new VoicewireError("refused", `No voicewire stream at ${shown} (HTTP 404). Check the URL.`, { status });
  }
  return new VoicewireError("refused", `The server at ${shown} refused the WebSocket connection (HTTP ${status}).`, { status });
}

const CLOSE_MEANINGS = {
  1000: "closed normally",
  1001: "the server is shutting down",
  1006: "the connection was lost",
  1008: "policy violation",
  1009: "a message was too large",
  1011: "internal server error",
  1013: "the server is full; try again later",
};

/** A sentence about a close: the fatal error event if there was one, else the code and reason. */
function closeMessage(code, reason, fatal) {
  if (fatal) return `The server closed the session: ${fatal.message} (${fatal.code}, close code ${code}).`;
  const meaning = CLOSE_MEANINGS[code] ?? "closed";
  return `The server closed the session: ${reason || meaning} (close code ${code}${reason ? `, ${meaning}` : ""}).`;
}

// ---------------------------------------------------------------------------------------------------
// Audio decoding: the streamable formats to int16 samples, one unit at a time.

function mulawTable() {
  const t = new Int16Array(256);
  for (let i = 0; i < 256; i++) {
    const u = ~i & 0xff;
    const v = (((u & 0x0f) << 3) + 0x84) << ((u & 0x70) >> 4);
    t[i] = u & 0x80 ? 0x84 - v : v - 0x84;
  }
  return t;
}

function alawTable() {
  const t = new Int16Array(256);
  for (let i = 0; i < 256; i++) {
    const a = i ^ 0x55;
    const seg = (a & 0x70) >> 4;
    let v = (a & 0x0f) << 4;
    v = seg === 0 ? v + 8 : (v + 0x108) << (seg - 1);
    t[i] = a & 0x80 ? v : -v;
  }
  return t;
}

const MULAW = mulawTable();
const ALAW = alawTable();

/** Formats `UnitDecoder` plays; the others (flac, mp3, opus) are whole files, not streamed. */
export const DECODABLE_FORMATS = Object.freeze(["pcm", "wav", "mulaw", "alaw"]);

/** Decodes one unit's audio, fed in pieces, to Int16Array samples (a wav unit starts with its header). */
export class UnitDecoder {
  constructor(format) {
    if (!DECODABLE_FORMATS.includes(format)) {
      throw new VoicewireError("state", `cannot play ${format} audio; use one of ${DECODABLE_FORMATS.join(", ")}`);
    }
    this.format = format;
    this._pending = new Uint8Array(0);
    this._inHeader = format === "wav";
  }

  /** @param {ArrayBuffer} data @returns {Int16Array} */
  feed(data) {
    let buf = concatBytes(this._pending, new Uint8Array(data));
    this._pending = new Uint8Array(0);
    if (this._inHeader) {
      const body = stripWavHeader(buf);
      if (body === null) {
        this._pending = buf;
        return new Int16Array(0);
      }
      this._inHeader = false;
      buf = body;
    }
    if (this.format === "mulaw" || this.format === "alaw") {
      const table = this.format === "mulaw" ? MULAW : ALAW;
      const out = new Int16Array(buf.length);
      for (let i = 0; i < buf.length; i++) out[i] = table[buf[i]];
      return out;
    }
    const whole = buf.length - (buf.length % 2);
    this._pending = buf.slice(whole);
    const view = new DataView(buf.buffer, buf.byteOffset, whole);
    const out = new Int16Array(whole / 2);
    for (let i = 0; i < out.length; i++) out[i] = view.getInt16(i * 2, true);
    return out;
  }
}

function concatBytes(a, b) {
  if (!a.length) return b;
  const out = new Uint8Array(a.length + b.length);
  out.set(a);
  out.set(b, a.length);
  return out;
}

function stripWavHeader(buf) {
  if (buf.length < 44) return null;
  const view = new DataView(buf.buffer, buf.byteOffset, buf.length);
  const tag = (at) => String.fromCharCode(buf[at], buf[at + 1], buf[at + 2], buf[at + 3]);
  if (tag(0) !== "RIFF" || tag(8) !== "WAVE") throw new VoicewireError("server", "wav audio without a RIFF header");
  let pos = 12;
  while (pos + 8 <= buf.length) {
    const size = view.getUint32(pos + 4, true);
    if (tag(pos) === "data") return buf.subarray(pos + 8);
    pos += 8 + size + (size & 1);
  }
  return null;
}

// ---------------------------------------------------------------------------------------------------
// The player: an AudioWorklet with a jitter buffer.

/**
 * Plays pcm16 chunks gap-free as they arrive through an AudioWorklet (voicewire-player.worklet.js),
 * resampling to the AudioContext's rate. Counters are in source samples: `received` (pushed), `played`
 * (sent to the speakers), `dropped` (discarded by `cancel()`), `underruns` (ran dry mid-utterance).
 * `played + dropped` is the stream index of the next sample to play.
 *
 * Events: "position" (the counters, every few ms while playing), "cancelled" (after `cancel()`).
 */
export class PcmPlayer extends Emitter {
  /**
   * Create the AudioContext (or use `context`) and load the worklet. Call from a user gesture, or call
   * `resume()` from one later, so that the browser lets it play.
   * @param {{context?: AudioContext, jitterMs?: number, workletUrl?: string|URL}} [options]
   */
  static async create({ context, jitterMs = 60, workletUrl } = {}) {
    const ctx = context ?? new AudioContext({ latencyHint: "interactive" });
    await ctx.audioWorklet.addModule(workletUrl ?? new URL("./voicewire-player.worklet.js", import.meta.url));
    const node = new AudioWorkletNode(ctx, "voicewire-player", {
      numberOfInputs: 0,
      outputChannelCount: [1],
      processorOptions: { jitterMs },
    });
    node.connect(ctx.destination);
    const player = new PcmPlayer(ctx, node);
    await player.resume();
    return player;
  }

  constructor(context, node) {
    super();
    this.context = context;
    this.node = node;
    this.received = 0;
    this.played = 0;
    this.dropped = 0;
    this.underruns = 0;
    this.playing = false;
    this._cancelId = 0;
    this._cancelWaiters = new Map();
    node.port.onmessage = (event) => this._onMessage(event.data);
  }

  /** The sample rate the audio is played at (the AudioContext's). */
  get outputRate() {
    return this.context.sampleRate;
  }

  /** The stream index of the next sample to play (`played + dropped`). */
  get position() {
    return this.played + this.dropped;
  }

  resume() {
    return this.context.state === "running" ? Promise.resolve() : this.context.resume();
  }

  /**
   * Queue samples (Int16Array pcm16, or Float32Array in [-1, 1]) at `sampleRate`.
   * @returns {number} the stream index of the first of them
   */
  push(samples, sampleRate) {
    const first = this.received;
    if (!samples.length) return first;
    let floats = samples;
    if (samples instanceof Int16Array) {
      floats = new Float32Array(samples.length);
      for (let i = 0; i < samples.length; i++) floats[i] = samples[i] / 32768;
    }
    this.received += floats.length;
    this.node.port.postMessage({ type: "push", samples: floats, rate: sampleRate }, [floats.buffer]);
    return first;
  }

  /** No more audio for now: play what is queued even if it is shorter than the jitter buffer. */
  flush() {
    this.node.port.postMessage({ type: "flush" });
  }

  /**
   * Drop everything queued, at once. Resolves with the counters when the worklet has dropped it, plus
   * `at`: the stream index where playback stopped (samples from `at` on were dropped, never heard).
   */
  cancel() {
    const id = ++this._cancelId;
    this.node.port.postMessage({ type: "cancel", id });
    return new Promise((resolve) => this._cancelWaiters.set(id, resolve));
  }

  setJitter(ms) {
    this.node.port.postMessage({ type: "jitter", ms });
  }

  async close() {
    this.node.disconnect();
    await this.context.close();
  }

  _onMessage(msg) {
    this.played = msg.played;
    this.dropped = msg.dropped;
    this.underruns = msg.underruns;
    this.playing = msg.playing;
    const counters = {
      played: msg.played,
      dropped: msg.dropped,
      received: msg.received,
      underruns: msg.underruns,
      buffered: msg.buffered,
      playing: msg.playing,
    };
    if (msg.type === "cancelled") {
      this._cancelWaiters.get(msg.id)?.({ ...counters, at: msg.at });
      this._cancelWaiters.delete(msg.id);
      this.emit("cancelled", counters);
    }
    this.emit("position", counters);
  }
}

// ---------------------------------------------------------------------------------------------------
// The speaker: client audio into the player, words timed by what is audible.

/**
 * Connects a `VoicewireClient` to a `PcmPlayer`: decodes each unit's audio and queues it, and emits
 * "word" when the *played* position reaches a word's start (from `audio.words`, whose times are ms from
 * the utterance's first sample), so highlighting follows the speakers, not the network.
 *
 * Events: "word" {utteranceIndex, index, word, start_ms, end_ms, char_start, char_end, played},
 * "utterance.start" / "utterance.end" {utteranceIndex, samples, sampleRate} when its first sample is
 * played and when its last one has been (after `session.done`), "utterance.cancelled" {utteranceIndex,
 * played, sampleRate} after `cancel()`, where `played` counts only the samples of the utterance that were
 * heard (what a barge-in interrupted the listener at), never the dropped rest.
 */
export class Speaker extends Emitter {
  constructor(client, player) {
    super();
    this.client = client;
    this.player = player;
    this._utterances = new Map(); // index -> {start, rate, samples, words, next, finished, started, decoder}
    this._unsubscribe = [
      client.on("audio.start", (e) => this._unitStart(e)),
      client.on("audio", (a) => this._audio(a)),
      client.on("audio.words", (e) => this._words(e)),
      client.on("session.done", (e) => this._done(e)),
      player.on("position", () => this._tick()),
    ];
  }

  /**
   * Barge-in: silence the player at once and cancel the server's utterances. Resolves with the player's
   * counters once it has stopped; each cancelled utterance then gets "utterance.cancelled".
   */
  async cancel() {
    this.client.cancel();
    const cancelled = [...this._utterances];
    this._utterances.clear();
    const stopped = await this.player.cancel();
    for (const [index, u] of cancelled) {
      const played = u.start === null ? 0 : Math.min(Math.max(stopped.at - u.start, 0), u.samples);
      this.emit("utterance.cancelled", { utteranceIndex: index, played, sampleRate: u.rate });
    }
    return stopped;
  }

  detach() {
    for (const off of this._unsubscribe) off();
  }

  _utterance(index) {
    let u = this._utterances.get(index);
    if (!u) {
      u = { start: null, rate: 0, samples: 0, words: [], next: 0, finished: false, started: false, decoder: null };
      this._utterances.set(index, u);
    }
    return u;
  }

  _unitStart(event) {
    if (this.client.isCancelled(event.utterance_index)) return;
    const u = this._utterance(event.utterance_index);
    u.decoder = DECODABLE_FORMATS.includes(event.format) ? new UnitDecoder(event.format) : null;
    u.rate = event.sample_rate;
  }

  _audio(audio) {
    const u = this._utterances.get(audio.utteranceIndex);
    if (!u || !u.decoder) return;
    const samples = u.decoder.feed(audio.data);
    if (!samples.length) return;
    const first = this.player.push(samples, audio.sampleRate);
    if (u.start === null) u.start = first;
    u.samples += samples.length;
  }

  _words(event) {
    const u = this._utterances.get(event.utterance_index);
    if (!u) return;
    u.words.push(...event.words);
    u.words.sort((a, b) => a.start_ms - b.start_ms);
  }

  _done(event) {
    const u = this._utterances.get(event.utterance_index);
    if (!u) return;
    u.finished = true;
    this.player.flush();
    if (u.start === null) {
      this._utterances.delete(event.utterance_index);
      this.emit("utterance.end", { utteranceIndex: event.utterance_index, start: null, samples: 0, sampleRate: u.rate });
      return;
    }
    this._tick();
  }

  /** How far behind the worklet's output the speakers are, in ms. */
  get latencyMs() {
    const ctx = this.player.context;
    return ((ctx.outputLatency || 0) + (ctx.baseLatency || 0)) * 1000;
  }

  _tick() {
    const position = this.player.position;
    for (const [index, u] of this._utterances) {
      if (u.start === null || position <= u.start) continue;
      if (!u.started) {
        u.started = true;
        this.emit("utterance.start", { utteranceIndex: index, start: u.start, samples: u.samples, sampleRate: u.rate });
      }
      const ended = u.finished && position >= u.start + u.samples;
      const audibleMs = ((position - u.start) * 1000) / u.rate - this.latencyMs;
      while (u.next < u.words.length && (ended || u.words[u.next].start_ms <= audibleMs)) {
        this.emit("word", { utteranceIndex: index, index: u.next, ...u.words[u.next], played: position });
        u.next += 1;
      }
      if (ended) {
        this._utterances.delete(index);
        this.emit("utterance.end", { utteranceIndex: index, start: u.start, samples: u.samples, sampleRate: u.rate });
      }
    }
  }
}
