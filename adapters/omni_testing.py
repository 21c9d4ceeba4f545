"""Random-weight model folders for the `omni` engine's tests and benchmarks (nothing is downloaded): Qwen3-TTS
and Fish Speech S2 Pro.

`write_qwen3_tts(folder, kind)` writes what vllm-omni reads from a Qwen3-TTS 12 Hz folder, at tiny sizes:
`config.json` (talker, code predictor, speaker encoder), `generation_config.json`, `speech_tokenizer/`
(the codec's config and feature-extractor config) and a small byte-level BPE tokenizer whose special
tokens carry Qwen's real ids. No weight files: the stage config loads them with `load_format: dummy`.

What is kept from the released models because vllm-omni's code depends on it: every control id (codec
bos/eos/pad/think ids, language ids, speaker ids, the chat and TTS text specials), 16 code groups of 2048
codes, 12.5 frames per second, 24 kHz audio and the decoder's 1920x upsampling (8*5*4*3 * 2*2). Widths and
depths are shrunk so both stages start and run on two CPU cores.

`kind` is the model's `tts_model_type`: `custom_voice` (predefined speakers), `voice_design` (a voice from
a description, `instructions`) or `base` (cloning from reference audio; the speaker encoder turns it into
an x-vector and the codec encoder into reference codes).

`write_fish_s2_pro(folder)` writes a Fish Speech S2 Pro folder (`model_type: fish_qwen3_omni`): its
`config.json` with a tiny slow AR (2 layers) and fast AR (1 layer), the real vocabulary, semantic-token range
and codebooks (10 of 4096), a byte-level BPE tokenizer with Fish's control tokens at their real ids, and an
empty `codec.pth`. vllm-omni builds the DAC codec at its one (full) size and loads `codec.pth` non-strictly,
so the decoder keeps its random initialisation: the slow part on a CPU (seconds per second of audio).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal

ModelKind = Literal["custom_voice", "voice_design", "base"]

LANGUAGE_IDS: Final = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071, "spanish": 2054,
    "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
    "beijing_dialect": 2074, "sichuan_dialect": 2062,
}
"""Qwen3-TTS' codec language ids (the released 12 Hz models')."""

SPEAKERS: Final[dict[str, tuple[int, str | bool]]] = {
    "vivian": (3065, False), "serena": (3066, False), "ryan": (3061, False),
    "dylan": (2878, "beijing_dialect"), "eric": (2875, "sichuan_dialect"),
}
"""A few of the CustomVoice model's speakers: codec id, and the dialect the speaker speaks (or False)."""

TEXT_SPECIALS: Final = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<tts_pad>": 151671, "<tts_text_bos>": 151672, "<tts_text_eod>": 151673,
}

FISH_TEXT_SPECIALS: Final = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|voice|>": 151673,
    "<|audio_start|>": 151675, "<|audio_end|>": 151676, "<|audio_pad|>": 151677,
}
"""Fish Speech S2 Pro's control tokens (Qwen3's chat specials plus its voice and audio markers)."""

TINY_TALKER: Final[dict[str, Any]] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64,
}
"""Talker widths for CI (vLLM's CPU attention needs head_dim >= 32)."""


def write_qwen3_tts(folder: Path, kind: ModelKind = "custom_voice") -> Path:
    """Write a random-weight Qwen3-TTS 12 Hz folder of the given `kind` into `folder`; returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "speech_tokenizer").mkdir(exist_ok=True)
    _dump(folder / "config.json", _model_config(kind))
    _dump(folder / "generation_config.json", {"do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                                              "repetition_penalty": 1.05, "max_new_tokens": 8192})
    _dump(folder / "speech_tokenizer" / "config.json", _codec_config())
    _dump(folder / "speech_tokenizer" / "preprocessor_config.json", {
        "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "padding_side": "right",
        "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000,
        "chunk_length_s": None, "overlap": None})
    _write_tokenizer(folder, TEXT_SPECIALS)
    return folder


def write_fish_s2_pro(folder: Path) -> Path:
    """Write a random-weight Fish Speech S2 Pro folder into `folder` (see the module doc); returns `folder`."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    _dump(folder / "config.json", _fish_config())
    torch.save({}, folder / "codec.pth")
    _write_tokenizer(folder, FISH_TEXT_SPECIALS)
    return folder


def _fish_config() -> dict[str, Any]:
    """The slow AR (text -> semantic tokens) and the fast AR (the other codebooks per frame), tiny; ids,
    vocabulary and codebooks as released (vllm-omni's Fish model and prompt builder depend on them)."""
    width: dict[str, Any] = {"dim": 128, "n_head": 2, "n_local_heads": 1, "head_dim": 64, "intermediate_size": 256}
    return {
        "architectures": ["FishSpeechSlowARForConditionalGeneration"], "model_type": "fish_qwen3_omni",
        "dtype": "bfloat16", "torch_dtype": "bfloat16", "eos_token_id": FISH_TEXT_SPECIALS["<|im_end|>"],
        "audio_pad_token_id": FISH_TEXT_SPECIALS["<|audio_pad|>"],
        "semantic_start_token_id": 151678, "semantic_end_token_id": 155773,
        "text_config": {"model_type": "fish_qwen3", "vocab_size": 155776, **width, "n_layer": 2,
                        "max_seq_len": 4096, "codebook_size": 4096, "num_codebooks": 10, "attention_qk_norm": True,
                        "tie_word_embeddings": True},
        "audio_decoder_config": {"model_type": "fish_qwen3_audio_decoder", "vocab_size": 4096, "num_codebooks": 10,
                                 **width, "n_layer": 1, "max_seq_len": 11, "text_dim": 128, "audio_hidden_dim": 256},
    }


