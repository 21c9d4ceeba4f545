"""vllm-omni's own speech server against voicewire's `omni` engine: the same vllm-omni pipeline, the same
model folder and stage config, the same clients (issue 13).

Two servers, each its own process tree, started together (or one after the other with `--sequential`):
- **vllm-omni**: its OpenAI-compatible server, `python -m vllm_omni.entrypoints.cli.main serve MODEL --omni
  --deploy-config YAML` (what the `vllm-omni serve` / `vllm serve --omni` commands run): WebSocket
  `/v1/audio/speech/stream`, REST `/v1/audio/speech`;
- **voicewire**: `python -m voicewire.realtime serve --engine omni --model MODEL --stage-config YAML`, the
  same endpoints.

The model is a Qwen3-TTS 12 Hz CustomVoice folder written here with random weights (`load_format: dummy`
on every stage): tiny on the CPU (`--shape tiny`), the released 1.7B shapes on a GPU (`--shape 1.7b`).
Both servers must produce exactly `--frames` codec frames per request: the folder's talker has no codec
stop token (`codec_eos_token_id` -1, so vllm-omni's codec mask never lets it be sampled), and every request
asks for `max_new_tokens` = `--frames`. The stage config starts from `--deploy-config` (default:
voicewire's CPU config on a CPU build, vllm-omni's own `deploy/qwen3_tts.yaml` on a GPU) and the bench
changes only what it must: dummy weights, `max_num_seqs` >= the highest concurrency, and on a GPU each
stage's memory share (`--gpu-share`, `--kv-cache-gib`) so that both servers fit on one GPU at once.
Connector, chunk and sampling settings stay as given, but for what vllm-omni's high-concurrency profile
changes in the talker, when asked: `--talker-step-tokens` (prompt tokens a talker step prefills) and
`--predictor-prefix-graphs` (the code predictor's prefix CUDA graphs).

The WebSocket clients and the REST clients run in a process of their own (spawned), each session from its
own loopback address (voicewire caps sessions per address). Per concurrency C and round, C sessions at
once, on each server in turn:
- **ws**: each session sends `session.config` (pcm, `stream_audio`, `split_granularity`, voice, seed,
  `max_new_tokens`) and the text; once every session has, and after a short settle, all send `input.done`;
  TTFA runs from sending `input.done` to the first binary frame;
- **rest**: each sends `POST /v1/audio/speech` (pcm, `stream_format: "audio"`, the same fields); TTFA runs
  from sending the request to the first body byte.
Stalls are counted as a player that starts at the first audio byte hears them (`workload.play`); audio
seconds per wall second are all streams' audio over the time from the first send to the last byte. Rounds
go round 1 at every level, then round 2 at every level, and so on (a budget cut leaves every level with
some rounds); at 1 session `--single-rounds` (default 5) rounds are measured, the extra ones last. A
warm-up round precedes each level's first round on each server (every mode at the first level, so each
path is warm; the first mode after that, so every batch shape is).

Report: per mode, concurrency and server, median [min-max] over rounds of TTFA p50 and p95, streams with a
stall and total stall seconds (every round listed), audio seconds per wall second and audio seconds per
stream (which must be equal on both servers); then the ratio voicewire / vllm-omni of each median.
`--out DIR` writes `omni_duel.json` after every round, so a run cut short keeps what it measured, and
`--budget-s` skips the rounds that would not finish in time. `--report A.json B.json` runs nothing and
prints the joined report of saved runs (on the GPU machine, one device call per server: bench/gpu/README.md).

Run from the repository root with a Python that has vllm-omni and voicewire's omni engine:
`python -m bench.omni_duel --shape tiny --concurrency 1,2 --rounds 1 --frames 25` on the CPU (two engine
starts, a few minutes on 2 cores). On the GPU machine: bench/gpu/omni_duel.sh (bench/gpu/README.md has the
device commands); results in docs/benchmarks.md ("vllm-omni's own server against voicewire").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Final, cast

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from voicewire.protocol.segmenter import Segmenter

from bench.workload import Provenance, Stream, percentile, play, spread, table
from tests.server import free_port

TEXT: Final = ("Your flight to Tokyo departs from gate B twelve at noon and boarding begins forty minutes earlier "
               "so please have your passport and boarding pass ready.")
"""What every session says; its length sets the prompt, `--frames` the audio. One sentence without a
clause break: voicewire's REST route speaks each sentence unit (and a fast first clause) as its own engine
request, each with `max_new_tokens` frames, so only a text that is one unit gets the same audio as
vllm-omni's one request (`main` checks it with voicewire's segmenter)."""
VOICE: Final = "vivian"
SERVERS: Final = ("vllm-omni", "voicewire")
TASK_TYPES: Final = ("CustomVoice", "VoiceDesign", "Base")
"""Qwen3-TTS's three checkpoints, one task type each (`--task-types`): each gets its own model folder and
server; CustomVoice speaks as `VOICE`, VoiceDesign from `INSTRUCTIONS`, Base clones `reference_wav()`."""
INSTRUCTIONS: Final = "A calm, warm voice, speaking clearly at an even pace."
REF_TEXT: Final = "This is the reference recording for the cloned voice."
MODES: Final = ("ws", "rest")
SETTLE_S: Final = 0.3
"""Pause between the last session's config and `input.done`, so both servers have taken every config."""

