"""The omni engine's start-up checks, which need no vllm-omni: the pinned version is enforced with a message
naming what is installed and what is needed, and a model folder the engine cannot serve is refused before
anything starts. (The engine itself, end to end: tests/test_omni_engine.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from voicewire.adapters import omni_compat
from voicewire.adapters.omni import DEFAULT_PACING, OmniConfig, OmniEngine
from voicewire.adapters.omni_families import OmniAdapterEngine, omni_engine
from voicewire.adapters.omni_testing import SPEAKERS, write_fish_s2_pro, write_qwen3_tts
from voicewire.realtime.cli import main


def test_another_vllm_omni_release_is_refused_with_both_versions_named() -> None:
    with pytest.raises(omni_compat.OmniVersionError) as refused:
        omni_compat.check_version("0.28.0")
    message = str(refused.value)
    assert "0.28.0 is installed" in message and "0.26.0 or 0.30.0" in message and "vllm-omni==0.30.0" in message
    assert omni_compat.check_version("0.30.0") == "0.30.0"
    assert omni_compat.check_version("0.26.0") == "0.26.0"  # the H200's build


def test_a_family_served_through_vllm_omnis_adapters_needs_0_30_and_says_so() -> None:
    with pytest.raises(omni_compat.OmniVersionError) as refused:
        omni_compat.check_adapter_version("Fish Speech S2 Pro", "0.26.0")
    message = str(refused.value)
    assert "Fish Speech S2 Pro" in message and "0.26.0 is installed" in message and "vllm-omni==0.30.0" in message
    assert omni_compat.check_adapter_version("Fish Speech S2 Pro", "0.30.0") == "0.30.0"
    with pytest.raises(omni_compat.OmniVersionError, match=r"0\.28\.0 is installed"):
        omni_compat.check_adapter_version("Fish Speech S2 Pro", "0.28.0")


def test_a_missing_vllm_omni_is_named_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(omni_compat, "installed_version", lambda: None)
    with pytest.raises(omni_compat.OmniVersionError, match="not installed"):
        omni_compat.check_version()


def test_facts_are_read_from_the_checkpoint(tmp_path: Path) -> None:
    custom = OmniEngine(OmniConfig(model=str(write_qwen3_tts(tmp_path / "cv", "custom_voice"))))
    assert custom.info.voices == tuple(SPEAKERS) and custom.info.default_voice == "vivian"
    assert custom.info.sample_rate == 24000 and custom.task_type == "CustomVoice"
    assert "english" in custom.info.languages and custom.info.capabilities.word_timings is False
    base = OmniEngine(OmniConfig(model=str(write_qwen3_tts(tmp_path / "base", "base"))))
    assert base.task_type == "Base" and base.info.capabilities.voice_cloning
    assert base.info.capabilities.values["task_type"] == ("Base",)
    assert "ref_audio" in base.info.capabilities.fields and "instructions" not in base.info.capabilities.fields
    assert "instructions" in custom.info.capabilities.fields and "ref_audio" not in custom.info.capabilities.fields


def test_a_model_type_the_engine_does_not_serve_is_refused_before_start(tmp_path: Path) -> None:
    folder = tmp_path / "cosy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "cosyvoice3"}))
    with pytest.raises(ValueError, match=r"'cosyvoice3' is not served \(served: qwen3_tts, fish_qwen3_omni"):
        omni_engine(OmniConfig(model=str(folder)))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        omni_engine(OmniConfig(model=str(tmp_path / "nothing")))
    with pytest.raises(ValueError, match="fish_qwen3_omni"):  # the Qwen3-TTS engine itself takes Qwen3-TTS only
        OmniEngine(OmniConfig(model=str(write_fish_s2_pro(tmp_path / "fish"))))


def test_a_chunk_ramp_asked_of_a_family_without_one_is_refused_before_start(tmp_path: Path) -> None:
    fish = str(write_fish_s2_pro(tmp_path / "fish"))
    with pytest.raises(ValueError, match=r"--omni-chunk-ramp applies to Qwen3-TTS only; Fish Speech S2 Pro"):
        omni_engine(OmniConfig(model=fish, pacing=None, codec_chunk_ramp=(2, 4, 8)))
    for pacing in (DEFAULT_PACING, None):  # the flag left out (paced: Qwen3-TTS only), or `none`
        assert isinstance(omni_engine(OmniConfig(model=fish, pacing=pacing)), OmniAdapterEngine)


def test_a_fish_folder_gets_the_adapter_engine_with_its_adapters_fields(tmp_path: Path) -> None:
    engine = omni_engine(OmniConfig(model=str(write_fish_s2_pro(tmp_path / "fish"))))
    assert isinstance(engine, OmniAdapterEngine) and engine.family.adapter == "fish_tts"
    caps = engine.info.capabilities
    assert caps.voice_cloning and caps.fields == {"ref_audio", "ref_text", "max_new_tokens", "seed"}
    assert caps.values == {} and engine.info.languages == ("auto",)  # Fish's adapter does not read `language`
    assert engine.info.voices == ("default",)


def test_the_model_is_known_by_vllm_omnis_ids_and_its_hf_style_name(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-omni's server names a model by `--served-model-name`, else by `--model` as given; here both, and
    the HF-style `org/name` when the folder tells it (a hub cache snapshot, or config.json's `_name_or_path`),
    on every omni engine, and from the CLI flag."""
    from voicewire.realtime.cli import build_parser
    from voicewire.realtime.cli import omni_engine as cli_engine

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-TTS-12Hz-0.6B-CustomVoice" / "snapshots" / ("a1" * 20)
    model = str(write_qwen3_tts(snapshot, "custom_voice"))
    assert OmniEngine(OmniConfig(model=model)).info.model_ids == (model, "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")
    monkeypatch.chdir(tmp_path)  # a relative --model is reported as given
    fish = write_fish_s2_pro(tmp_path / "s2-pro")
    config = json.loads((fish / "config.json").read_text())
    (fish / "config.json").write_text(json.dumps({**config, "_name_or_path": "fishaudio/s2-pro"}))
    engine = omni_engine(OmniConfig(model="s2-pro", served_model_names=("tts-prod",)))
    assert engine.info.model_ids == ("tts-prod", "s2-pro", "fishaudio/s2-pro")
    (fish / "config.json").write_text(json.dumps({**config, "_name_or_path": "/home/me/checkpoints/s2"}))
    assert omni_engine(OmniConfig(model="s2-pro")).info.model_ids == ("s2-pro",)  # a path is no HF name
    args = build_parser().parse_args(["serve", "--engine", "omni", "--model", model, "--served-model-name", "a", "b"])
    cli = cli_engine(args)
    assert cli is not None and cli.info.model_ids == ("a", "b", model, "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice")


