"""The `omni` engine's families besides Qwen3-TTS, served through vllm-omni's own per-family speech adapter.

vllm-omni 0.30.0's speech server does not build model requests itself: it detects the TTS model type from
the deployed stages (`tts_adapters.detect_tts_model_type`), resolves that family's `TTSModelAdapter`
(`resolve_adapter`) and lets it validate the request and build the engine prompt (`validate`, `build`),
then applies the family's sampling overrides (`apply_sampling_overrides`) and the seed. `OmniAdapterEngine`
does the same through `omni_compat` (pinned), with vllm-omni's own speech-server object as the adapters'
context, so a family's prompt building, reference-audio decoding and request checks are vllm-omni's.

`omni_engine(config)` picks the engine for a model folder by its `model_type`: Qwen3-TTS keeps its own
engine (`adapters/omni.py`, which runs on vllm-omni 0.26.0 and 0.30.0), the families of `FAMILIES` get
`OmniAdapterEngine` (vllm-omni 0.30.0 only: 0.26.0's adapters delegate to private methods of its speech
server that 0.30.0 moved into the adapters), anything else is refused naming what is served.

What a family's adapter honours is not declared by vllm-omni, so each family's `EngineKind` in
`adapters/registry.py` names the request fields its adapter reads (checked in the 0.30.0 source); every
other field is refused by the capability gate before a unit runs. Facts come from the model at start:
speakers and languages from the adapter's capabilities (`load_capabilities`), the sample rate from the
warm-up unit's audio (vllm-omni reports it with every chunk). Until `start()` the engine publishes the
model-folder defaults: one voice `default`, the language `auto`, sample rate 0.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import wave
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
from voicewire.adapters import omni_compat
from voicewire.adapters.omni import (
    CONFIG_DIR,
    DEFAULT_VOICE,
    WARMUP_TEXT,
    OmniConfig,
    OmniEngine,
    audio_chunks,
    lost_with_pipeline,
    model_ids,
    model_type,
    pipeline_down,
    shut_down,
    written_deploy_config,
)
from voicewire.adapters.registry import FISH_S2_PRO
from voicewire.protocol.engine import (
    AudioPiece,
    EngineCapabilities,
    EngineInfo,
    EngineKind,
    SynthesisRequest,
    VoiceSample,
)


@dataclass(frozen=True, slots=True)
class Family:
    """A model family served through its vllm-omni speech adapter."""

    model_type: str
    """`model_type` in the folder's config.json (vllm-omni's pipeline registry key)."""
    adapter: str
    """The TTS model type vllm-omni detects for its stages (its adapter registry key)."""
    kind: EngineKind
    """Its name (`variant`) and the request fields its adapter (or vllm-omni's request path around it) acts
    on (`fields`), declared in `adapters/registry.py`."""
    reads_language: bool
    """Whether its adapter passes `language` to the model; if not, the only language is `auto`."""
    cpu_stage_config: Path
    """The stage config this project ships for vLLM's CPU build."""

    @property
    def label(self) -> str:
        return self.kind.variant or self.model_type

    @property
    def cloning(self) -> bool:
        return "ref_audio" in self.kind.fields


FAMILIES: Final = {
    family.model_type: family for family in (
        Family("fish_qwen3_omni", "fish_tts", FISH_S2_PRO, reads_language=False,
               cpu_stage_config=CONFIG_DIR / "fish_qwen3_omni_cpu.yaml"),
    )
}
"""The families `OmniAdapterEngine` serves, by config.json `model_type` (docs/engines.md has the table)."""

QWEN3_TTS: Final = "qwen3_tts"


def omni_engine(config: OmniConfig) -> OmniEngine | OmniAdapterEngine:
    """The omni engine for the model folder `config.model`: Qwen3-TTS's own, or a family's adapter engine.
    Raises ValueError for a model type neither serves, or for a chunk ramp asked of a family that has none
    (vllm-omni reads `codec_chunk_ramp` for Qwen3-TTS only); paced chunks are Qwen3-TTS's too, and the other
    families stream in their stage config's chunks; FileNotFoundError without a config.json."""
    kind = model_type(Path(config.model))
    if kind == QWEN3_TTS:
        return OmniEngine(config)
    if kind in FAMILIES:
        if config.codec_chunk_ramp:
            raise ValueError(f"omni: --omni-chunk-ramp applies to Qwen3-TTS only; {FAMILIES[kind].label} streams "
                             "in its stage config's chunks (leave the flag out, or pass none)")
        return OmniAdapterEngine(config, FAMILIES[kind])
    served = ", ".join((QWEN3_TTS, *FAMILIES))
    raise ValueError(f"omni: model type {kind!r} is not served (served: {served}; docs/engines.md lists each "
                     "family vllm-omni runs and what blocks it)")


class OmniAdapterEngine:
    """A vllm-omni family behind the voicewire `Engine` interface, through its speech adapter (module doc)."""

    def __init__(self, config: OmniConfig, family: Family) -> None:
        if config.stage_config is not None and not Path(config.stage_config).is_file():
            raise FileNotFoundError(f"omni: stage config {config.stage_config} does not exist")
        self.config = config
        self.family = family
        self._model_ids = model_ids(config)
        self._info = self._facts(sample_rate=0, speakers=(), languages=("auto",))
        self._omni: Any = None
        self._serving: Any = None
        self._adapter: Any = None
        self._speakers: frozenset[str] = frozenset()
        self._deploy_file: str | None = None

    def _facts(self, *, sample_rate: int, speakers: tuple[str, ...], languages: tuple[str, ...]) -> EngineInfo:
        voices = speakers or (DEFAULT_VOICE,)
        return EngineInfo(
            name="omni", sample_rate=sample_rate, voices=voices, default_voice=voices[0], languages=languages,
            capabilities=EngineCapabilities(
                word_timings=False, voice_cloning=self.family.cloning, speed_range=(1.0, 1.0), streaming="frame",
                fields=self.family.kind.fields, values=self.family.kind.values),
            max_concurrency=self.config.max_concurrency, model_ids=self._model_ids)

    @property
    def info(self) -> EngineInfo:
        return self._info

    def requests_in_flight(self) -> int:
        """Requests vllm-omni still tracks (for tests: 0 after every unit ended or was cancelled)."""
        return 0 if self._omni is None else omni_compat.requests_in_flight(self._omni)

    def failure(self) -> str | None:
        """Why the engine cannot serve any more (`FailureReporting`): a stage process died (`pipeline_down`)."""
        return pipeline_down(self._omni)

    async def start(self) -> None:
        """Check the vllm-omni version, start its pipeline, resolve the family's adapter from the deployed
        stages (refused unless it is this family's), read its capabilities, run one short unit (which also
        gives the sample rate)."""
        if self._omni is not None:
            return
        omni_compat.check_adapter_version(self.family.label)
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # one host: no address discovery
        self._deploy_file = await asyncio.to_thread(self._deploy_config)
        self._omni = await asyncio.to_thread(omni_compat.create_async_omni, self.config.model, self._deploy_file,
                                             init_timeout_s=self.config.init_timeout_s)
        try:
            self._serving, self._adapter, detected = omni_compat.speech_serving(self._omni, self.config.model)
            if detected != self.family.adapter:
                raise RuntimeError(f"omni: vllm-omni detected TTS model type {detected!r} for {self.config.model}, "
                                   f"not {self.family.label}'s {self.family.adapter!r}")
            speakers, default, languages = omni_compat.adapter_capabilities(self._adapter)
            self._speakers = frozenset(speakers)
            ordered = tuple(sorted(speakers, key=lambda s: (s != default, s)))
            spoken = tuple(sorted({"auto", *languages})) if self.family.reads_language else ("auto",)
            self._info = self._facts(sample_rate=0, speakers=ordered, languages=spoken)
            rate = await self._warm_up()
            self._info = self._facts(sample_rate=rate, speakers=ordered, languages=spoken)
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        serving, self._serving = self._serving, None
        if serving is not None:
            omni_compat.close_speech_serving(serving)
        omni, self._omni = self._omni, None
        deploy, self._deploy_file = self._deploy_file, None
        await shut_down(omni, deploy, self.config.stage_config)

    def synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        return lost_with_pipeline(self.failure, self._synthesize(request))

    # -- request -------------------------------------------------------------------------------------

    def speech_fields(self, request: SynthesisRequest) -> dict[str, Any]:
        """The unit as the fields of vllm-omni's speech request (`OpenAICreateSpeechRequest`): the text, the
        speaker (None for the placeholder voice of a family without speakers), the reference audio as a WAV
        `data:` URL (decoded by vllm-omni's own resolver) with its transcript, and the honoured fields."""
        fields: dict[str, Any] = {"input": request.text, "stream": True, "response_format": "pcm"}
        voice = request.voice.lower()
        if request.reference is not None:
            fields["ref_audio"] = _wav_data_url(request.reference)
        elif voice in self._speakers:
            fields["voice"] = voice
        elif voice != DEFAULT_VOICE:
            raise ValueError(f"omni: unknown voice {request.voice!r} ({self.family.label} speakers: "
                             f"{', '.join(sorted(self._speakers)) or 'none; clone with ref_audio + ref_text'})")
        if request.ref_text is not None:
            if request.reference is None:  # vllm-omni's adapters would drop it without a reference
                raise ValueError("omni: ref_text is the transcript of a reference: send ref_audio or name an "
                                 "uploaded voice with it")
            fields["ref_text"] = request.ref_text
        if request.max_new_tokens is not None:
            fields["max_new_tokens"] = request.max_new_tokens
        if request.language and request.language.lower() != "auto":
            fields["language"] = request.language
        return fields

    async def _synthesize(self, request: SynthesisRequest) -> AsyncGenerator[AudioPiece, None]:
        omni, adapter = self._omni, self._adapter
        if omni is None or adapter is None:
            raise RuntimeError("omni: engine is not started (call start() first)")
        if request.speed != 1.0:
            raise ValueError(f"omni: speed {request.speed} is outside the native range 1.0..1.0")
        prompt, sampling = await omni_compat.adapter_request(
            adapter, omni, self.speech_fields(request), request.request_id, seed=request.seed)
        if self.config.random_weights:  # random weights never stop: force the unit's length
            frames = max(2, round(len(request.text) * self.config.frames_per_char))
            frames = min(frames, request.max_new_tokens or frames)
            sampling[0].min_tokens = sampling[0].max_tokens = frames
        rate = self._info.sample_rate
        async with contextlib.aclosing(audio_chunks(omni, prompt, request.request_id, sampling)) as chunks:
            async for output, samples in chunks:
                if not len(samples):
                    continue
                output_rate = omni_compat.sample_rate_of(output)
                if rate and output_rate and output_rate != rate:
                    raise RuntimeError(f"omni: {self.family.label} gave {output_rate} Hz audio, not the {rate} Hz "
                                       "learned at start")
                rate = rate or output_rate or 0
                if not rate:
                    raise RuntimeError(f"omni: {self.family.label}'s audio came without its sample rate")
                yield AudioPiece(samples, rate)

    # -- start-up ------------------------------------------------------------------------------------

    def _deploy_config(self) -> str | None:
        """`stage_config` (None: vllm-omni's own for the model type) as it is, or in random-weight mode a
        copy (a temporary file, removed by `close`) with `load_format: dummy` on every stage."""
        path = self.config.stage_config
        if not self.config.random_weights:
            return path
        if path is None:
            raise ValueError(f"omni: random-weight mode needs --stage-config (e.g. {self.family.cpu_stage_config})")
        deploy = omni_compat.resolved_deploy_config(path)
        for stage in deploy.get("stages", []):
            stage["load_format"] = "dummy"
        return written_deploy_config(deploy)

    async def _warm_up(self) -> int:
        """One short unit through the whole path; returns the sample rate its audio came at."""
        request = SynthesisRequest(request_id="omni-warmup", text=WARMUP_TEXT, voice=self._info.default_voice,
                                   max_new_tokens=2)
        rate = 0
        async for piece in self._synthesize(request):
            rate = piece.sample_rate
        if rate <= 0:
            raise RuntimeError(f"omni: {self.family.label}'s warm-up unit gave no audio, so no sample rate")
        return rate


def _wav_data_url(reference: VoiceSample) -> str:
    """`reference` as a 16-bit mono WAV `data:` URL, the form vllm-omni's reference-audio resolver reads."""
    pcm = (np.clip(reference.samples(), -1.0, 1.0) * 32767).astype("<i2").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(reference.sample_rate)
        w.writeframes(pcm)
    return "data:audio/wav;base64," + base64.b64encode(out.getvalue()).decode("ascii")
