"""Qwen3-TTS' 12 Hz decoder in voicewire's own batched codec path (`talker_codec.GraphedCodec`).

vllm-omni's code2wav stage decodes each chunk a request hands it; it batches only windows of exactly equal
length, and its CUDA graphs are for batch 1 unless configured (docs/benchmarks.md, the H200 duel of
2026-12-06). `Qwen3Codec` decodes the same frames with the same decoder (vllm-omni's
`Qwen3TTSTokenizerV2Decoder`, built from the model folder's `speech_tokenizer/` config and weights) in
`CodecBatcher`'s batches: every stream's windows of one length in one call, through CUDA graphs per (batch
bucket, window length) on a GPU, padded to the bucket.

The decoder is causal (causal convolutions, a sliding-window transformer), so a chunk decoded with enough
frames of left context equals the whole sequence's decode at the same place: no lookahead, no stand-in
frames (`QWEN3_POLICY`). For the same reason a window padded at its end decodes its own frames unchanged
(`GraphedCodec.causal`): the batcher pads every window to the next captured length, so windows of nearby
lengths share a call and none decodes eagerly. vllm-omni streams with `codec_left_context_frames` 72 (the
decoder's sliding window); the tiny test decoder is exact to 1e-7 from 8 frames.

Nearly all of a decode is the upsampling convolutions after the transformer (measured on the CPU with the 1.7B
model's tokenizer shapes: 38 s of convolutions against 0.3 s for the rest, 4 windows of 97 frames), and they
need only `conv_context_frames` (10) frames of left context, where the transformer needs 72. So the
transformer runs over each whole window and the convolutions over the chunk and those 10 frames only
(`GraphedCodec.tail_frames`, `Qwen3Codec._forward`): a full 97-frame window costs them 35 frames, not 97,
and its chunk's samples are the same (vllm-omni's own incremental decoder does likewise, with 12).

A frame is 16 codes (one per quantizer, the talker's codebook 0 first) and 1920 samples at 24 kHz (80 ms).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

from voicewire.adapters.talker_codec import ChunkPolicy, FrameLayout, GraphedCodec

QWEN3_LAYOUT = FrameLayout(codes_per_frame=16, samples_per_frame=1920, sample_rate=24000)
"""Qwen3-TTS 12 Hz frames: 16 codes, 1920 samples at 24 kHz (80 ms)."""

RANDOM_SCALE = 1e-3
RANDOM_SEED = 1234
"""Random-weight mode: every decoder parameter uniform in +-`RANDOM_SCALE`, seeded (the kind of weights vLLM's
`load_format: dummy` gives the pipeline's stages; the decoder's own initialisation leaves layers at zero and
decodes silence)."""

QWEN3_POLICY = ChunkPolicy(initial_frames=1, steady_frames=25, left_context_frames=72, lookahead_frames=0,
                           pad_frames=0, delivery_slack_s=0.12, held_first_frames=4)
"""Chunks for the causal decoder: left context only (72 frames, vllm-omni's streaming window), the largest
chunk vllm-omni's own (25 frames). Two margins are wider than the talker engine's, from the duel at 64
sessions on an H100 (2026-12-07, docs/benchmarks.md "The held first chunk again"), where one stream in 2
rounds of 4 ran dry for 8-9 ms: this codec's calls took 30-35 ms there (up to 55), against SNAC's 21-24 (up
to 40) under which the talker engine's 80 ms of slack was measured, so 120 ms; and a first chunk held
through a burst's prefill (`ChunkStreamer.push`'s `hold_first`) waits for up to 4 frames (320 ms of audio)
where 2 left the stream that started first in the burst 8 ms short: its next chunk reached the client 265 ms
after its fourth frame's, while the rest of the burst was starting."""


def conv_context_frames(decoder: Any) -> int:
    """Frames of left context the layers after `decoder`'s transformer (its `upsample` and `decoder` module
    lists: causal convolutions and transposed convolutions) need for exact output: each causal convolution
    looks back its padding in its own samples, each transposed one of kernel k and stride s back
    ceil((k - s) / s) of its inputs, in frames at the sample rate where it runs; their sum, rounded up."""
    rate, context = 1, 0.0
    for module in [*decoder.upsample.modules(), *decoder.decoder.modules()]:
        kind = type(module).__name__
        if kind.endswith("CausalConvNet"):
            context += module.padding / rate
        elif kind.endswith("CausalTransConvNet"):
            kernel, stride = int(module.conv.kernel_size[0]), int(module.conv.stride[0])
            context += math.ceil((kernel - stride) / stride) / rate
            rate *= stride
    return math.ceil(context)


