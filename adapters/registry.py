"""Engine construction by name, for the CLI and the app factory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Literal

from voicewire.adapters.base import Engine
from voicewire.protocol.engine import EngineKind

if TYPE_CHECKING:
    from voicewire.adapters.omni import OmniConfig
    from voicewire.adapters.talker import TalkerConfig

ENGINE_NAMES = ("hibari", "null", "talker", "omni")
Isolation = Literal["thread", "process"]

# What each kind of engine honours, declared here rather than read from a started engine, so a refusal on
# whichever engine is served names the others that would honour the field. Each engine builds its
# capabilities from its kind (tests/test_request_vocabulary.py checks the engines against this table).
HIBARI: Final = EngineKind("hibari", fields=frozenset({"seed"}), word_timings=True)
NULL: Final = EngineKind("null", fields=frozenset({"seed"}), word_timings=True)
TALKER: Final = EngineKind("talker", fields=frozenset({"seed", "max_new_tokens", "initial_codec_chunk_frames"}))
QWEN3_TTS_FIELDS: Final = frozenset({"seed", "max_new_tokens", "initial_codec_chunk_frames", "non_streaming_mode"})
"""Request fields every Qwen3-TTS checkpoint honours (`non_streaming_mode`: text given whole or streamed
into the talker's prompt; vllm-omni's default is whole for CustomVoice and VoiceDesign;
`initial_codec_chunk_frames` with paced chunks or the stage config's: with a fixed ramp, only the ramp's
first entry)."""
QWEN3_TTS_CLONING_FIELDS: Final = frozenset({"ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding"})
QWEN3_TTS: Final = {
    task: EngineKind("omni", f"Qwen3-TTS {task}", values={"task_type": (task,)},
                     fields=QWEN3_TTS_FIELDS | (QWEN3_TTS_CLONING_FIELDS if task == "Base" else {"instructions"}))
    for task in ("CustomVoice", "VoiceDesign", "Base")}
"""The omni engine on a Qwen3-TTS checkpoint, by the one task it runs: Base clones, the others follow
`instructions`."""
FISH_S2_PRO: Final = EngineKind("omni", "Fish Speech S2 Pro", values={},
                                fields=frozenset({"ref_audio", "ref_text", "max_new_tokens", "seed"}))
"""The omni engine on Fish Speech S2 Pro, through vllm-omni 0.30.0's Fish adapter (`tts_adapters/fish_speech.py`):
`validate` takes an uploaded voice or ref_audio (+ ref_text, required with it) and max_new_tokens; `build`
reads input, ref_audio, ref_text, max_new_tokens (instructions, language, speaker_embedding,
x_vector_only_mode and task_type are not read); the request path sets the seed on stage 0."""
ENGINE_KINDS: Final = (HIBARI, TALKER, *QWEN3_TTS.values(), FISH_S2_PRO)
"""The speaking engines of this build, in the order refusals name them (`null`, a benchmark stand-in that
speaks a tone, is not one)."""
CLONING_ENGINES: Final = tuple(dict.fromkeys(kind.engine for kind in ENGINE_KINDS if "ref_audio" in kind.fields))
"""Engines that can speak an uploaded voice sample (omni, with a cloning checkpoint)."""


def create_engine(name: str, *, workers: int = 1, isolation: Isolation = "thread", processes: int | None = None,
                  talker: TalkerConfig | None = None, omni: OmniConfig | None = None) -> Engine:
    """Build (not start) the named engine. Raises ValueError for an unknown name, or for `talker`
    without its `TalkerConfig` (model folders), or `omni` without its `OmniConfig`.

    `isolation="process"` runs a CPU engine (hibari) in child processes, so a crashed worker costs only
    its own units (`adapters/workers.py`): `processes` of them (default `workers`), each with `workers //
    processes` threads; ValueError unless `processes` divides `workers`. `"thread"` runs it in this process
    on `workers` threads (ValueError with `processes`). Other engines ignore both.
    """
    if name == "hibari":
        if isolation == "process":
            from voicewire.adapters.workers import ProcessEngine

            processes = workers if processes is None else processes
            if processes < 1 or workers % processes:
                raise ValueError(f"engine processes: {processes} does not divide {workers} engine workers evenly")
            return ProcessEngine("hibari", workers=processes, threads=workers // processes)
        if processes is not None:
            raise ValueError("engine processes: hibari runs in child processes only with engine isolation 'process'")
        from voicewire.adapters.hibari import HibariEngine

        return HibariEngine(workers=workers)
    if name == "null":
        from voicewire.adapters.null import NullEngine

        return NullEngine()
    if name == "talker":
        if talker is None:
            raise ValueError("engine talker needs --talker-model DIR and --codec-model DIR")
        from voicewire.adapters.talker import TalkerEngine

        return TalkerEngine(talker)
    if name == "omni":
        if omni is None:
            raise ValueError("engine omni needs --model DIR")
        from voicewire.adapters.omni_families import omni_engine

        return omni_engine(omni)
    raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINE_NAMES)}")
