// The demo page served at `/`: streams the text box to the server as an LLM would type it, plays the
// audio through the AudioWorklet player and highlights each word when it is heard.
//
// Page options: ?token=KEY, ?url=ws://host:port/v1/audio/speech/stream, ?jitter=MS, ?seed=N.
// `window.voicewireDemo` exposes the page's state (utterances, counters, messages) for tests and tinkering.

import { PcmPlayer, Speaker, VoicewireClient } from "./voicewire.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const client = new VoicewireClient({ url: params.get("url") || undefined, token: params.get("token") || undefined });
const jitterMs = Number(params.get("jitter") || 60);
const seed = params.get("seed"); // the engine's seed: the same text gives the same audio every time

/** Everything the page knows, readable from the console (and by the browser tests). */
const demo = {
  ready: false,
  message: null,
  engine: null,
  utterances: [],
  player: null,
  speaking: false,
  reconnecting: 0, // times the connection dropped and the page started resuming it
  resumes: 0, // times it resumed
  client,
  speak,
  stop,
};
window.voicewireDemo = demo;

let player = null;
let speaker = null;
let typing = null; // {aborted: boolean} of the typing loop in progress
let voicesFilled = false;

function current() {
  return demo.utterances[demo.utterances.length - 1];
}

function showMessage(text, kind = "error") {
  const el = $("message");
  demo.message = text ? { text, kind } : null;
  el.hidden = !text;
  el.textContent = text || "";
  el.className = kind === "info" ? "info" : "";
}

function setConnection(text, kind) {
  const el = $("connection");
  el.textContent = text;
  el.className = `badge ${kind || ""}`;
}

function setStatus(text) {
  $("status").textContent = text;
}

function config() {
  const rate = $("rate").value;
  return {
    voice: $("voice").value || undefined,
    speed: Number($("speed").value) || 1,
    response_format: $("format").value,
    sample_rate: rate ? Number(rate) : undefined,
    word_timestamps: true,
    seed: seed === null ? undefined : Number(seed),
  };
}

async function ensureSession() {
  if (client.connected) return;
  setConnection("connecting…");
  await client.connect();
  const updated = await client.configure(config());
  demo.engine = updated.engine;
  setConnection(`connected · ${updated.engine.name} · ${updated.engine.sample_rate / 1000} kHz`, "ok");
  if (!voicesFilled) {
    voicesFilled = true;
    const select = $("voice");
    for (const voice of updated.engine.voices) {
      const option = document.createElement("option");
      option.value = voice;
      option.textContent = voice === updated.engine.default_voice ? `${voice} (default)` : voice;
      select.append(option);
    }
  }
}

async function ensurePlayer() {
  if (player) return player.resume();
  player = await PcmPlayer.create({ jitterMs });
  demo.player = player;
  speaker = new Speaker(client, player);
  speaker.on("utterance.start", (e) => {
    const rec = byIndex(e.utteranceIndex);
    if (!rec) return;
    rec.startIndex = e.start;
    rec.firstSoundMs = performance.now() - rec.t0;
    $("first-sound").textContent = `${rec.firstSoundMs.toFixed(0)} ms`;
    setStatus("speaking");
  });
  speaker.on("word", (w) => {
    const rec = byIndex(w.utteranceIndex);
    if (!rec) return;
    rec.highlighted.push({ index: w.index, word: w.word, charStart: w.char_start, startMs: w.start_ms, played: w.played });
    renderTranscript(rec);
  });
  speaker.on("utterance.end", (e) => {
    const rec = byIndex(e.utteranceIndex);
    if (!rec) return;
    rec.ended = true;
    rec.samples = e.samples;
    rec.sampleRate = e.sampleRate;
    rec.playedAtEnd = player.played;
    rec.droppedAtEnd = player.dropped;
    rec.receivedAtEnd = player.received;
    if (rec === current()) {
      demo.speaking = false;
      setStatus("done");
    }
  });
  speaker.on("utterance.cancelled", (e) => {
    const rec = demo.utterances.findLast((u) => u.index === e.utteranceIndex && u.cancelled);
    if (!rec) return;
    rec.heardSamples = e.played;
    if (rec === current() && e.sampleRate) showPlayed(e.played / e.sampleRate);
  });
  player.on("position", (p) => {
    $("underruns").textContent = String(p.underruns);
    const rec = current();
    // A stopped utterance shows what was heard ("utterance.cancelled"), not the samples Stop dropped.
    if (rec && !rec.cancelled && rec.startIndex !== null && rec.sampleRate) {
      showPlayed(Math.max(0, p.played + p.dropped - rec.startIndex) / rec.sampleRate);
    }
  });
  return undefined;
}

function showPlayed(seconds) {
  $("played").textContent = `${seconds.toFixed(2)} s`;
}

function byIndex(index) {
  return demo.utterances.findLast((u) => u.index === index && !u.cancelled);
}

