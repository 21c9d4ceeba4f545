// Drives the demo page in Debian's headless Chromium (playwright-core) and prints one JSON object.
//
//   node drive.mjs main    BASE_URL SCREENSHOT   speak a paragraph, stop mid-utterance, speak again
//   node drive.mjs message PAGE_URL              open the page, press Speak, report the message shown
//   node drive.mjs load    PAGE_URL              open the page, report its connection and message
//   node drive.mjs resume  PAGE_URL              speak a paragraph through a connection the test cuts;
//                                                report what played, the connection badges shown, the
//                                                SHA-256 of the audio the client emitted, how much text
//                                                was typed when the connection dropped, and the config
//   node drive.mjs pages   JOBS_JSON             {"name": ["message" | "load", PAGE_URL], ...}: each job in a
//                                                page of its own, in one browser; report {"name": report},
//                                                each with the console errors of its own page
//   node drive.mjs close-reconnecting PAGE_URL?proxy=WS_URL
//                                                a VoicewireClient of the page speaks through WS_URL, which
//                                                the test cuts; it calls close() as soon as it is
//                                                reconnecting; report what it emitted
//
// The assertions live in tests/test_browser.py; this script only acts as a user would and reports
// what the page shows and what its player counted.

import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const PARAGRAPH =
  "Good morning! Voicewire streams speech while the text is still arriving. " +
  "Each sentence starts playing as soon as it is ready, and every word lights up when you hear it.";
const LONG =
  "This is a long answer that we are going to interrupt. " +
  "It keeps going with a second sentence that takes a while to say. " +
  "And a third sentence, which nobody should ever hear because Stop was pressed. " +
  "A fourth sentence is still being typed when the listener barges in. " +
  "The fifth one makes sure the text is still arriving at that moment. " +
  "And the sixth one closes this answer that nobody will hear.";
const NEXT = "Now something else, right after the stop.";

const [mode, target, screenshot] = process.argv.slice(2);
const profile = mkdtempSync(join(tmpdir(), "voicewire-chromium-"));
const consoleErrors = [];

// A fresh profile each run; playwright passes it to Chromium as --user-data-dir.
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  headless: true,
  viewport: { width: 1100, height: 640 },
  args: [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--autoplay-policy=no-user-gesture-required",
  ],
});

async function openPage(url) {
  const page = await browser.newPage();
  page.on("console", (msg) => {
    if (msg.type() === "error") consoleErrors.push(msg.text());
  });
  page.on("pageerror", (err) => consoleErrors.push(`pageerror: ${err.message}`));
  await page.goto(url);
  await page.waitForFunction(() => window.voicewireDemo && window.voicewireDemo.ready, null, { timeout: 30000 });
  return page;
}

const last = (page) => page.evaluate(() => {
  const demo = window.voicewireDemo;
  const rec = demo.utterances[demo.utterances.length - 1];
  return rec ? { ...rec } : null;
});

/** Fill the text box and press Speak; resolves once the page has started the new utterance. */
async function startSpeaking(page, text) {
  const before = await page.evaluate(() => window.voicewireDemo.utterances.length);
  await page.fill("#text", text);
  await page.click("#speak");
  await page.waitForFunction((n) => window.voicewireDemo.utterances.length > n, before, { timeout: 30000 });
}

const waitEnded = (page) => page.waitForFunction(() => {
  const u = window.voicewireDemo.utterances;
  return u[u.length - 1].ended;
}, null, { timeout: 90000 });

async function main(base) {
  const page = await openPage(`${base}/`);
  const loaded = await page.evaluate(() => ({
    message: window.voicewireDemo.message,
    engine: window.voicewireDemo.engine && window.voicewireDemo.engine.name,
    connection: document.getElementById("connection").textContent,
  }));
  const errorsAfterLoad = [...consoleErrors];

  await page.fill("#pace", "10");
  await page.fill("#piece", "5");
  await startSpeaking(page, PARAGRAPH);
  await page.waitForFunction(() => {
    const u = window.voicewireDemo.utterances;
    const rec = u[u.length - 1];
    return rec && rec.words.length && rec.highlighted.length >= Math.ceil(rec.words.length / 2);
  }, null, { timeout: 90000 });
  if (screenshot) await page.screenshot({ path: screenshot });
  await waitEnded(page);
  const paragraph = await last(page);
  const outputRate = await page.evaluate(() => window.voicewireDemo.player.outputRate);

  await page.fill("#pace", "40");
  await startSpeaking(page, LONG);
  await page.waitForFunction(() => {
    const demo = window.voicewireDemo;
    const rec = demo.utterances[demo.utterances.length - 1];
    const p = demo.player;
    return rec.startIndex !== null && rec.sampleRate && p.played + p.dropped - rec.startIndex >= rec.sampleRate * 0.8;
  }, null, { timeout: 90000 });
  await page.click("#stop");
  await page.waitForFunction(() => {
    const u = window.voicewireDemo.utterances;
    return u[u.length - 1].stopAck;
  }, null, { timeout: 10000 });
  const stoppedAt = await page.evaluate(() => window.voicewireDemo.player.played);
  await page.waitForTimeout(700);
  const stopped = await last(page);
  const playedAfterWait = await page.evaluate(() => window.voicewireDemo.player.played);
  const statusAfterStop = await page.textContent("#status");
  const playedShownAfterStop = await page.textContent("#played");
  await page.fill("#pace", "10");

  await startSpeaking(page, NEXT);
  await waitEnded(page);
  const next = await last(page);
  const stats = await page.evaluate(() => ({
    ttfa: document.getElementById("ttfa").textContent,
    underruns: document.getElementById("underruns").textContent,
    transcript: document.getElementById("transcript").textContent,
    message: window.voicewireDemo.message,
  }));
  await page.close();
  return {
    loaded, errorsAfterLoad, outputRate, paragraph, stopped, stoppedAt, playedAfterWait, statusAfterStop,
    playedShownAfterStop, next, stats,
  };
}