def test_cli_needs_a_model_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--engine", "omni", "--no-auth"]) == 2
    assert "engine omni needs --model DIR" in capsys.readouterr().err


def test_the_chunk_ramp_is_set_on_the_codec_connector_capped_at_the_steady_chunk(tmp_path: Path) -> None:
    from voicewire.adapters.omni import _set_chunk_ramp

    deploy = {"async_chunk": True, "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {
        "codec_chunk_frames": 25, "initial_codec_chunk_frames": 1}}, "other": {"name": "X"}}}
    _set_chunk_ramp(deploy, (1, 2, 4, 8, 16, 32), "deploy.yaml")
    assert deploy["connectors"]["shm"]["extra"]["codec_chunk_ramp"] == [1, 2, 4, 8, 16, 25, 25]
    assert "extra" not in deploy["connectors"]["other"]
    for unchunked in ({"async_chunk": False, "connectors": {"shm": {"extra": {"codec_chunk_frames": 25}}}},
                      {"async_chunk": True, "connectors": {"shm": {"extra": {}}}}):
        with pytest.raises(ValueError, match="--omni-chunk-ramp none"):
            _set_chunk_ramp(unchunked, (1, 2), "deploy.yaml")


def test_paced_chunks_name_the_paced_pipeline_and_give_the_codec_connector_its_lead() -> None:
    from voicewire.adapters.omni import paced_deploy
    from voicewire.adapters.omni_pacing import EXTRA_KEY, PROCESSOR, pace_params

    deploy: dict[str, Any] = {"async_chunk": True, "connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {
        "codec_chunk_frames": 25, "initial_codec_chunk_frames": 1}}, "other": {"name": "X"}}}
    paced_deploy(deploy, 0.08, (0.05, 0.002), "deploy.yaml")
    assert deploy["pipeline"] == omni_compat.PACED_PIPELINE
    params = pace_params(deploy["connectors"]["shm"]["extra"])
    assert (params.frame_s, params.steady, params.lead_s, params.lead_per_stream_s) == (0.08, 25, 0.05, 0.002)
    assert EXTRA_KEY not in deploy["connectors"]["other"]
    module, name = PROCESSOR.rsplit(".", 1)  # what vllm-omni imports in the talker's process
    assert callable(getattr(__import__(module, fromlist=[name]), name))
    with pytest.raises(ValueError, match="--omni-chunk-ramp none"):
        paced_deploy({"async_chunk": False, "connectors": deploy["connectors"]}, 0.08, (0.05, 0.0), "d.yaml")