client.on("audio.start", (e) => {
  const rec = byIndex(e.utterance_index);
  if (rec) rec.sampleRate = e.sample_rate;
});
client.on("audio", (a) => {
  const rec = demo.utterances.findLast((u) => u.index === a.utteranceIndex);
  if (!rec) return;
  rec.bytesReceived += a.data.byteLength;
  if (rec.ttfaMs === null) {
    rec.ttfaMs = performance.now() - rec.t0;
    $("ttfa").textContent = `${rec.ttfaMs.toFixed(0)} ms`;
  }
});
client.on("audio.words", (e) => {
  const rec = byIndex(e.utterance_index);
  if (!rec) return;
  rec.words.push(...e.words);
  rec.words.sort((a, b) => a.char_start - b.char_start);
  renderTranscript(rec);
});
client.on("audio.done", (e) => {
  const rec = byIndex(e.utterance_index);
  if (rec) rec.sentBytes += e.total_bytes;
});
client.on("session.done", (e) => {
  const rec = byIndex(e.utterance_index);
  if (!rec) return;
  rec.serverDone = e;
  const first = e.timings.first_audio_ms;
  $("server-ttfa").textContent = first === null ? "–" : `${first.toFixed(0)} ms`;
});
client.on("audio.cancelled", (e) => {
  const rec = demo.utterances.findLast((u) => u.index === e.utterance_index);
  if (rec) rec.serverCancelled = e;
});
client.on("error", (e) => {
  if (!e.fatal) showMessage(`Server error: ${e.message}`);
});
client.on("reconnecting", ({ attempt }) => {
  demo.reconnecting += 1;
  setConnection(attempt > 1 ? `reconnecting… (try ${attempt})` : "reconnecting…", "warn");
});
client.on("resumed", () => {
  demo.resumes += 1;
  const updated = client.updated;
  setConnection(`connected · ${updated.engine.name} · ${updated.engine.sample_rate / 1000} kHz`, "ok");
});
client.on("close", (detail) => {
  abortTyping();
  if (detail.error && detail.error.code === "idle_timeout") {
    setConnection("idle · reconnects on Speak");
    return;
  }
  setConnection("disconnected", "bad");
  showMessage(detail.message);
  if (demo.speaking && player) {
    player.cancel();
    demo.speaking = false;
    setStatus("disconnected");
  }
});

function renderTranscript(rec) {
  const box = $("transcript");
  box.replaceChildren();
  const lit = new Set(rec.highlighted.map((h) => h.charStart));
  const last = rec.highlighted[rec.highlighted.length - 1];
  let at = 0;
  for (const w of rec.words) {
    if (w.char_start < at) continue;
    box.append(rec.text.slice(at, w.char_start));
    const span = document.createElement("span");
    span.className = "word";
    if (lit.has(w.char_start)) span.classList.add(last && last.charStart === w.char_start ? "current" : "spoken");
    span.textContent = rec.text.slice(w.char_start, w.char_end);
    box.append(span);
    at = w.char_end;
  }
  box.append(rec.text.slice(at));
}

function abortTyping() {
  if (typing) typing.aborted = true;
  typing = null;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** Speak the text box: stream it in pieces at the chosen pace. Interrupts what is playing. */
async function speak(text = $("text").value) {
  showMessage(null);
  if (demo.speaking) await stop();
  try {
    await ensurePlayer();
    await ensureSession();
    await client.configure(config());
  } catch (err) {
    if (err.kind === "server") {
      showMessage(`The server refused these settings: ${err.message}`);
    } else {
      setConnection("not connected", "bad");
      showMessage(err.message);
    }
    return;
  }
  const rec = {
    index: client.currentUtteranceIndex,
    text,
    t0: performance.now(),
    ttfaMs: null,
    firstSoundMs: null,
    typedChars: 0, // characters of the text sent so far
    bytesReceived: 0,
    sentBytes: 0,
    sampleRate: 0,
    words: [],
    highlighted: [],
    startIndex: null,
    heardSamples: null,
    playedAtStart: player.played,
    droppedAtStart: player.dropped,
    receivedAtStart: player.received,
    ended: false,
    cancelled: false,
    serverDone: null,
  };
  demo.utterances.push(rec);
  demo.speaking = true;
  for (const id of ["ttfa", "server-ttfa", "first-sound"]) $(id).textContent = "–";
  setStatus("streaming text");
  renderTranscript(rec);
  const pace = Math.max(0, Number($("pace").value) || 0);
  const piece = Math.max(1, Number($("piece").value) || 1);
  const run = { aborted: false };
  typing = run;
  try {
    for (let i = 0; i < text.length && !run.aborted; i += piece) {
      if (i === 0) rec.t0 = performance.now();
      client.sendText(text.slice(i, i + piece));
      rec.typedChars = Math.min(text.length, i + piece);
      if (pace) await sleep(pace);
    }
    if (!run.aborted) client.done();
  } catch (err) {
    showMessage(err.message);
  }
  if (typing === run) typing = null;
}

/** Barge-in: silence playback at once and cancel the utterance on the server. */
async function stop() {
  abortTyping();
  const rec = current();
  if (!speaker || !rec || rec.ended || rec.cancelled) return;
  rec.playedAtStop = player.played;
  rec.bytesAtStop = rec.bytesReceived;
  rec.cancelled = true;
  demo.speaking = false;
  rec.stopAck = await speaker.cancel();
  setStatus("stopped");
}

$("speak").addEventListener("click", () => speak());
$("stop").addEventListener("click", () => stop());

ensureSession()
  .catch((err) => {
    setConnection("not connected", "bad");
    showMessage(err.message);
  })
  .finally(() => {
    demo.ready = true;
  });