async function message(url) {
  const page = await openPage(url);
  await page.click("#speak");
  await page.waitForFunction(() => window.voicewireDemo.message, null, { timeout: 20000 });
  const shown = await page.evaluate(() => ({
    message: window.voicewireDemo.message,
    text: document.getElementById("message").textContent,
    visible: !document.getElementById("message").hidden,
    connection: document.getElementById("connection").textContent,
  }));
  await page.close();
  return shown;
}

async function load(url) {
  const page = await openPage(url);
  const shown = await page.evaluate(() => ({
    message: window.voicewireDemo.message,
    connection: document.getElementById("connection").textContent,
  }));
  await page.close();
  return shown;
}

async function resume(url) {
  const page = await openPage(url);
  await page.evaluate(() => {
    const demo = window.voicewireDemo;
    window.badges = [];
    new MutationObserver(() => window.badges.push(document.getElementById("connection").textContent))
      .observe(document.getElementById("connection"), { childList: true, characterData: true, subtree: true });
    // Registered before the page's player exists, so each buffer is copied before the player takes it.
    window.heard = { chunks: [], typedAtCut: null };
    demo.client.on("audio", (a) => window.heard.chunks.push(new Uint8Array(a.data).slice()));
    demo.client.on("reconnecting", () => {
      const u = demo.utterances;
      if (window.heard.typedAtCut === null && u.length) window.heard.typedAtCut = u[u.length - 1].typedChars;
    });
  });
  await page.fill("#pace", "40"); // the text is still being typed when the connection drops
  await page.fill("#piece", "5");
  await startSpeaking(page, PARAGRAPH);
  await waitEnded(page);
  const paragraph = await last(page);
  const shown = await page.evaluate(async () => {
    const { chunks, typedAtCut } = window.heard;
    const audio = new Uint8Array(chunks.reduce((n, c) => n + c.length, 0));
    chunks.reduce((at, c) => (audio.set(c, at), at + c.length), 0);
    const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", audio));
    return {
      reconnecting: window.voicewireDemo.reconnecting,
      resumes: window.voicewireDemo.resumes,
      badges: window.badges,
      connection: document.getElementById("connection").textContent,
      message: window.voicewireDemo.message,
      audioBytes: audio.length,
      audioSha256: Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join(""),
      typedAtCut,
      config: window.voicewireDemo.client.updated.config,
    };
  });
  await page.close();
  return { paragraph, ...shown };
}

/** A client of its own (not the demo's) through the proxy: close() at the first "reconnecting", whose
 * attempt the proxy refuses, so close() falls between two attempts. */
async function closeReconnecting(url) {
  const page = await openPage(url);
  const proxy = new URL(url).searchParams.get("proxy");
  const report = await page.evaluate(async ({ proxy, text }) => {
    const { VoicewireClient } = await import("/clients/voicewire.js");
    const client = new VoicewireClient({ url: proxy });
    const emitted = [];
    let closeCalled = false;
    let audioAfterClose = 0;
    client.on("reconnecting", ({ attempt }) => {
      emitted.push(`reconnecting ${attempt}`);
      if (attempt === 1) {
        client.close();
        closeCalled = true;
      }
    });
    client.on("resumed", () => emitted.push("resumed"));
    client.on("error", (e) => emitted.push(`error ${e.code}`));
    client.on("audio", () => {
      if (closeCalled) audioAfterClose += 1;
    });
    const closed = new Promise((resolve) => client.on("close", resolve));
    await client.connect();
    const updated = await client.configure({ seed: 7 });
    client.sendText(text);
    client.done();
    const detail = await closed;
    return {
      sessionId: updated.session_id, emitted, audioAfterClose, closeCalled,
      close: { code: detail.code, message: detail.message },
    };
  }, { proxy, text: PARAGRAPH });
  await page.close();
  return report;
}

/** Several `message` and `load` jobs, one after the other, in one browser (one launch instead of one each). */
async function pages(jobs) {
  const reports = {};
  for (const [name, [job, url]] of Object.entries(JSON.parse(jobs))) {
    const before = consoleErrors.length;
    reports[name] = await { message, load }[job](url);
    reports[name].consoleErrors = consoleErrors.splice(before);
  }
  return reports;
}

const modes = { main, message, load, resume, pages, "close-reconnecting": closeReconnecting };
let result;
try {
  result = await modes[mode](target);
} catch (err) {
  result = { failure: String(err && err.stack ? err.stack : err) };
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
process.stdout.write(JSON.stringify({ ...result, consoleErrors }) + "\n");