class Qwen3Codec(GraphedCodec):
    """vllm-omni's Qwen3-TTS 12 Hz decoder loaded from a model folder's `speech_tokenizer/` (`config.json`
    and the `decoder.*` tensors of its `*.safetensors`), decoding windows of shape (batch, n, 16) to
    (batch, n * 1920) float32 audio (`GraphedCodec.decode`); given chunk ends, a window's convolutions run over
    its last `QWEN3_POLICY.steady_frames` + `conv_context_frames` frames (`tail_frames`) up to its chunk's end
    only (`spans`; False decodes every window whole, the baseline of `bench/omni_codec.py`). `random_weights`:
    seeded random weights (`RANDOM_SCALE`) instead of reading any (the random-weight test and benchmark models
    ship none). Runs in float32 by default, as vllm-omni's code2wav stage does.
    Needs vllm-omni installed."""

    layout = QWEN3_LAYOUT
    causal = True

    def __init__(self, model_dir: str | Path, device: str = "auto", dtype: str = "float32",
                 cuda_graphs: bool = True, random_weights: bool = False, spans: bool = True) -> None:
        self.folder = Path(model_dir) / "speech_tokenizer"
        if not (self.folder / "config.json").is_file():
            raise FileNotFoundError(f"omni codec: {self.folder / 'config.json'} is missing (a Qwen3-TTS 12 Hz model "
                                    "folder has its speech tokenizer there)")
        self.random_weights = random_weights
        self.spans = spans
        super().__init__(device, dtype, cuda_graphs)

    def load(self) -> None:
        """Build the decoder from the config, load its weights (unless `random_weights`), move it to the device.
        Reads only the folder (no hub access). Raises ValueError for a tokenizer other than 12 Hz with 16
        quantizers and 1920x upsampling, or weights that do not match the decoder."""
        import torch
        from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
            Qwen3TTSTokenizerV2Config,
        )
        from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
            Qwen3TTSTokenizerV2Decoder,
        )

        raw = json.loads((self.folder / "config.json").read_text())
        if raw.get("model_type") != "qwen3_tts_tokenizer_12hz":
            raise ValueError(f"omni codec: {self.folder} is a {raw.get('model_type')!r} tokenizer, not the 12 Hz one")
        config = Qwen3TTSTokenizerV2Config.from_pretrained(str(self.folder))
        decoder = Qwen3TTSTokenizerV2Decoder._from_config(config.decoder_config)
        if (int(config.decoder_config.num_quantizers) != QWEN3_LAYOUT.codes_per_frame
                or int(decoder.total_upsample) != QWEN3_LAYOUT.samples_per_frame
                or int(config.output_sample_rate) != QWEN3_LAYOUT.sample_rate):
            raise ValueError("omni codec: expected 16 quantizers, 1920 samples a frame and 24 kHz audio")
        if self.random_weights:
            generator = torch.Generator().manual_seed(RANDOM_SEED)
            with torch.no_grad():
                for parameter in decoder.parameters():
                    parameter.uniform_(-RANDOM_SCALE, RANDOM_SCALE, generator=generator)
        else:
            decoder.load_state_dict(self._decoder_weights(), strict=True)
        device, dtype = self._resolve(torch)
        self.device, self.dtype = device, dtype
        decoder = decoder.to(device=device, dtype=getattr(torch, dtype)).eval()
        if hasattr(decoder, "precompute_snake_caches"):
            decoder.precompute_snake_caches()
        if self.spans:
            self.tail_context = conv_context_frames(decoder)
            self.tail_frames = QWEN3_POLICY.steady_frames + self.tail_context
        self._model, self._torch = decoder, cast(Any, torch)
        if device.startswith("cuda"):
            self._stream = self._torch.cuda.Stream(device=device)

    def _decoder_weights(self) -> dict[str, Any]:
        """The `decoder.*` tensors of the folder's safetensors files, with the prefix taken off."""
        from safetensors.torch import load_file

        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"omni codec: no *.safetensors in {self.folder} (or pass random_weights)")
        state: dict[str, Any] = {}
        for path in files:
            for name, tensor in load_file(str(path)).items():
                if name.startswith("decoder."):
                    state[name.removeprefix("decoder.")] = tensor
        return state

    def _forward(self, codes: Any, starts: Any = None, model: Any = None) -> Any:
        """Codes (batch, n, 16) int64 on the device -> float32 audio (batch, n * 1920), or with `starts` the
        audio of each row's `tail_frames` frames from its start; no host sync. vllm-omni's decoder's forward,
        its convolutions on the span only."""
        torch = self._torch
        model = model if model is not None else self._model
        hidden = model.pre_conv(model.quantizer.decode(codes.transpose(1, 2))).transpose(1, 2)
        hidden = model.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        if starts is not None:
            index = starts[:, None] + torch.arange(self.tail_frames, device=hidden.device)[None, :]
            hidden = hidden.gather(2, index[:, None, :].expand(-1, hidden.shape[1], -1))
        for blocks in model.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in model.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)[:, 0, :].float()