TALKER_1_7B: Final[dict[str, Any]] = {
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "text_hidden_size": 2048,
    "rope_scaling": {"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default", "type": "default"},
}
"""The released Qwen3-TTS-12Hz-1.7B talker's sizes (config.json, `talker_config`)."""
CODE_PREDICTOR_1_7B: Final[dict[str, Any]] = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "layer_types": ["full_attention"] * 5,
}
CODEC_ENCODER_12HZ: Final[dict[str, Any]] = {
    "codebook_dim": 256, "hidden_size": 512, "vector_quantization_hidden_dimension": 256, "intermediate_size": 2048,
    "upsample_groups": 512,
}
CODEC_DECODER_12HZ: Final[dict[str, Any]] = {
    "codebook_dim": 512, "hidden_size": 512, "head_dim": 64, "latent_dim": 1024, "num_attention_heads": 16,
    "num_key_value_heads": 16, "intermediate_size": 1024, "num_hidden_layers": 8, "decoder_dim": 1536,
}
"""The released 12 Hz speech tokenizer's sizes (speech_tokenizer/config.json)."""


# -- model folder and stage config --------------------------------------------------------------------

def write_model(folder: Path, shape: str, task_type: str = "CustomVoice") -> Path:
    """A random-weight Qwen3-TTS folder of `task_type`'s checkpoint: voicewire's tiny test model, or
    (`1.7b`) the same folder with the released 1.7B model's widths and depths; either way without a codec
    stop token, so that every request runs to its `max_new_tokens`."""
    from voicewire.adapters.omni_testing import ModelKind, write_qwen3_tts

    kinds: dict[str, ModelKind] = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
    write_qwen3_tts(folder, kinds[task_type])
    config = json.loads((folder / "config.json").read_text())
    config["talker_config"]["codec_eos_token_id"] = -1
    if shape == "tiny":
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        return folder
    config["tts_model_size"] = "1b7"
    config["talker_config"].update(TALKER_1_7B)
    config["talker_config"]["code_predictor_config"].update(CODE_PREDICTOR_1_7B)
    config["speaker_encoder_config"] = {"enc_dim": TALKER_1_7B["hidden_size"], "sample_rate": 24000}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    codec_path = folder / "speech_tokenizer" / "config.json"
    codec = json.loads(codec_path.read_text())
    encoder = {k: v for k, v in codec["encoder_config"].items()
               if k not in ("num_filters", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                            "head_dim")}
    codec["encoder_config"] = {**encoder, **CODEC_ENCODER_12HZ}
    codec["decoder_config"].update(CODEC_DECODER_12HZ)
    codec_path.write_text(json.dumps(codec, indent=1))
    return folder


def default_deploy_config() -> Path:
    """vllm-omni's own Qwen3-TTS deploy YAML on a GPU; voicewire's CPU stage config on vLLM's CPU build."""
    if _cuda():
        import vllm_omni

        return Path(str(vllm_omni.__file__)).resolve().parent / "deploy" / "qwen3_tts.yaml"
    from voicewire.adapters.omni import CPU_STAGE_CONFIGS

    return Path(CPU_STAGE_CONFIGS["qwen3_tts"])


PREFIX_GRAPH_SEQ_LENS: Final = (2, 3, 4, 5, 6, 7, 8)
"""The code predictor's sequence lengths `--predictor-prefix-graphs` captures graphs for: its first 7 residual
codebooks, the lengths vllm-omni's own `deploy/qwen3_tts_high_concurrency.yaml` lists."""