def test_a_ramped_engine_serves_only_its_own_first_chunk_size(tmp_path: Path) -> None:
    model = str(write_qwen3_tts(tmp_path / "cv", "custom_voice"))
    ramped = OmniEngine(OmniConfig(model=model, pacing=None, codec_chunk_ramp=(2, 4, 8))).info.capabilities
    assert "initial_codec_chunk_frames" not in ramped.fields
    assert ramped.values["initial_codec_chunk_frames"] == (2,)
    for pacing in (DEFAULT_PACING, None):  # paced (the default) and the stage config's chunks take any
        plain = OmniEngine(OmniConfig(model=model, pacing=pacing)).info.capabilities
        assert "initial_codec_chunk_frames" in plain.fields
    for bad in ((4,), (2, 0, 4)):
        with pytest.raises(ValueError, match="codec_chunk_ramp"):
            OmniConfig(model=model, pacing=None, codec_chunk_ramp=bad)
    with pytest.raises(ValueError, match="either paced or cut by a fixed ramp"):
        OmniConfig(model=model, codec_chunk_ramp=(1, 2))


def test_cli_chunking_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from voicewire.realtime.cli import _chunk_ramp, build_parser
    from voicewire.realtime.cli import omni_engine as cli_engine

    assert _chunk_ramp("1,2,4,8,16") == (1, 2, 4, 8, 16) and _chunk_ramp("none") == ()
    assert _chunk_ramp("paced") == "paced"
    with pytest.raises(SystemExit):
        main(["serve", "--engine", "omni", "--no-auth", "--model", str(tmp_path), "--omni-chunk-ramp", "1,x"])
    assert "not paced, none or a list of frame counts" in capsys.readouterr().err
    model = str(write_qwen3_tts(tmp_path / "cv", "custom_voice"))

    def config(*flags: str) -> OmniConfig:
        engine = cli_engine(build_parser().parse_args(["serve", "--engine", "omni", "--model", model, *flags]))
        assert isinstance(engine, OmniEngine)
        return engine.config

    default = config()  # Qwen3-TTS: voicewire's own codec, its own schedule
    assert default.own_codec and default.pacing is None and default.codec_chunk_ramp == ()
    pipeline = config("--omni-codec", "pipeline")  # vllm-omni's code2wav, paced
    assert not pipeline.own_codec and pipeline.pacing == (0.055, 0.0015) and pipeline.codec_chunk_ramp == ()
    assert config("--omni-codec", "voicewire").own_codec
    paced = config("--omni-pace-lead-ms", "80,2")  # flags that cut code2wav's chunks choose that stage
    assert not paced.own_codec and paced.pacing == (0.08, 0.002)
    assert not config("--omni-chunk-ramp", "1,2,4").own_codec
    explicit = config("--omni-chunk-ramp", "paced")  # paced given alone chooses code2wav too, paced by default
    assert not explicit.own_codec and explicit.pacing == (0.055, 0.0015) and explicit.codec_chunk_ramp == ()
    assert config("--omni-chunk-ramp", "paced", "--omni-pace-lead-ms", "80,2").pacing == (0.08, 0.002)
    with pytest.raises(ValueError, match="--omni-codec voicewire cuts chunks by its own schedule"):
        config("--omni-codec", "voicewire", "--omni-chunk-ramp", "paced")
    with pytest.raises(ValueError, match="--omni-codec voicewire cuts chunks by its own schedule"):
        config("--omni-codec", "voicewire", "--omni-chunk-ramp", "1,2,4")
    assert (config("--omni-chunk-ramp", "1,2,4").pacing, config("--omni-chunk-ramp", "1,2,4").codec_chunk_ramp) \
        == (None, (1, 2, 4))
    assert (config("--omni-chunk-ramp", "none").pacing, config("--omni-chunk-ramp", "none").codec_chunk_ramp) \
        == (None, ())
    with pytest.raises(ValueError, match="--omni-pace-lead-ms applies to paced chunks"):
        config("--omni-chunk-ramp", "none", "--omni-pace-lead-ms", "80,2")
    assert default.codec_margin_s is None and config("--codec-margin-ms", "200").codec_margin_s == 0.2
    with pytest.raises(ValueError, match="--codec-margin-ms applies to voicewire's own codec"):
        config("--omni-codec", "pipeline", "--codec-margin-ms", "200")
    with pytest.raises(ValueError, match="cannot be negative"):
        config("--codec-margin-ms", "-5")