def _model_config(kind: ModelKind) -> dict[str, Any]:
    hidden = TINY_TALKER["hidden_size"]
    speakers = SPEAKERS if kind == "custom_voice" else {}
    talker = {
        "model_type": "qwen3_tts_talker", "vocab_size": 3072, **TINY_TALKER, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [12, 10, 10], "rope_type": "default",
                         "type": "default"},
        "attention_bias": False, "tie_word_embeddings": False, "num_code_groups": 16,
        "text_hidden_size": 64, "text_vocab_size": 151936, "position_id_per_seconds": 13,
        "codec_eos_token_id": 2150, "codec_think_id": 2154, "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "codec_pad_id": 2148, "codec_bos_id": 2149,
        "codec_language_id": LANGUAGE_IDS,
        "spk_id": {name: ids[0] for name, ids in speakers.items()},
        "spk_is_dialect": {name: ids[1] for name, ids in speakers.items()},
        "code_predictor_config": {
            "model_type": "qwen3_tts_talker_code_predictor", "vocab_size": 2048, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "rope_scaling": None, "num_code_groups": 16, "tie_word_embeddings": False,
            "layer_types": ["full_attention"]},
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": "0b6", "tts_model_type": kind,
        "assistant_token_id": 77091, "im_start_token_id": TEXT_SPECIALS["<|im_start|>"],
        "im_end_token_id": TEXT_SPECIALS["<|im_end|>"], "tts_pad_token_id": TEXT_SPECIALS["<tts_pad>"],
        "tts_bos_token_id": TEXT_SPECIALS["<tts_text_bos>"], "tts_eos_token_id": TEXT_SPECIALS["<tts_text_eod>"],
        "torch_dtype": "bfloat16", "dtype": "bfloat16",
        # The speaker encoder (ECAPA-TDNN) maps a reference's mel frames to an x-vector of the talker's width.
        "speaker_encoder_config": {"enc_dim": hidden, "sample_rate": 24000, "mel_dim": 128,
                                   "enc_channels": [32, 32, 32, 32, 96], "enc_attention_channels": 16,
                                   "enc_res2net_scale": 4, "enc_se_channels": 16},
        "talker_config": talker,
    }


def _codec_config() -> dict[str, Any]:
    """The 12 Hz speech tokenizer: a Mimi-style encoder (reference audio -> codes, for cloning) and the
    decoder (codes -> 24 kHz audio), both tiny; strides and codebooks as released."""
    return {
        "model_type": "qwen3_tts_tokenizer_12hz", "architectures": ["Qwen3TTSTokenizerV2Model"],
        "encoder_valid_num_quantizers": 16, "input_sample_rate": 24000, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920, "encode_downsample_rate": 1920,
        "encoder_config": {
            "model_type": "mimi", "sampling_rate": 24000, "frame_rate": 12.5, "_frame_rate": 12.5,
            "num_quantizers": 32, "num_semantic_quantizers": 1, "codebook_size": 2048, "codebook_dim": 32,
            "hidden_size": 32, "vector_quantization_hidden_dimension": 32, "sliding_window": 250,
            "intermediate_size": 64, "num_filters": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "gelu", "upsample_groups": 32},
        "decoder_config": {
            "codebook_size": 2048, "codebook_dim": 32, "semantic_codebook_size": 4096, "num_semantic_quantizers": 1,
            "hidden_size": 32, "head_dim": 16, "latent_dim": 32, "max_position_embeddings": 8000,
            "rope_theta": 10000, "num_attention_heads": 2, "num_key_value_heads": 2, "attention_bias": False,
            "sliding_window": 72, "intermediate_size": 64, "hidden_act": "silu", "layer_scale_initial_scale": 0.01,
            "rms_norm_eps": 1e-5, "num_hidden_layers": 1, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "decoder_dim": 64, "attention_dropout": 0.0},
    }


def _write_tokenizer(folder: Path, specials: dict[str, int]) -> None:
    """A byte-level BPE trained on a few sentences (so text is a handful of tokens, not one per byte),
    with the model's special tokens (`specials`) at their real ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["Hello, this is a short test of speech synthesis.", "The quick brown fox jumps over the lazy dog.",
              "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: ! ? , . ; ' \" ( )", "user assistant system"]
    tokenizer.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]))
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    data["model"]["vocab"] = {token: index for index, token in enumerate(sorted(vocab, key=vocab.__getitem__))}
    data["added_tokens"] = [{"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for token, index in specials.items()]
    _dump(folder / "tokenizer.json", data)
    _dump(folder / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 131072, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None, "clean_up_tokenization_spaces": False,
        "errors": "replace", "split_special_tokens": False,
        "additional_special_tokens": [t for t in specials if t != "<|endoftext|>"]})


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))