def write_deploy_config(base: Path, out: Path, *, max_num_seqs: int, gpu_share: float | None,
                        kv_cache_gib: float | None, talker_step_tokens: int | None = None,
                        prefix_graph_batches: Sequence[int] = ()) -> Path:
    """`base` with what the duel needs (see the module doc); connectors and chunk settings untouched unless
    asked: `talker_step_tokens` sets stage 0's `max_num_batched_tokens` (the prompt tokens one talker step
    may prefill), `prefix_graph_batches` turns on the talker's code-predictor prefix CUDA graphs for those
    batch sizes (every connector's `extra`, where vllm-omni's talker reads them; ignored off CUDA). Both are
    what vllm-omni's high-concurrency profile changes for the talker."""
    import yaml

    deploy = cast(dict[str, Any], yaml.safe_load(base.read_text()))
    for stage in deploy["stages"]:
        stage["load_format"] = "dummy"
        stage["max_num_seqs"] = max(int(stage.get("max_num_seqs") or 0), max_num_seqs)
        if gpu_share is not None:
            stage["gpu_memory_utilization"] = gpu_share
        if kv_cache_gib is not None:
            stage["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if talker_step_tokens is not None and stage.get("stage_id") == 0:
            stage["max_num_batched_tokens"] = talker_step_tokens
    if prefix_graph_batches:
        for connector in deploy.get("connectors", {}).values():
            connector.setdefault("extra", {}).update(
                code_predictor_prefix_graphs=True, code_predictor_prefix_graph_buckets=list(prefix_graph_batches),
                code_predictor_prefix_graph_seq_lens=list(PREFIX_GRAPH_SEQ_LENS))
    out.write_text(yaml.safe_dump(deploy, sort_keys=False))
    return out


def reference_wav(seconds: float = 3.0, rate: int = 24000) -> bytes:
    """A 16-bit mono WAV to clone (Base): a gliding tone with a little noise (fixed seed). With random
    weights any waveform serves; WAV because the GPU machine's PyAV stand-in decodes only that."""
    import io
    import wave

    import numpy as np

    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(7).standard_normal(t.size)
    signal = 0.4 * np.sin(2 * np.pi * (140 + 60 * t) * t) + 0.02 * noise
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((signal * 32767).astype("<i2").tobytes())
    return out.getvalue()


def task_fields(task_type: str) -> dict[str, Any]:
    """The request fields that select `task_type`'s voice (see `TASK_TYPES`)."""
    if task_type == "CustomVoice":
        return {"voice": VOICE}
    if task_type == "VoiceDesign":
        return {"task_type": "VoiceDesign", "instructions": INSTRUCTIONS}
    import base64

    reference = "data:audio/wav;base64," + base64.b64encode(reference_wav()).decode()
    return {"task_type": "Base", "ref_audio": reference, "ref_text": REF_TEXT}


def server_name(server: str, task_type: str) -> str:
    """`server` for CustomVoice (the duel's names, which `--report` joins and compares), else
    `server/task_type`."""
    return server if task_type == "CustomVoice" else f"{server}/{task_type}"


def sample_rate(model: Path) -> int:
    return int(json.loads((model / "speech_tokenizer" / "config.json").read_text())["output_sample_rate"])


# -- servers --------------------------------------------------------------------------------------------

class Server:
    """One server's process tree (its own process group, so its stage processes stop with it), its log in
    `log_dir`, vLLM's compile cache in `cache_dir`, on a free loopback port."""

    def __init__(self, name: str, kind: str, model: Path, deploy: Path, log_dir: Path, cache_dir: Path,
                 concurrency: int, fields: dict[str, Any], extra_args: Sequence[str] = ()) -> None:
        self.name = name
        self.kind = kind
        self.fields = fields
        """The request fields of this server's task type (`task_fields`)."""
        self.port = free_port()
        if kind == "vllm-omni":
            command = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(model), "--omni",
                       "--deploy-config", str(deploy), "--host", "127.0.0.1", "--port", str(self.port)]
            self.ready_path = self.failed_path = "/health"
        else:
            sessions = str(4 * concurrency + 16)
            command = [sys.executable, "-m", "voicewire.realtime", "serve", "--engine", "omni", "--model", str(model),
                       "--stage-config", str(deploy), "--omni-max-concurrency", str(concurrency),
                       "--host", "127.0.0.1", "--port", str(self.port), "--max-sessions", sessions,
                       "--admission-utilization", "0", "--no-auth", "--log-level", "WARNING", *extra_args]
            self.ready_path, self.failed_path = "/ready", "/health"
        self.log_path = log_dir / f"{name.replace('/', '-')}.log"
        self._log = self.log_path.open("wb")
        cache = cache_dir / f"vllm-cache-{name.replace('/', '-')}"  # no two compilers share a cache
        env = {**os.environ, "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1"), "VLLM_CACHE_ROOT": str(cache)}
        self.began = time.perf_counter()
        # a process group of its own (not a session: a machine that ends leftover sessions' processes still can)
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, process_group=0)
        self.ready_s: float | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, mode: str) -> str:
        """The WebSocket (`ws`) or REST (`rest`) speech endpoint."""
        if mode == "ws":
            return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream"
        return f"{self.http_url}/v1/audio/speech"

    async def wait_ready(self, timeout: float) -> None:
        """Until the server is ready; raise if it exits, reports a failed engine start (voicewire's `/health`
        answers 500) or is not ready within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        probe = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log: {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(self.http_url + self.ready_path, timeout=probe) as response:
                        if response.status == 200:
                            self.ready_s = time.perf_counter() - self.began
                            return
                    async with http.get(self.http_url + self.failed_path, timeout=probe) as response:
                        if response.status == 500:
                            raise RuntimeError(f"{self.name} failed to start: {(await response.text())[:500]}; "
                                               f"log: {self.log_path}")
                await asyncio.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; log: {self.log_path}")

    def terminate(self) -> None:
        """SIGTERM to the server's process group (`stop_all` finishes the job)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to what is left of the server's process group; reap it; close its log."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()


