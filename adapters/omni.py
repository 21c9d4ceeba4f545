"""The `omni` engine: vllm-omni's own multi-stage pipeline (`AsyncOmni`), driven in-process.

`voicewire serve --engine omni --model DIR [--stage-config YAML]`. vllm-omni does the model work (its stage
processes, connectors, prompt builders); this module turns one synthesis unit into one vllm-omni request
and streams its audio. Everything taken from vllm-omni goes through `omni_compat` (pinned version).

Family: Qwen3-TTS (`model_type: qwen3_tts`, 12 Hz tokenizer), on vllm-omni 0.26.0 and 0.30.0. Other
families are served through vllm-omni's own speech adapters by `omni_families.py` (`omni_engine` picks the
engine for a model folder; docs/engines.md has the table).

Facts come from the model folder, never from a list here: the checkpoint's task (`tts_model_type`:
CustomVoice, VoiceDesign or Base), its speakers (`talker_config.spk_id`, in config order, the first is the
default), languages (`talker_config.codec_language_id`), sample rate (`speech_tokenizer/config.json`,
`output_sample_rate`) and codec frame rate (for the length of reference codes).

One request per unit: the parameters vllm-omni's Qwen3-TTS talker reads (`additional_information`: text,
task type, language, speaker, instruction, reference audio and text, x-vector mode, length limits), and a
placeholder prompt whose length vllm-omni's prompt builder computes. Usage as vllm-omni's server counts
it (`AudioPiece.tokens`): the unit's first piece reports its text and instructions in the model's text
tokenizer and the reference-audio codec tokens in the prompt (vllm-omni's own usage code:
`ref_code_length` for in-context cloning, 0 otherwise); each piece the codec frames it holds (its samples
at the codec's frame rate: the frames the talker generated). Closing the unit's iterator (cancel,
disconnect, timeout) closes vllm-omni's stream, which aborts the request in every stage.

Chunks: vllm-omni's talker hands its codec frames to the code2wav stage in chunks. As shipped, a unit's
first chunk is one frame (80 ms) and every later chunk `codec_chunk_frames` (25), so a player that starts
at the first byte runs dry after 80 ms, on every stream. The engine paces them instead (`omni_pacing`,
docs/engines.md "omni: paced chunks"): each stream's chunks are cut by its own measured pace and the
pipeline's load, as late as lets each arrive before the audio before it has played, so they stay as large
as they can (few code2wav decodes) and the first one is vllm-omni's single frame at low load. The deploy
YAML the engine starts with names the pacing processor for the talker stage; the engine reports each
unit's deliveries back to it (`omni_pacing.DeliveryBoard`: the audio delivered and when a player that
started at the first piece runs dry), so the pacer follows the measured pipeline, not only its model. A
fixed ramp (`codec_chunk_ramp`, vllm-omni's own connector option) or the shipped chunking can be chosen
instead.

A stage that dies (its process killed or crashed): vllm-omni fails the requests routed through it, and
its health check reports the stage dead from then on. The units in flight end with `EngineWorkerLost`
(error code `generation_failed`), later units fail at once with the same, and `failure()` reports it,
so the server answers `/ready` 503 (a balancer routes away) and `/health` 500 (an orchestrator restarts
it). vllm-omni cannot restart one stage of a running pipeline, so the engine is not restarted in-process.

Random-weight mode (`random_weights`, tests and benchmarks): every stage loads with `load_format: dummy`,
and since random weights never stop, each unit's length is forced (`frames_per_char`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, cast

import numpy as np
from voicewire.adapters import omni_compat
from voicewire.adapters.batch_encode import BatchEncoder
from voicewire.adapters.omni_codec import QWEN3_LAYOUT, QWEN3_POLICY, Qwen3Codec
from voicewire.adapters.omni_frames import EXTRA_KEY as FRAMES_EXTRA_KEY
from voicewire.adapters.omni_frames import FRAMES_KEY, REFERENCE_INDEX, FrameRouter
from voicewire.adapters.omni_frames import PROCESSOR as FRAMES_PROCESSOR
from voicewire.adapters.omni_pacing import BOARD_KEY, LEAD_PER_STREAM_S, LEAD_S, DeliveryBoard
from voicewire.adapters.omni_pacing import EXTRA_KEY as PACING_KEY
from voicewire.adapters.omni_pacing import PROCESSOR as PACING_PROCESSOR
from voicewire.adapters.omni_pacing import STREAMS_KEY as PACING_STREAMS_KEY
from voicewire.adapters.registry import QWEN3_TTS
from voicewire.adapters.talker_codec import ChunkStreamer, CodecBatcher, DecodeWindow, FirstChunkSizer
from voicewire.protocol.engine import (
    NO_TOKENS,
    AudioPiece,
    EngineCapabilities,
    EngineInfo,
    EngineWorkerLost,
    SynthesisRequest,
    TokenCounts,
    VoiceSample,
)

log = logging.getLogger("voicewire.omni")

CONFIG_DIR: Final = Path(__file__).resolve().parent / "omni_configs"
CPU_STAGE_CONFIGS: Final = {"qwen3_tts": CONFIG_DIR / "qwen3_tts_cpu.yaml"}
"""The stage configs this project ships for vLLM's CPU build, per model type (`--stage-config`)."""

TASK_TYPES: Final = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}
"""Qwen3-TTS `tts_model_type` -> the task vllm-omni runs for it (one per checkpoint)."""

DEFAULT_VOICE: Final = "default"
"""The voice name of checkpoints without predefined speakers (VoiceDesign, Base)."""

WARMUP_TEXT: Final = "Warm up."

