# ruff: noqa: F821
# Appended to vllm/model_executor/model_loader/dummy_loader.py in the unpacked payload by omni_duel.sh (so
# `DummyModelLoader` is that module's class). From the workplace's vllm-omni Qwen3-TTS recipe (omni_tts/).
# --- appended for the Qwen3-TTS random-weight benchmark: run Code2Wav's post-load steps (fp32 decoder,
# SnakeBeta caches, decoder CUDA graphs) that load_format=dummy normally skips. Enabled by QWEN3TTS_POSTLOAD=1.
import os as _qos

if _qos.environ.get("QWEN3TTS_POSTLOAD") == "1":
    _q_orig_lw = DummyModelLoader.load_weights

    def _q_lw(self, model, model_config):
        _q_orig_lw(self, model, model_config)
        if type(model).__name__ == "Qwen3TTSCode2Wav":
            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader as _D

            _o = _D._get_weights_iterator
            _D._get_weights_iterator = lambda self, source: iter(())
            try:
                model.load_weights(iter(()))
                print("[postload] Qwen3TTSCode2Wav post-load steps ran; decoder dtype",
                      next(model.decoder.parameters()).dtype, flush=True)
            finally:
                _D._get_weights_iterator = _o

    DummyModelLoader.load_weights = _q_lw