def test_a_unit_becomes_vllm_omnis_speech_request_fields(tmp_path: Path) -> None:
    """What the adapter engine hands vllm-omni's Fish adapter: the reference audio as a WAV data URL that
    decodes to the same samples, its transcript; the placeholder voice as no voice; nothing dropped."""
    import base64
    import io
    import wave

    import numpy as np
    from voicewire.protocol.engine import SynthesisRequest, VoiceSample

    engine = omni_engine(OmniConfig(model=str(write_fish_s2_pro(tmp_path / "fish"))))
    assert isinstance(engine, OmniAdapterEngine)
    plain = engine.speech_fields(SynthesisRequest(request_id="r", text="Hi.", voice="default", max_new_tokens=9))
    assert plain == {"input": "Hi.", "stream": True, "response_format": "pcm", "max_new_tokens": 9}
    samples = (0.25 * np.sin(np.arange(16000) / 7)).astype(np.float32)
    cloned = engine.speech_fields(SynthesisRequest(request_id="r", text="Hi.", voice="default", ref_text="Ref.",
                                                   reference=VoiceSample.of(samples, 16000)))
    assert cloned["ref_text"] == "Ref." and "voice" not in cloned
    header, payload = str(cloned["ref_audio"]).split(",", 1)
    assert header == "data:audio/wav;base64"
    with wave.open(io.BytesIO(base64.b64decode(payload))) as w:
        assert (w.getframerate(), w.getnchannels()) == (16000, 1)
        decoded = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32767
    assert np.abs(decoded - samples).max() < 1e-4
    with pytest.raises(ValueError, match="ref_text is the transcript of a reference"):
        engine.speech_fields(SynthesisRequest(request_id="r", text="Hi.", voice="default", ref_text="Ref."))
    with pytest.raises(ValueError, match="unknown voice 'vivian'"):
        engine.speech_fields(SynthesisRequest(request_id="r", text="Hi.", voice="vivian"))