DEFAULT_PACING: Final = (LEAD_S, LEAD_PER_STREAM_S)
"""Paced chunks (`omni_pacing`) with the default lead: seconds, plus seconds per stream."""


@dataclass(frozen=True, slots=True)
class OmniConfig:
    """What the omni engine needs; `voicewire serve --engine omni` fills it from flags.

    `stage_config`: a vllm-omni deploy YAML; None uses vllm-omni's own for the model type.
    `max_concurrency`: units computed at once (keep it at or below the talker stage's `max_num_seqs`).
    `max_new_tokens`: the default cap on codec frames per unit (vllm-omni's speech server uses 2048).
    `pacing`: paced chunks (`omni_pacing`, Qwen3-TTS), as (lead seconds, lead seconds per stream); None:
    not paced. `codec_chunk_ramp`: instead, a fixed ramp, frames in each of a unit's first chunks (then the
    stage config's `codec_chunk_frames`; entries above it are capped to it). Neither keeps the stage
    config's chunking as it is (a first chunk of `initial_codec_chunk_frames`, then `codec_chunk_frames`).
    """

    model: str
    stage_config: str | None = None
    max_concurrency: int = 4
    max_new_tokens: int = 2048
    random_weights: bool = False
    frames_per_char: float = 0.25
    """Random-weight mode: forced length, frames (80 ms each) per character."""
    init_timeout_s: float = 600.0
    pacing: tuple[float, float] | None = DEFAULT_PACING
    codec_chunk_ramp: tuple[int, ...] = ()
    served_model_names: tuple[str, ...] = ()
    """More ids clients may name the model by (vllm's `--served-model-name`); see `model_ids`."""
    own_codec: bool = False
    """Decode the talker's frames in voicewire's own batched codec path (`omni_frames`, `omni_codec`) instead
    of vllm-omni's code2wav stage; chunks then follow the talker engine's paced schedule (`QWEN3_POLICY`)."""
    codec_margin_s: float | None = None
    """With `own_codec`: the paced schedule's least margin (`ChunkPolicy.margin_s`), how long before a listener
    runs dry its next chunk is cut; None: `QWEN3_POLICY`'s."""

    def __post_init__(self) -> None:
        if self.codec_chunk_ramp and (len(self.codec_chunk_ramp) < 2 or min(self.codec_chunk_ramp) < 1):
            raise ValueError(f"omni: codec_chunk_ramp {list(self.codec_chunk_ramp)} needs at least 2 entries, "
                             "each at least 1 frame (or none: no ramp)")
        if self.codec_chunk_ramp and self.pacing is not None:
            raise ValueError("omni: chunks are either paced or cut by a fixed ramp (codec_chunk_ramp), not both")
        if self.own_codec and (self.pacing is not None or self.codec_chunk_ramp):
            raise ValueError("omni: with voicewire's own codec, chunks are cut by its schedule: no pacing or ramp")
        if self.pacing is not None and min(self.pacing) < 0:
            raise ValueError(f"omni: the pacing lead {self.pacing} cannot be negative")
        if self.codec_margin_s is not None and (self.codec_margin_s < 0 or not self.own_codec):
            raise ValueError(f"omni: a codec margin ({self.codec_margin_s} s) is for voicewire's own codec, and "
                             "cannot be negative")


class CachedReferences:
    """The cloning references whose artifacts (codec codes, speaker embedding) vllm-omni's talker holds, as
    (artifact key, x-vector-only) pairs: an LRU of at most `size`, marked when a request that sent the
    reference has finished, touched whenever one is used. A request whose reference is here sends only the
    key, not the samples (`omni_compat`: the talker's artifact cache), as vllm-omni's own server does: a
    clone then costs neither the samples' serialization nor the talker's re-encoding of them. `size` must
    stay below the talker's own LRU (`references_kept`), so an entry here is always still cached there."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[str, bool], None] = OrderedDict()

    def cached(self, entry: tuple[str, bool]) -> bool:
        """Whether the talker holds `entry`'s artifacts (and count this as a use)."""
        if entry not in self._entries:
            return False
        self._entries.move_to_end(entry)
        return True

    def add(self, entry: tuple[str, bool]) -> None:
        """Mark `entry` cached (its request, which sent the reference, has finished)."""
        if self.size <= 0:
            return
        self._entries[entry] = None
        self._entries.move_to_end(entry)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


