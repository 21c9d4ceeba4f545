"""Random-weight model folders for the talker engine's tests and benchmarks (nothing is downloaded).

`write_talker` writes a Llama talker folder in the Orpheus layout: `config.json` (loaded by vLLM with
`load_format="dummy"`, i.e. random weights), a byte-level `tokenizer.json` (256 byte tokens, no merges),
and optionally `voices.json`. `write_snac` writes a SNAC 24 kHz folder (`config.json` +
`pytorch_model.bin`) with randomly initialised weights, in the layout of hubertsiuzdak/snac_24khz.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from voicewire.adapters.talker_layout import AUDIO_END

ORPHEUS_VOCAB = 156940
"""Orpheus' vocabulary: Llama-3's 128256 ids plus its own tokens (the audio codes end at 156938)."""

TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096,
}
"""A talker small enough for CI on two CPU cores (vLLM's CPU attention needs head_dim >= 32)."""

LLAMA_3_2_3B: dict[str, Any] = {
    "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
"""Orpheus 3B's shapes (Llama-3.2-3B)."""

TINY_SNAC: dict[str, Any] = {"encoder_dim": 8, "decoder_dim": 64, "noise": False}
"""A small SNAC decoder with the real strides. Without SNAC's noise blocks decoding is deterministic, so
tests can compare chunked with whole-sequence decoding exactly."""

SNAC_24KHZ: dict[str, Any] = {"encoder_dim": 48, "decoder_dim": 1024, "noise": True}
"""hubertsiuzdak/snac_24khz's sizes (the codec Orpheus was trained with)."""


def write_talker(folder: Path, shape: Mapping[str, Any] = TINY_LLAMA,
                 voices: Mapping[str, Sequence[int]] | None = None) -> Path:
    """Write a random-weight talker folder; `voices` maps voice names to conditioning prefix token ids."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": ORPHEUS_VOCAB,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", **shape,
    }
    assert config["vocab_size"] >= AUDIO_END
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    _write_byte_tokenizer(folder / "tokenizer.json")
    if voices is not None:
        (folder / "voices.json").write_text(json.dumps({name: {"prefix_token_ids": list(ids)}
                                                        for name, ids in voices.items()}))
    return folder


def write_snac(folder: Path, sizes: Mapping[str, Any] = TINY_SNAC, seed: int = 0) -> Path:
    """Write a randomly initialised SNAC 24 kHz folder (seeded, so the same call writes the same model)."""
    import torch
    from snac import SNAC

    folder.mkdir(parents=True, exist_ok=True)
    config = {"sampling_rate": 24000, "encoder_rates": [2, 4, 8, 8], "decoder_rates": [8, 8, 4, 2],
              "attn_window_size": None, "codebook_size": 4096, "codebook_dim": 8, "vq_strides": [4, 2, 1],
              "depthwise": True, **sizes}
    torch.manual_seed(seed)
    model = SNAC(**config)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def _write_byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))