def stop_all(servers: Sequence[Server], grace_s: float = 10.0) -> None:
    """SIGTERM to every server at once, then SIGKILL to each group after `grace_s` seconds at most."""
    for server in servers:
        server.terminate()
    deadline = time.monotonic() + grace_s
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(max(0.0, deadline - time.monotonic()))
        server.kill()


# -- clients (their own process) ------------------------------------------------------------------------

Arrivals = list[tuple[float, int]]
"""(arrival time, bytes) of each piece of one stream's pcm16 audio."""


def run_clients(mode: str, url: str, concurrency: int, fields: dict[str, Any], text: str,
                seed0: int) -> list[tuple[float, Arrivals, str | None]]:
    """C streams at once (seeds `seed0 + i`): per stream (time its request was complete, arrivals, error)."""
    runner = _ws_clients if mode == "ws" else _rest_clients
    return asyncio.run(runner(url, concurrency, fields, text, seed0))


def _source(index: int) -> str:
    return f"127.0.{1 + index // 250}.{1 + index % 250}"


async def _ws_clients(url: str, concurrency: int, fields: dict[str, Any], text: str,
                      seed0: int) -> list[tuple[float, Arrivals, str | None]]:
    import websockets

    ready = asyncio.Event()
    configured: list[int] = []

    async def one(index: int) -> tuple[float, Arrivals, str | None]:
        async with websockets.connect(url, max_size=None, compression=None, ping_interval=None,
                                      local_addr=(_source(index), 0), open_timeout=60) as ws:
            config = {"type": "session.config", **fields, "stream_audio": True, "seed": seed0 + index}
            await ws.send(json.dumps(config))
            await ws.send(json.dumps({"type": "input.text", "text": text}))
            configured.append(index)
            if len(configured) == concurrency:
                await asyncio.sleep(SETTLE_S)
                ready.set()
            await ready.wait()
            sent = time.perf_counter()
            await ws.send(json.dumps({"type": "input.done"}))
            arrivals: Arrivals = []
            while True:
                frame = await ws.recv()
                if isinstance(frame, bytes):
                    arrivals.append((time.perf_counter(), len(frame)))
                    continue
                message = json.loads(frame)
                if message["type"] == "error":
                    return sent, arrivals, str(message.get("message") or message)
                if message["type"] == "session.done":
                    return sent, arrivals, None

    return list(await asyncio.gather(*(one(i) for i in range(concurrency))))