def references_kept(deploy: Mapping[str, Any]) -> int:
    """How many references the engine treats as cached by the talker (`CachedReferences`): half the talker's
    artifact LRU (its connector option `ref_audio_artifact_cache_max_entries`, 1024 unless a connector of
    `deploy` sets it), at most `omni_compat.QWEN3_TTS_REFERENCES_KEPT`; 0 (always send the samples) when the
    talker keeps none."""
    sizes = [int(extra["ref_audio_artifact_cache_max_entries"])
             for connector in (deploy.get("connectors") or {}).values() if isinstance(connector, Mapping)
             for extra in [connector.get("extra", connector)]
             if isinstance(extra, Mapping) and "ref_audio_artifact_cache_max_entries" in extra]
    return min(omni_compat.QWEN3_TTS_REFERENCES_KEPT, min(sizes, default=1024) // 2)


@dataclass(frozen=True, slots=True)
class Qwen3TTSModel:
    """The facts of a Qwen3-TTS folder that the engine uses (see the module doc)."""

    task_type: str
    speakers: tuple[str, ...]
    languages: tuple[str, ...]
    sample_rate: int
    frame_rate: float
    codec_language_id: dict[str, int]
    spk_is_dialect: dict[str, object]

    @classmethod
    def read(cls, folder: Path) -> Qwen3TTSModel:
        config = _read_json(folder / "config.json")
        kind = str(config.get("tts_model_type", ""))
        if kind not in TASK_TYPES:
            raise ValueError(f"omni: {folder}/config.json has tts_model_type {kind!r}; Qwen3-TTS checkpoints are "
                             f"one of {', '.join(TASK_TYPES)}")
        talker = cast(dict[str, Any], config.get("talker_config") or {})
        codec = _read_json(folder / "speech_tokenizer" / "config.json")
        rate = int(codec.get("output_sample_rate") or 0)
        frame_rate = float(cast(dict[str, Any], codec.get("encoder_config") or {}).get("frame_rate") or 0)
        if rate <= 0 or frame_rate <= 0:
            raise ValueError(f"omni: {folder}/speech_tokenizer/config.json gives no output_sample_rate or frame_rate")
        speakers = tuple(cast(dict[str, int], talker.get("spk_id") or {})) if kind == "custom_voice" else ()
        languages = cast(dict[str, int], talker.get("codec_language_id") or {})
        return cls(task_type=TASK_TYPES[kind], speakers=speakers, languages=("auto", *languages), sample_rate=rate,
                   frame_rate=frame_rate, codec_language_id=dict(languages),
                   spk_is_dialect=dict(cast(dict[str, object], talker.get("spk_is_dialect") or {})))


def model_type(folder: Path) -> str:
    """The folder's `model_type` (config.json), or raise `FileNotFoundError`/`ValueError`."""
    config = _read_json(folder / "config.json")
    return str(config.get("model_type", ""))


_HUB_SNAPSHOT: Final = re.compile(r"/models--([^/]+?)--([^/]+)/snapshots/[^/]+$")
_HF_NAME: Final = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def model_ids(config: OmniConfig) -> tuple[str, ...]:
    """The ids the model is known by (`EngineInfo.model_ids`), as vllm-omni's server names it: its
    `/v1/models` lists the `--served-model-name`s, or else the `--model` string as given, and its speech
    routes accept those as `model`. Here: the served names, the model folder as given (always accepted), then
    the HF-style `org/name` when the folder tells it: a Hugging Face hub cache snapshot
    (`.../models--org--name/snapshots/REV`, where `hf download` puts a model) or config.json's
    `_name_or_path` of that form (which a model saved by transformers may carry)."""
    ids = [*config.served_model_names, config.model]
    hub = _HUB_SNAPSHOT.search(os.path.abspath(config.model).replace(os.sep, "/"))
    if hub is not None:
        ids.append(f"{hub[1]}/{hub[2]}")
    saved_as = _read_json(Path(config.model) / "config.json").get("_name_or_path")
    if isinstance(saved_as, str) and _HF_NAME.fullmatch(saved_as):
        ids.append(saved_as)
    return tuple(dict.fromkeys(ids))


class OmniEngine:
    """vllm-omni's pipeline behind the voicewire `Engine` interface (see the module doc)."""

    def __init__(self, config: OmniConfig) -> None:
        self.config = config
        folder = Path(config.model)
        kind = model_type(folder)
        if kind != "qwen3_tts":
            raise ValueError(f"omni: model type {kind!r} is not supported yet (supported: qwen3_tts; "
                             "docs/engines.md lists each family and what blocks it)")
        if config.stage_config is not None and not Path(config.stage_config).is_file():
            raise FileNotFoundError(f"omni: stage config {config.stage_config} does not exist")
        self.model = Qwen3TTSModel.read(folder)
        m = self.model
        voices = m.speakers or (DEFAULT_VOICE,)
        declared = QWEN3_TTS[m.task_type]
        fields = set(declared.fields)
        values = dict(declared.values)
        if config.codec_chunk_ramp:  # vllm-omni's ramp decides the first chunk: a request can only match it
            # (paced chunks honour any first chunk a request asks for, up to codec_chunk_frames)
            fields.discard("initial_codec_chunk_frames")
            values["initial_codec_chunk_frames"] = (config.codec_chunk_ramp[0],)
        self._info = EngineInfo(
            name="omni", sample_rate=m.sample_rate, voices=voices, default_voice=voices[0], languages=m.languages,
            capabilities=EngineCapabilities(
                word_timings=False, voice_cloning=m.task_type == "Base", speed_range=(1.0, 1.0), streaming="frame",
                fields=frozenset(fields), values=values, counts_tokens=True),
            max_concurrency=config.max_concurrency, model_ids=model_ids(config))
        self._omni: Any = None
        self._tokenizer: Any = None
        self._encoder: BatchEncoder | None = None
        self._deploy_file: str | None = None
        self._references = CachedReferences(0)
        self._board: DeliveryBoard | None = None
        self._router: FrameRouter | None = None
        self._batcher: CodecBatcher | None = None
        self._chunks = (QWEN3_POLICY if config.codec_margin_s is None
                        else replace(QWEN3_POLICY, margin_s=config.codec_margin_s))
        self._first_chunks = self._first_chunk_sizer()

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def codec_batcher(self) -> CodecBatcher | None:
        """voicewire's own codec batcher (`talker_codec.CodecEngine`) while one runs (`own_codec`), else None."""
        return self._batcher

    @property
    def task_type(self) -> str:
        """The one task this checkpoint runs: `CustomVoice`, `VoiceDesign` or `Base`."""
        return self.model.task_type

    def failure(self) -> str | None:
        """Why the engine cannot serve any more (`FailureReporting`, `pipeline_down`)."""
        return pipeline_down(self._omni)

    def requests_in_flight(self) -> int:
        """Requests vllm-omni still tracks (for tests: 0 after every unit ended or was cancelled)."""
        return 0 if self._omni is None else omni_compat.requests_in_flight(self._omni)

    async def start(self) -> None:
        """Check the vllm-omni version, start its pipeline (one process per stage) and, with the own codec,
        load the decoder and capture its CUDA graphs (beside the pipeline's start when `kv_cache_pinned`,
        before it otherwise), then run one short unit. On failure everything started is closed again."""
        if self._omni is not None:
            return
        omni_compat.check_version()
        from transformers import AutoTokenizer

        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # one host: no address discovery
        self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        backend = getattr(self._tokenizer, "backend_tokenizer", None)  # a fast tokenizer's `tokenizers` one
        self._encoder = None if backend is None else BatchEncoder(backend)
        if self.config.pacing is not None:  # one slot per unit in flight, with room for aborted ones ending
            self._board = DeliveryBoard.create(2 * self.config.max_concurrency + 16)
        if self.config.own_codec:
            self._router = await FrameRouter.open()
        self._deploy_file = self._deploy_config()
        deploy = omni_compat.resolved_deploy_config(
            self._deploy_file or omni_compat.default_deploy_config("qwen3_tts"))
        self._references = CachedReferences(references_kept(deploy))
        if self.config.pacing is not None or self.config.own_codec:
            omni_compat.register_paced_pipeline(FRAMES_PROCESSOR if self.config.own_codec else PACING_PROCESSOR)
        codec: asyncio.Future[None] | None = None
        try:
            if self.config.own_codec:
                codec = asyncio.ensure_future(self._start_codec(self.config.random_weights or dummy_weights(deploy)))
                if not kv_cache_pinned(deploy):
                    await codec  # a stage's memory profiling must not see this process allocate and free meanwhile
            self._omni = await asyncio.to_thread(omni_compat.create_async_omni, self.config.model,
                                                 self._deploy_file, init_timeout_s=self.config.init_timeout_s)
            if codec is not None:
                await codec
            await self._warm_up()
        except BaseException:
            if codec is not None:
                await asyncio.gather(codec, return_exceptions=True)
            await self.close()
            raise
        self._first_chunks = self._first_chunk_sizer()  # the warm-up's first decodes are no measure of load

    async def close(self) -> None:
        omni, self._omni = self._omni, None
        deploy, self._deploy_file = self._deploy_file, None
        board, self._board = self._board, None
        router, self._router = self._router, None
        batcher, self._batcher = self._batcher, None
        encoder, self._encoder = self._encoder, None
        await shut_down(omni, deploy, self.config.stage_config)
        if encoder is not None:
            encoder.close()
        if board is not None:
            board.close()
        if batcher is not None:
            await batcher.close()
        if router is not None:
            router.close()

    def _first_chunk_sizer(self) -> FirstChunkSizer:
        """With the own codec: a unit's first chunk frames by the load (`FirstChunkSizer`), at most a held
        first chunk's."""
        return FirstChunkSizer(QWEN3_LAYOUT.frame_s, cap=self._chunks.held_first_frames)

    async def _start_codec(self, random_weights: bool) -> None:
        """Voicewire's own codec path: the decoder (loaded on the codec thread, with its CUDA graphs on a GPU;
        seeded random weights when the pipeline's stages load none) and its batcher."""
        codec = Qwen3Codec(self.config.model, random_weights=random_weights)
        batcher = self._batcher = CodecBatcher(codec, max_batch=self.config.max_concurrency,
                                               max_batch_frames=CODEC_MAX_BATCH_FRAMES)
        batcher.start()
        await batcher.on_codec_thread(codec.load)
        await batcher.on_codec_thread(codec.prepare, CODEC_GRAPH_LENGTHS, self.config.max_concurrency,
                                      CODEC_MAX_BATCH_FRAMES)

    def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        return lost_with_pipeline(self.failure, self._synthesize(request))

    # -- request -------------------------------------------------------------------------------------

    def parameters(self, request: SynthesisRequest) -> dict[str, list[Any]]:
        """The unit's `additional_information` for vllm-omni's Qwen3-TTS talker (each value in a one-item
        list, as vllm-omni batches them). Raises ValueError for a request this checkpoint cannot run."""
        m = self.model
        task = request.task_type or m.task_type
        if task != m.task_type:
            raise ValueError(f"omni: this Qwen3-TTS checkpoint runs task_type {m.task_type!r}, not {task!r}")
        language = (request.language or "auto").lower()
        if language not in m.languages:
            raise ValueError(f"omni: language {request.language!r} is not one of {', '.join(m.languages)}")
        params: dict[str, list[Any]] = {
            "text": [request.text], "task_type": [task], "language": [language.title()],
            "instruct": [request.instructions or ""],
            "max_new_tokens": [request.max_new_tokens or self.config.max_new_tokens],
        }
        if request.initial_codec_chunk_frames is not None and not self.config.codec_chunk_ramp:
            params["initial_codec_chunk_frames"] = [request.initial_codec_chunk_frames]
        if request.non_streaming_mode is not None:
            params["non_streaming_mode"] = [request.non_streaming_mode]
        if task == "CustomVoice":
            speaker = request.voice.lower()
            if speaker not in m.speakers:
                raise ValueError(f"omni: unknown speaker {request.voice!r}; available: {', '.join(m.speakers)}")
            params["speaker"] = [speaker]
        elif task == "VoiceDesign":
            if not request.instructions:
                raise ValueError("omni: VoiceDesign needs instructions describing the voice")
            params.setdefault("non_streaming_mode", [True])  # vllm-omni's speech server does the same
        else:
            self._clone_parameters(request, params)
        return params

    def _clone_parameters(self, request: SynthesisRequest, params: dict[str, list[Any]]) -> None:
        embedding = request.speaker_embedding
        x_vector_only = bool(request.x_vector_only_mode or embedding)
        ref_text = request.ref_text
        if embedding:
            params["voice_clone_prompt"] = [{"ref_spk_embedding": [float(v) for v in embedding]}]
        else:
            reference = request.reference
            if reference is None:
                raise ValueError("omni: Base (cloning) needs ref_audio, an uploaded voice or speaker_embedding")
            audio, rate = reference.samples(), reference.sample_rate
            key = omni_compat.qwen3_tts_ref_audio_key(audio, rate)
            params[omni_compat.QWEN3_TTS_REF_AUDIO_KEY] = [key]
            if not self._references.cached((key, x_vector_only)):
                params["ref_audio"] = [[audio.tolist(), rate]]
            params["ref_code_length"] = [math.ceil(len(audio) / rate * self.model.frame_rate)]
        if not x_vector_only and not (ref_text and ref_text.strip()):
            raise ValueError("omni: Base cloning needs ref_text (the reference's transcript) unless "
                             "x_vector_only_mode is true")
        params["x_vector_only_mode"] = [x_vector_only]
        if ref_text and not x_vector_only:
            params["ref_text"] = [ref_text]

    async def _prompt(self, request: SynthesisRequest, params: Mapping[str, list[Any]]) -> tuple[dict[str, Any], int]:
        """The unit's placeholder prompt (its length from vllm-omni's prompt builder) and its text tokens as
        vllm-omni's usage counts them (its text and instructions). The texts either needs are tokenized off the loop in
        batches (`BatchEncoder`, with the fast tokenizer's own `tokenizers` backend: the same ids): a first
        pass of the builder only records which texts it asks for."""
        asked: list[str] = []

        def record(text: str) -> list[int]:
            asked.append(text)
            return [0] * 8  # the builder's least assistant prompt; only lengths are read

        self._prompt_len(params, record)
        spoken = [text for text in (request.text, request.instructions) if text and text.strip()]
        known = await self._encode([*asked, *spoken])
        length = self._prompt_len(params, lambda text: known[text] if text in known else self._tokenize(text))
        return omni_compat.token_prompt(length, params), sum(len(known[text]) for text in spoken)

    def _prompt_len(self, params: Mapping[str, list[Any]], tokenize: Callable[[str], list[int]]) -> int:
        m = self.model

        def ref_code_len(_reference: object) -> int | None:
            lengths = params.get("ref_code_length")
            return int(lengths[0]) if lengths else None

        return omni_compat.qwen3_tts_prompt_len(
            params, task_type=params["task_type"][0], tokenize=tokenize, codec_language_id=m.codec_language_id,
            spk_is_dialect=m.spk_is_dialect, ref_code_len=ref_code_len)

    def _tokenize(self, text: str) -> list[int]:
        """`text`'s ids in the model's text tokenizer, on the calling thread."""
        return list(self._tokenizer(text, padding=False)["input_ids"])

    async def _encode(self, texts: list[str]) -> dict[str, list[int]]:
        """Each of `texts` by its ids in the model's text tokenizer: in batches off the loop with a fast
        tokenizer, else on the calling thread."""
        unique = list(dict.fromkeys(texts))
        encoder = self._encoder
        if encoder is None:
            return {text: self._tokenize(text) for text in unique}
        return dict(zip(unique, await asyncio.gather(*(encoder.encode(text) for text in unique)), strict=True))

    def _sampling_params(self, request: SynthesisRequest, params: Mapping[str, list[Any]]) -> list[Any]:
        sampling = omni_compat.streaming_sampling_params(self._omni, shallow=True)  # sets scalars only
        talker = sampling[0]
        frames = int(params["max_new_tokens"][0])
        if self.config.random_weights:
            frames = min(frames, max(2, round(len(request.text) * self.config.frames_per_char)))
            talker.min_tokens = frames
        talker.max_tokens = frames
        if request.seed is not None:
            talker.seed = request.seed
        return sampling

    async def _synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        omni = self._omni
        if omni is None:
            raise RuntimeError("omni: engine is not started (call start() first)")
        if request.speed != 1.0:
            raise ValueError(f"omni: speed {request.speed} is outside the native range 1.0..1.0")
        called = time.perf_counter()
        params = self.parameters(request)
        prompt, text_tokens = await self._prompt(request, params)
        if self._router is not None and self._batcher is not None:
            async for piece in self._synthesize_own(request, params, prompt, text_tokens, called, self._router,
                                                    self._batcher):
                yield piece
            return
        if self.config.pacing is not None:  # the load the pacer plans this unit's first chunk for
            prompt["additional_information"][PACING_STREAMS_KEY] = [omni_compat.requests_in_flight(omni) + 1]
        board, ticket = self._board, None
        if board is not None:
            ticket = board.claim()
        if ticket is not None:  # where the pacer reads this unit's deliveries
            prompt["additional_information"][BOARD_KEY] = [ticket]
        sampling = self._sampling_params(request, params)
        rate, frame_rate = self.model.sample_rate, self.model.frame_rate
        first = TokenCounts(text_tokens, omni_compat.qwen3_tts_reference_tokens(params))
        samples_so_far = frames_so_far = 0
        dry_at = 0.0  # when a player that started at the first piece runs dry
        try:
            async with contextlib.aclosing(audio_chunks(omni, prompt, request.request_id, sampling)) as chunks:
                async for output, samples in chunks:
                    # frames generated: the final output's count, else those decoded so far (the codec may
                    # hold back the last frame's audio; vllm-omni counts what the talker generated)
                    samples_so_far += len(samples)
                    if board is not None and ticket is not None and len(samples):
                        now = time.monotonic()
                        dry_at = max(dry_at, now) + len(samples) / rate
                        board.report(ticket, samples_so_far / rate, now, dry_at)
                    generated = omni_compat.generated_tokens(output)
                    frames = round(samples_so_far * frame_rate / rate) if generated is None else generated
                    if len(samples) or frames > frames_so_far:
                        yield AudioPiece(samples, rate, tokens=TokenCounts(
                            first.text, first.audio, max(0, frames - frames_so_far)))
                        frames_so_far, first = max(frames, frames_so_far), NO_TOKENS
        finally:
            if board is not None and ticket is not None and board is self._board:  # not closed meanwhile
                board.release(ticket)
        key = params.get(omni_compat.QWEN3_TTS_REF_AUDIO_KEY)
        if key and "ref_audio" in params:  # finished: the talker now holds this reference's artifacts
            self._references.add((key[0], bool(params["x_vector_only_mode"][0])))

    async def _synthesize_own(self, request: SynthesisRequest, params: dict[str, list[Any]],
                              prompt: dict[str, Any], text_tokens: int, called: float, router: FrameRouter,
                              batcher: CodecBatcher) -> AsyncGenerator[AudioPiece, None]:
        """One unit with voicewire's own codec: vllm-omni's talker sends each frame over the frame channel
        (`omni_frames`); the frames are cut into chunks by the paced schedule and decoded in the batcher, most
        urgent first, each chunk due when the audio before it has played (as the talker engine does). While
        another unit has no frame read yet (its prompt waits for the talker's prefill, which lengthens the
        next step for every request, or its frame of the same step is not read yet), the unit's first chunk
        waits, up to `QWEN3_POLICY.held_first_frames` frames, and takes every frame in hand, so that a unit
        started early in a burst does not run dry while the talker prefills the rest; the units of one burst
        then mostly start with two frames or more, a step or more later. A unit not held starts with as many
        frames as the load needs for its second chunk to follow in time (`FirstChunkSizer`: one frame unless
        the talker's steps and the codec's latency have grown past a frame's audio). The pipeline's own audio
        (one frame, decoded at the request's end) is dropped."""
        ticket, arrivals = router.claim()
        prompt["additional_information"][FRAMES_KEY] = [ticket]
        sampling = self._sampling_params(request, params)
        rate = self.model.sample_rate
        chunks = self._chunks
        sizer = self._first_chunks
        initial = request.initial_codec_chunk_frames or sizer.first_chunk_frames(chunks.initial_frames)
        streamer = ChunkStreamer(chunks, min(initial, chunks.steady_frames), layout=QWEN3_LAYOUT,
                                 window_lengths=batcher.codec.graph_lengths)
        first = TokenCounts(text_tokens, omni_compat.qwen3_tts_reference_tokens(params))

        async def drive() -> None:
            async with contextlib.aclosing(audio_chunks(self._omni, prompt, request.request_id, sampling)) as chunks:
                async for _ in chunks:
                    pass

        async def due_windows() -> AsyncGenerator[DecodeWindow]:
            """The unit's chunks to decode, in order, as the talker's frames make them due."""
            last: float | None = None
            while True:
                frames, ended, reference = await _next_frames(arrivals, request_task)
                if reference is not None:
                    streamer.context(reference)
                now = time.perf_counter()
                if len(frames):
                    if last is not None:
                        sizer.arrived(now - last, len(frames))
                    last = now
                # another unit with no frame read yet: the talker's next step may prefill its prompt
                for window in streamer.push(frames, final=ended, now=now, backlog_s=batcher.backlog_s(now),
                                            hold_first=router.unstarted > 0):
                    yield window
                if ended:
                    break
            for window in streamer.finish():
                yield window

        request_task = asyncio.ensure_future(drive())
        played_from: float | None = None
        sent = 0
        try:
            async with contextlib.aclosing(due_windows()) as windows:
                async for window in windows:
                    cut = time.perf_counter()
                    deadline = cut if played_from is None else played_from + sent / rate
                    audio = await batcher.decode(window, deadline)
                    latency = time.perf_counter() - cut
                    streamer.delivered(latency)
                    sizer.delivered(latency)
                    if played_from is None:
                        played_from = time.perf_counter()
                        batcher.first_chunk(called, cut, played_from)
                    sent += len(audio)
                    yield AudioPiece(audio, rate, tokens=TokenCounts(first.text, first.audio, window.chunk_frames))
                    first = NO_TOKENS
            await request_task  # the pipeline's end (its errors) before the unit's
        finally:
            router.release(ticket)
            if not request_task.done():
                request_task.cancel()
                await asyncio.gather(request_task, return_exceptions=True)

    # -- start-up ------------------------------------------------------------------------------------

    def _deploy_config(self) -> str | None:
        """The deploy YAML to start with: `stage_config` (None: vllm-omni's default for the model type) as
        it is, or, with paced chunks, a chunk ramp or in random-weight mode, a copy (a temporary file,
        removed by `close`) that sets them (`paced_deploy`, `_set_chunk_ramp`) and, in random-weight mode,
        `load_format: dummy` on every stage."""
        path = self.config.stage_config
        ramp, pacing = self.config.codec_chunk_ramp, self.config.pacing
        if not ramp and pacing is None and not self.config.random_weights and self._router is None:
            return path
        if path is None and self.config.random_weights:
            raise ValueError("omni: random-weight mode needs --stage-config (e.g. adapters/omni_configs/"
                             "qwen3_tts_cpu.yaml)")
        source = path or str(omni_compat.default_deploy_config("qwen3_tts"))
        deploy = omni_compat.resolved_deploy_config(source)
        if ramp:
            _set_chunk_ramp(deploy, ramp, source)
        if pacing is not None:
            paced_deploy(deploy, 1 / self.model.frame_rate, pacing, source, self._board)
        if self._router is not None:
            for extra in _codec_chunk_connectors(deploy, source, "voicewire's own codec").values():
                extra[FRAMES_EXTRA_KEY] = {"socket": self._router.path}
            deploy["pipeline"] = omni_compat.PACED_PIPELINE
        if self.config.random_weights:
            for stage in deploy.get("stages", []):
                stage["load_format"] = "dummy"
        return written_deploy_config(deploy)

    async def _warm_up(self) -> None:
        m = self.model
        base = m.task_type == "Base"
        request = SynthesisRequest(
            request_id="omni-warmup", text=WARMUP_TEXT, voice=self._info.default_voice, max_new_tokens=2,
            instructions="A calm voice." if m.task_type == "VoiceDesign" else None,
            reference=VoiceSample.of(np.zeros(m.sample_rate, np.float32), m.sample_rate) if base else None,
            x_vector_only_mode=True if base else None)
        async for _ in self._synthesize(request):
            pass


def kv_cache_pinned(deploy: Mapping[str, Any]) -> bool:
    """Whether every stage of a deploy config fixes its KV cache (`kv_cache_memory_bytes`). vLLM then sizes
    no KV cache by profiling the GPU's free memory, which another process allocating and freeing during a
    stage's start would upset (vLLM 0.26 stops the stage when free memory rose meanwhile), so voicewire's
    own codec may capture its CUDA graphs while the pipeline starts; otherwise it captures them before."""
    stages = [stage for stage in deploy.get("stages", []) if isinstance(stage, dict)]
    return bool(stages) and all(stage.get("kv_cache_memory_bytes") for stage in stages)


def dummy_weights(deploy: Mapping[str, Any]) -> bool:
    """Whether a deploy config's stages load random weights (`load_format: dummy` on any stage): voicewire's
    own codec then decodes with random weights too (the folder ships none)."""
    return any(stage.get("load_format") == "dummy" for stage in deploy.get("stages", []) if isinstance(stage, dict))


CODEC_GRAPH_LENGTHS: Final = (1, 2, 4, 8, 16, 32, 64, 97)
"""Window lengths (frames) voicewire's own codec captures CUDA graphs for on a GPU: a window takes more left
context, where the unit has it, to reach the next one (`ChunkStreamer.window_lengths`); 97 = 72 frames of
context and the largest chunk."""

CODEC_MAX_BATCH_FRAMES: Final = 388
"""The most frames of audio one decode of voicewire's own codec makes (`CodecBatcher`; `GraphedCodec.span`: a
full window's convolutions run over 35 of its 97 frames, so 11 full windows). The decoder's convolutions need
about 4 MB of activations per frame in float32 (measured on the CPU with the 1.7B model's tokenizer shapes):
a batch of 64 windows decoded whole (6208 frames) would need about 26 GB, and its CUDA graph capture ran out of
memory on an 80 GB H100 (2026-12-06); a batch also holds back an urgent first chunk queued behind it. 388 was
four whole windows, the cap measured on the GPU before the convolutions ran over spans only."""

FINAL_WAIT_S: Final = 1.0
"""How long a unit waits for its frame channel's end after vllm-omni's request has finished."""


async def _next_frames(arrivals: asyncio.Queue[tuple[int, Any]],
                       request: asyncio.Future[None]) -> tuple[Any, bool, Any]:
    """The frames waiting on a unit's frame channel (at least one, or its end), as an array of shape (n, 16),
    whether the unit's frames ended, and the reference frames (a cloning request's, shape (m, 16)) that came
    before them, else None. Raises what the pipeline's request raised; a request that finished without the
    channel's end (lost datagrams: not expected on one host) ends the frames after `FINAL_WAIT_S`."""
    rows: list[Any] = []
    reference = None
    ended = False
    while not rows and not ended:
        if arrivals.empty():
            getter: asyncio.Future[Any] = asyncio.ensure_future(arrivals.get())
            done, _ = await asyncio.wait((getter, cast(asyncio.Future[Any], request)),
                                         return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                request.result()  # its error, if any
                try:
                    item = await asyncio.wait_for(arrivals.get(), FINAL_WAIT_S)
                except TimeoutError:
                    log.warning("omni: a unit's frame channel did not end within %.1f s of its request", FINAL_WAIT_S)
                    return np.zeros((0, QWEN3_LAYOUT.codes_per_frame), np.int64), True, reference
            else:
                item = getter.result()
        else:
            item = arrivals.get_nowait()
        while True:
            index, codes = item
            if codes is None:
                ended = True
                break
            if index == REFERENCE_INDEX:
                reference = codes
            else:
                rows.append(codes)
            if arrivals.empty():
                break
            item = arrivals.get_nowait()
    frames = np.stack(rows) if rows else np.zeros((0, QWEN3_LAYOUT.codes_per_frame), np.int64)
    return frames, ended, reference


def pipeline_down(omni: Any) -> str | None:
    """Why a started vllm-omni pipeline (`omni`, None before start) cannot serve any more, or None: a stage
    process died or its orchestrator is gone (vllm-omni's own health check says which). vllm-omni does not
    restart a stage, and neither do the omni engines: the server reports unready (and unhealthy) until it
    is restarted (module doc)."""
    failed = None if omni is None else omni_compat.pipeline_failure(omni)
    return None if failed is None else f"omni: vllm-omni's pipeline is down ({failed}); restart the server"


async def lost_with_pipeline(failure: Callable[[], str | None], pieces: AsyncGenerator[AudioPiece, None]
                             ) -> AsyncGenerator[AudioPiece, None]:
    """A unit's `pieces`, unless the engine's pipeline is down (`failure`, `pipeline_down`): then the unit
    fails with `EngineWorkerLost` (error code `generation_failed`), at once when it was down before the unit,
    or in place of whatever vllm-omni raised when a stage died under it. Closing this closes `pieces`."""
    down = failure()
    if down is not None:
        raise EngineWorkerLost(down)
    try:
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                yield piece
    except Exception as exc:
        down = failure()
        if down is None:
            raise
        raise EngineWorkerLost(down) from exc  # the unit is lost with the stage that died


def _codec_chunk_connectors(deploy: dict[str, Any], source: str, what: str) -> dict[str, dict[str, Any]]:
    """The connectors of `deploy` that stream codec frames in chunks (those with `codec_chunk_frames`), by
    name, as their `extra` dicts. Raises ValueError when there are none (`what` cannot apply then)."""
    chunked = {name: extra for name, connector in (deploy.get("connectors") or {}).items()
               if isinstance(extra := (connector or {}).get("extra"), dict) and "codec_chunk_frames" in extra}
    if not chunked or not deploy.get("async_chunk", False):
        raise ValueError(f"omni: {source} streams no codec chunks (async_chunk and a connector with "
                         f"codec_chunk_frames), so {what} cannot apply; run with the stage config's chunking "
                         "(--omni-chunk-ramp none)")
    return chunked


def _set_chunk_ramp(deploy: dict[str, Any], ramp: tuple[int, ...], source: str) -> None:
    """Set vllm-omni's `codec_chunk_ramp` on every connector that streams codec frames in chunks: `ramp`
    capped at its `codec_chunk_frames`, then that size (so the last ramp entry is the steady chunk, as
    vllm-omni expects). Raises ValueError when no connector chunks codec frames."""
    for extra in _codec_chunk_connectors(deploy, source, "a chunk ramp").values():
        steady = int(extra["codec_chunk_frames"])
        extra["codec_chunk_ramp"] = [min(int(n), steady) for n in ramp] + [steady]


def paced_deploy(deploy: dict[str, Any], frame_s: float, lead: tuple[float, float], source: str,
                 board: DeliveryBoard | None = None) -> None:
    """Pace the chunks of `deploy` (`omni_pacing`): it names the paced pipeline (`omni_compat.PACED_PIPELINE`,
    which `start` registers: vllm-omni's Qwen3-TTS pipeline with the pacing processor on its talker stage),
    and every codec-chunk connector gets the pacing parameters (`omni_pacing.pace_params`): the codec's
    `frame_s`, the `lead` (seconds, seconds per stream) and the engine's `board` (where it reports each
    unit's deliveries), if any. Raises ValueError when no connector chunks codec frames."""
    for extra in _codec_chunk_connectors(deploy, source, "paced chunks").values():
        extra[PACING_KEY] = {"frame_s": frame_s, "lead_s": lead[0], "lead_per_stream_s": lead[1],
                             **({} if board is None else {"board": board.path, "board_slots": board.slots})}
    deploy["pipeline"] = omni_compat.PACED_PIPELINE


async def audio_chunks(omni: Any, prompt: Any, request_id: str,
                       sampling: list[Any]) -> AsyncGenerator[tuple[Any, Any], None]:
    """Each non-empty audio chunk of one vllm-omni request once (vllm-omni may repeat earlier chunks in a
    growing list), as (the output that carried it, flat float32 samples); then, if the request's last output
    brought no new audio, that output with no samples (it carries the request's metrics). Closing it aborts
    the request in every stage; callers close it (`contextlib.aclosing`) when they stop early."""
    sent = 0
    last, last_sent = None, False
    stream = omni_compat.generate(omni, prompt, request_id, sampling)
    async with contextlib.aclosing(cast(AsyncGenerator[Any, None], stream)) as outputs:
        async for output in outputs:
            last, last_sent = output, False
            audio = omni_compat.audio_of(output)
            chunks = audio if isinstance(audio, list) else ([] if audio is None else [audio])
            if isinstance(audio, list):
                chunks, sent = audio[sent:], len(audio)
            for chunk in chunks:
                samples = _float_audio(chunk)
                if len(samples):
                    last_sent = True
                    yield output, samples
    if last is not None and not last_sent:
        yield last, np.zeros(0, np.float32)


async def shut_down(omni: Any, deploy_file: str | None, stage_config: str | None) -> None:
    """Stop a started pipeline (`omni`; None when it never started) and remove the deploy YAML the engine
    wrote for it (`deploy_file`, unless it is the user's own `stage_config`)."""
    if omni is not None:
        omni.shutdown()
    if deploy_file is not None and deploy_file != stage_config:
        await asyncio.to_thread(Path(deploy_file).unlink, missing_ok=True)


def written_deploy_config(deploy: dict[str, Any]) -> str:
    """`deploy` written to a new temporary YAML file; its path (the engine removes it at `close`)."""
    import yaml

    fd, path = tempfile.mkstemp(prefix="voicewire-omni-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(deploy, f)
    return path


def _float_audio(chunk: Any) -> Any:
    """A chunk as a flat float32 array in [-1, 1] (vllm-omni yields torch tensors)."""
    if hasattr(chunk, "detach"):
        chunk = chunk.detach().to("cpu").float().numpy()
    return np.clip(np.asarray(chunk, dtype=np.float32).reshape(-1), -1.0, 1.0)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"omni: {path} is missing (--model must be a model folder)")
    return cast(dict[str, Any], json.loads(path.read_text()))