async def _rest_clients(url: str, concurrency: int, fields: dict[str, Any], text: str,
                        seed0: int) -> list[tuple[float, Arrivals, str | None]]:
    async def one(index: int) -> tuple[float, Arrivals, str | None]:
        body = {"input": text, **fields, "stream_format": "audio", "seed": seed0 + index}
        connector = aiohttp.TCPConnector(local_addr=(_source(index), 0), force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:
            sent = time.perf_counter()
            async with http.post(url, json=body) as response:
                if response.status != 200:
                    return sent, [], f"HTTP {response.status}: {(await response.text())[:300]}"
                arrivals: Arrivals = []
                async for data in response.content.iter_any():
                    arrivals.append((time.perf_counter(), len(data)))
                return sent, arrivals, None

    return list(await asyncio.gather(*(one(i) for i in range(concurrency))))


def pcm_samples(arrivals: Arrivals) -> list[tuple[float, int]]:
    """pcm16 arrivals as (time, whole samples completed by that piece); pieces may split a sample."""
    out, total = [], 0
    for at, size in arrivals:
        before = total // 2
        total += size
        if total // 2 > before:
            out.append((at, total // 2 - before))
    return out


# -- measurement ----------------------------------------------------------------------------------------

def measure(got: list[tuple[float, Arrivals, str | None]], rate: int) -> dict[str, Any]:
    """One round's figures from its streams (`play`); a stream with an error or no audio counts as failed."""
    streams: list[Stream] = []
    errors = []
    timelines = []
    for sent, arrivals, error in got:
        samples = pcm_samples(arrivals)
        timelines.append(timeline(sent, samples, rate))
        if error is not None or not samples:
            errors.append(error or "no audio")
            continue
        streams.append(play(sent, samples, rate))
    first = min(sent for sent, _, _ in got)
    last = max((arrivals[-1][0] for _, arrivals, _ in got if arrivals), default=first)
    return {"ttfa_ms": [s.ttfa_ms for s in streams], "stall_s": [s.stall_s for s in streams],
            "stalls": [s.stalls for s in streams], "audio_s": [s.audio_s for s in streams],
            "stall_chunks": [list(s.stall_chunks) for s in streams], "rtf": [s.rtf for s in streams],
            "errors": errors,
            "audio_s_per_wall_s": sum(s.audio_s for s in streams) / max(last - first, 1e-9),
            "timelines": timelines}


def timeline(sent: float, samples: list[tuple[float, int]], rate: int) -> list[list[int]]:
    """One stream's arrivals as [ms since its request was complete, ms of audio it brought], whole ms: where
    its stalls fell and what each chunk held, for reading the JSON afterwards."""
    return [[round((at - sent) * 1000.0), round(n * 1000 / rate)] for at, n in samples]


FRAME_S: Final = 0.08
"""Audio per codec frame of Qwen3-TTS' 12 Hz tokenizer (1920 samples at 24 kHz)."""


def expected_audio_s(frames: int) -> float:
    """A stream's audio when its request makes `frames` frames: all but the last (vllm-omni's code2wav)."""
    return (frames - 1) * FRAME_S


def figures(rounds: list[dict[str, Any]], expected_s: float) -> dict[str, Any]:
    """Per-round summary values of one (mode, level, server). A stream whose audio is more than a frame off
    `expected_s` counts as short or long; throughput counts each stream's audio up to `expected_s`, so audio
    a pipeline sends twice (seen under load on both servers: `docs/benchmarks.md`) adds nothing."""
    def wall_s(r: dict[str, Any]) -> float:
        return sum(r["audio_s"]) / r["audio_s_per_wall_s"] if r["audio_s_per_wall_s"] else 0.0

    return {
        "ttfa_p50": [percentile(r["ttfa_ms"], 50) for r in rounds],
        "ttfa_p95": [percentile(r["ttfa_ms"], 95) for r in rounds],
        "stalled": [sum(1 for n in r["stalls"] if n) for r in rounds],
        "stall_s": [sum(r["stall_s"]) for r in rounds],
        "audio_s_per_wall_s": [sum(min(a, expected_s) for a in r["audio_s"]) / wall_s(r) if wall_s(r) else 0.0
                               for r in rounds],
        "short": [sum(1 for a in r["audio_s"] if a < expected_s - FRAME_S) for r in rounds],
        "long": [sum(1 for a in r["audio_s"] if a > expected_s + FRAME_S) for r in rounds],
        "audio_s": [percentile(r["audio_s"], 50) for r in rounds],
        "errors": [len(r["errors"]) for r in rounds],
        "stalls_at": stalls_at(rounds),
    }


STALL_PIECES: Final = 6
"""`stalls_at` counts stalls at each of a stream's first pieces up to this one, then the rest together."""


def stalls_at(rounds: list[dict[str, Any]]) -> str:
    """Where the stalls of every round fell, by piece of the stream ("#2: 5, #3: 1, later: 2"), or "-";
    rounds measured before the bench kept them count nothing."""
    counts: dict[str, int] = {}
    for r in rounds:
        for where in r.get("stall_chunks", []):
            for index in where:
                key = f"#{index + 1}" if index < STALL_PIECES else "later"
                counts[key] = counts.get(key, 0) + 1
    order = [f"#{i + 1}" for i in range(STALL_PIECES)] + ["later"]
    return ", ".join(f"{key}: {counts[key]}" for key in order if key in counts) or "-"


def report(results: dict[str, Any], servers: Sequence[str]) -> str:
    """The per-server table and, with both duel servers (CustomVoice), the ratio table."""
    lines = []
    rows, ratios = [], []
    for mode in MODES:
        for level in results["levels"]:
            conc = level["concurrency"]
            per = {name: figures(level["rounds"][mode][name], expected_audio_s(results["frames"]))
                   for name in servers if level["rounds"][mode].get(name)}
            for name, f in per.items():
                n = len(f["ttfa_p50"])
                rows.append([mode, conc, name, n, spread(f["ttfa_p50"]), spread(f["ttfa_p95"]),
                             " ".join(f"{s}/{conc}" for s in f["stalled"]),
                             " ".join(f"{s:.2f}" for s in f["stall_s"]), spread(f["audio_s_per_wall_s"], "{:.1f}"),
                             spread(f["audio_s"], "{:.2f}"),
                             " ".join(f"{a}/{b}" for a, b in zip(f["short"], f["long"], strict=True)),
                             sum(f["errors"]), f["stalls_at"]])
            if "voicewire" in per and "vllm-omni" in per:
                ours, theirs = per["voicewire"], per["vllm-omni"]
                ratios.append([mode, conc, *(_ratio(ours[key], theirs[key]) for key in
                                             ("ttfa_p50", "ttfa_p95", "stalled", "stall_s", "audio_s_per_wall_s"))])
    lines.append("per server: median [min-max] over rounds; stalls, stall seconds and streams of the wrong length "
                 "listed per round; audio s per wall s counts each stream up to its frames' audio")
    lines.append(table(["mode", "conc", "server", "rounds", "TTFA p50 ms", "TTFA p95 ms", "streams with a stall",
                        "total stall s", "audio s per wall s", "audio s per stream", "short/long streams",
                        "errors", "stalls at piece (all rounds)"], rows))
    if ratios:
        lines.append("")
        lines.append("voicewire / vllm-omni, ratio of the medians over rounds (below 1: voicewire lower)")
        lines.append(table(["mode", "conc", "TTFA p50", "TTFA p95", "streams with a stall", "total stall s",
                            "audio s per wall s"], ratios))
    return "\n".join(lines)


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' `omni_duel.json` as one (say one device call per server): each (level, mode, server)'s
    rounds joined, levels in order of concurrency. Raises ValueError for runs of different shapes or frames."""
    if len({(part["shape"], part["frames"]) for part in parts}) > 1:
        raise ValueError("the runs differ in --shape or --frames: " + ", ".join(
            f"{part['shape']} x {part['frames']}" for part in parts))
    by_conc: dict[int, dict[str, Any]] = {}
    servers: dict[str, Any] = {}
    for part in parts:
        servers.update(part["servers"])
        for level in part["levels"]:
            into = by_conc.setdefault(level["concurrency"],
                                      {"concurrency": level["concurrency"], "rounds": {m: {} for m in MODES}})
            for mode, per_server in level["rounds"].items():
                for name, rounds in per_server.items():
                    into["rounds"].setdefault(mode, {}).setdefault(name, []).extend(rounds)
    return {**parts[0], "levels": [by_conc[c] for c in sorted(by_conc)], "servers": servers}


def _ratio(ours: list[float], theirs: list[float]) -> str:
    a, b = statistics.median(ours), statistics.median(theirs)
    if b == 0:
        return "-" if a == 0 else "inf"
    return f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--shape", choices=("tiny", "1.7b"), default="tiny")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per level, mode and server")
    parser.add_argument("--single-rounds", type=int, default=5,
                        help="measured rounds at 1 session (single-session latency wants 5), never fewer than --rounds")
    parser.add_argument("--frames", type=int, default=150, help="codec frames per request (80 ms each), forced")
    parser.add_argument("--servers", default=",".join(SERVERS), help="which servers, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--task-types", default="CustomVoice",
                        help=f"Qwen3-TTS checkpoints, comma-separated, from {', '.join(TASK_TYPES)}: each a model "
                             "folder and a server of each of --servers (CustomVoice keeps the duel's server names)")
    parser.add_argument("--split-granularity", default="none")
    parser.add_argument("--deploy-config", type=Path, default=None,
                        help="base stage config (default: vllm-omni's own on a GPU, voicewire's CPU one on a CPU)")
    parser.add_argument("--gpu-share", type=float, default=None,
                        help="gpu_memory_utilization of every stage (both servers' four stages share one GPU)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="fixed KV cache per stage (skips vLLM's memory profiling, which concurrent starts upset)")
    parser.add_argument("--talker-step-tokens", type=int, default=None, metavar="N",
                        help="stage 0's max_num_batched_tokens (vllm-omni's high-concurrency profile: 512, so a "
                             "burst's prompts are prefilled a few a step between the running streams' steps)")
    parser.add_argument("--predictor-prefix-graphs", default="", metavar="BATCHES",
                        help="batch sizes, comma-separated, to capture the talker's code-predictor prefix CUDA "
                             "graphs for (vllm-omni's high-concurrency profile: 64)")
    parser.add_argument("--voicewire-args", default="", metavar="'FLAGS'",
                        help="more `voicewire serve` flags for voicewire, e.g. '--omni-pace-lead-ms 55,2.75'")
    parser.add_argument("--sequential", action="store_true", help="start and measure one server after the other")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no round once this many seconds have passed since the bench began")
    parser.add_argument("--out", type=Path, default=None, help="folder for omni_duel.json and the server logs")
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                        help="run nothing: print the report of saved omni_duel.json files, joined (one per server)")
    args = parser.parse_args(argv)
    if args.report is not None:
        parts = [json.loads(path.read_text()) for path in args.report]
        for part in parts:
            if "provenance" in part:
                print(Provenance(**part["provenance"]).line())
        joined = merge(parts)
        for name, server in joined["servers"].items():
            print(f"{name}: " + (f"ready in {server['ready_s']:.0f} s" if "ready_s" in server
                                 else f"did not start: {server.get('error')}"))
        print(report(joined, sorted(joined["servers"], key=lambda name: (name not in SERVERS, name))), flush=True)
        return 0
    provenance = Provenance.begin()
    began = time.perf_counter()
    segmenter = Segmenter("sentence")
    if len([*segmenter.push(TEXT, 0.0), *segmenter.flush()]) != 1:
        parser.error("TEXT must be one sentence unit for voicewire's REST route (see TEXT)")
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = [s for s in args.servers.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    if not set(servers) <= set(SERVERS) or not set(modes) <= set(MODES):
        parser.error(f"--servers from {', '.join(SERVERS)}, --modes from {', '.join(MODES)}")
    task_types = [t for t in args.task_types.split(",") if t]
    if not set(task_types) <= set(TASK_TYPES):
        parser.error(f"--task-types from {', '.join(TASK_TYPES)}")
    if len(servers) * len(task_types) > 1 and not args.sequential and _cuda():
        parser.error("on a GPU, vllm-omni sets up the stages of every process on the device one at a time, so the "
                     "second server is not ready before a device call's limit (docs/benchmarks.md): one server "
                     "and task type a call, or --sequential")
    root = Path(tempfile.mkdtemp(prefix="omni-duel-"))
    logs = args.out or root
    logs.mkdir(parents=True, exist_ok=True)
    models = {task: write_model(root / f"model-{task}", args.shape, task) for task in task_types}
    base = args.deploy_config or default_deploy_config()
    deploy = write_deploy_config(base, root / "deploy.yaml", max_num_seqs=max(levels),
                                 gpu_share=args.gpu_share, kv_cache_gib=args.kv_cache_gib,
                                 talker_step_tokens=args.talker_step_tokens,
                                 prefix_graph_batches=[int(b) for b in args.predictor_prefix_graphs.split(",") if b])
    rate = sample_rate(models[task_types[0]])
    fields = {"response_format": "pcm", "max_new_tokens": args.frames}
    results: dict[str, Any] = {"shape": args.shape, "frames": args.frames, "text_chars": len(TEXT), "rate": rate,
                               "deploy_base": str(base), "deploy": deploy.read_text(), "levels": [], "servers": {},
                               "provenance": provenance.as_dict()}
    print(f"model {args.shape}, {', '.join(task_types)} at {root}; stage config {base} -> {deploy}", flush=True)
    specs = {server_name(kind, task): (kind, task) for task in task_types for kind in servers}
    groups = [[name] for name in specs] if args.sequential else [list(specs)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: stop the servers, print what ran
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
            for group in groups:
                started = {name: Server(name, specs[name][0], models[specs[name][1]], deploy, logs, root, max(levels),
                                        {**fields, **task_fields(specs[name][1])},
                                        shlex.split(args.voicewire_args) if specs[name][0] == "voicewire" else ())
                           for name in group}
                try:
                    running = start(started, args.start_timeout, results)
                    duel(clients, running, levels, modes, args, rate, results, began)
                finally:
                    stop_all(list(started.values()))
    finally:
        ended = provenance.end()
        results["provenance"] = ended.as_dict()
        if args.out is not None:
            (args.out / "omni_duel.json").write_text(json.dumps(results, indent=1))
        print(ended.line())
        print(report(results, list(specs)), flush=True)
    return 1 if any("error" in server for server in results["servers"].values()) else 0  # one did not start


def start(started: dict[str, Server], timeout: float, results: dict[str, Any]) -> dict[str, Server]:
    """Wait for the servers started together; those that fail are reported and left out."""
    outcomes = asyncio.run(_all_ready(list(started.values()), timeout))
    running = {}
    for (name, server), outcome in zip(started.items(), outcomes, strict=True):
        if isinstance(outcome, BaseException):
            results["servers"][name] = {"error": str(outcome), "log": str(server.log_path)}
            print(f"{name} did not start: {outcome}", flush=True)
            continue
        results["servers"][name] = {"ready_s": server.ready_s, "log": str(server.log_path)}
        print(f"{name} ready in {server.ready_s:.0f} s", flush=True)
        running[name] = server
    return running


def duel(clients: ProcessPoolExecutor, running: dict[str, Server], levels: list[int], modes: list[str],
         args: argparse.Namespace, rate: int, results: dict[str, Any], began: float) -> None:
    """Round 1 at every level, then round 2 at every level, and so on, so a budget cut leaves every level
    measured; the 1-session level's extra rounds (`--single-rounds`) come last, after every level's
    `--rounds`. A level's first visit starts with its warm-up. Within a round: each mode, the servers in turn."""
    by_conc = {level["concurrency"]: level for level in results["levels"]}

    def wire(server: Server, mode: str) -> dict[str, Any]:
        return {**server.fields, "split_granularity": args.split_granularity} if mode == "ws" else server.fields

    most = max(args.rounds, args.single_rounds)
    for round_ in range(most):
        for number, conc in enumerate(levels):
            if round_ >= (most if conc == 1 else args.rounds):
                continue
            if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
                print(f"budget spent: stopped before round {round_ + 1} at concurrency {conc}", flush=True)
                return
            level = by_conc.setdefault(conc, {"concurrency": conc, "rounds": {m: {} for m in MODES}})
            if level not in results["levels"]:
                results["levels"].append(level)
            if round_ == 0:
                for mode in modes if number == 0 else modes[:1]:
                    for server in running.values():
                        clients.submit(run_clients, mode, server.url(mode), conc, wire(server, mode), TEXT, 0).result()
            seed0 = 1000 * (most * number + round_ + 1)
            for mode in modes:
                for name, server in running.items():
                    before = codec_figures(server)
                    got = clients.submit(run_clients, mode, server.url(mode), conc, wire(server, mode), TEXT,
                                         seed0).result()
                    measured = measure(got, rate)
                    measured["codec"] = codec_moved(before, codec_figures(server))
                    level["rounds"][mode].setdefault(name, []).append(measured)
                    errors, ttfa = measured["errors"], percentile(measured["ttfa_ms"], 50)
                    print(f"{mode} c={conc} r{round_ + 1} {name}: TTFA p50 {ttfa:.0f} ms, "
                          f"{sum(1 for n in measured['stalls'] if n)}/{conc} stalled "
                          f"({sum(measured['stall_s']):.2f} s), {measured['audio_s_per_wall_s']:.1f} audio s/s, "
                          f"errors {len(errors)}{': ' + errors[0] if errors else ''}{codec_line(measured['codec'])}",
                          flush=True)
                    if args.out is not None:
                        (args.out / "omni_duel.json").write_text(json.dumps(results, indent=1))


CODEC_COUNTERS: Final = ("batches", "windows", "frames", "decode_seconds", "late_windows",
                         "late_in_codec_windows", "fallbacks",
                         "first_chunks", "first_frames_seconds", "first_decode_seconds", "gc_pause_seconds",
                         "gc_full_collections")


def codec_figures(server: Server) -> dict[str, float] | None:
    """voicewire's own codec figures now, from its `/metrics` (`voicewire_codec_*`, less the prefix and
    `_total`), with the server's garbage collector's pauses (`gc_pause_seconds`, every generation, and
    `gc_full_collections`: every session's audio waits for them), or None where there are no codec figures
    (vllm-omni's server; voicewire decoding in vllm-omni's code2wav)."""
    if server.kind != "voicewire":
        return None
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    figures = {sample.name.removeprefix("voicewire_codec_").removesuffix("_total"): sample.value
               for sample in samples if sample.name.startswith("voicewire_codec_")}
    if not figures:
        return None
    figures["gc_pause_seconds"] = sum(s.value for s in samples if s.name == "voicewire_gc_pause_seconds_sum")
    figures["gc_full_collections"] = sum(s.value for s in samples if s.name == "voicewire_gc_pause_seconds_count"
                                         and s.labels.get("generation") == "2")
    return figures


def codec_moved(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """The codec's work during a round (`CODEC_COUNTERS` moved), with its CUDA graphs and slowest call so far."""
    if before is None or after is None:
        return None
    moved = {name: after[name] - before[name] for name in CODEC_COUNTERS}
    return {**moved, "cuda_graphs": after["cuda_graphs"], "max_decode_seconds": after["max_decode_seconds"]}


def codec_line(codec: dict[str, float] | None) -> str:
    """The per-round line's codec part: decode calls, windows and ms per call, late windows, CUDA graphs, and
    where the units' time to their first chunk went (means: the talker's side, the codec's)."""
    if not codec:
        return ""
    calls, units = max(codec["batches"], 1), max(codec["first_chunks"], 1)
    return (f"; codec {codec['batches']:.0f} calls, {codec['windows'] / calls:.1f} windows and "
            f"{1000 * codec['decode_seconds'] / calls:.1f} ms a call, {codec['late_windows']:.0f} late "
            f"({codec['late_in_codec_windows']:.0f} of them queued in time), "
            f"{codec['cuda_graphs']:.0f} CUDA graphs; first chunk, mean of {codec['first_chunks']:.0f} units: "
            f"engine call -> frames {1000 * codec['first_frames_seconds'] / units:.0f} ms, "
            f"frames -> audio {1000 * codec['first_decode_seconds'] / units:.0f} ms; server gc "
            f"{1000 * codec['gc_pause_seconds']:.0f} ms ({codec['gc_full_collections']:.0f} full)")


async def _all_ready(servers: list[Server], timeout: float) -> list[BaseException | None]:
    return await asyncio.gather(*(server.wait_ready(timeout) for server in servers), return_exceptions=True)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if __name__ == "__main__":
    sys.exit(main())
