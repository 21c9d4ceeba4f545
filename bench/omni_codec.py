"""voicewire's own Qwen3-TTS codec: a full streaming window decoded whole against decoded over its chunk's span.

A steady-state window of the own codec route is 97 frames: 72 of left context (the decoder transformer's
sliding window) and a 25-frame chunk. Decoded whole, the upsampling convolutions run over all 97 frames; over
its span (`GraphedCodec.tail_frames`, `adapters/omni_codec.py`), over the chunk and the 10 frames of context
they need. This bench times both (one `Qwen3Codec` with spans, one with `spans=False`) on the same random
codes, per batch size, on the 1.7B model's tokenizer shapes with random weights (`bench.omni_duel.write_model`):
ms per call and per window, median [min-max] over `--rounds`, the span's time over the whole decode's, and the
largest difference between the two decodes' chunk samples. On CUDA both run through CUDA graphs captured for
the window length (as the engine does); on the CPU eagerly, in float32 on the threads torch is given
(`--threads`).

Run from the repository root: `python -m bench.omni_codec` (`--help` for the options).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.omni_duel import write_model
from bench.workload import Provenance, spread

WINDOW = 97
"""Frames in a full window: 72 of context and a 25-frame chunk."""
CHUNK = 25


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4", help="windows per decode call, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=1, help="decode calls per round and batch, each way")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    args = parser.parse_args(argv)
    import torch
    from voicewire.adapters.omni_codec import Qwen3Codec

    torch.set_num_threads(args.threads)
    provenance = Provenance.begin()
    batches = [int(b) for b in args.batches.split(",") if b]
    model = write_model(Path(tempfile.mkdtemp(prefix="omni-codec-")) / "model", "1.7b")
    codec, whole_codec = (Qwen3Codec(model, random_weights=True, spans=spans) for spans in (True, False))
    for each in (codec, whole_codec):
        each.load()
        each.prepare((WINDOW,), max_batch=max(batches))
    print(f"device {codec.device}, {codec.graph_shapes} + {whole_codec.graph_shapes} CUDA graphs (span, whole), "
          f"span {codec.tail_frames} frames ({codec.tail_context} of context) of a {WINDOW}-frame window",
          flush=True)
    rng = np.random.default_rng(7)
    start, spf = codec.span_start(WINDOW, WINDOW), codec.layout.samples_per_frame
    rows = []
    for batch in batches:
        frames = rng.integers(0, 2048, size=(batch, WINDOW, 16), dtype=np.int64)
        ends = [WINDOW] * batch
        whole, span = whole_codec.decode(frames, ends), codec.decode(frames, ends)  # warm-up, and the comparison
        error = float(np.abs(whole[:, (WINDOW - CHUNK) * spf:] - span[:, (WINDOW - CHUNK - start) * spf:]).max())
        rounds: list[dict[str, float]] = []
        for _ in range(args.rounds):
            rounds.append({"whole": _ms_per_call(whole_codec, frames, ends, args.calls),
                           "span": _ms_per_call(codec, frames, ends, args.calls)})
            print(f"  batch {batch}: whole {rounds[-1]['whole']:.1f} ms, span {rounds[-1]['span']:.1f} ms a call",
                  flush=True)
        ratio = [r["span"] / r["whole"] for r in rounds]
        rows.append([str(batch), spread([r["whole"] for r in rounds], "{:.1f}"),
                     spread([r["span"] for r in rounds], "{:.1f}"),
                     spread([r["whole"] / batch for r in rounds], "{:.1f}"),
                     spread([r["span"] / batch for r in rounds], "{:.1f}"), spread(ratio, "{:.2f}"),
                     f"{error:.1e} of {float(np.abs(whole).max()):.1e}"])
    print(provenance.end().line())
    print(f"median [min-max] over {args.rounds} rounds of {args.calls} call(s) each way")
    header = ["batch", "whole ms/call", "span ms/call", "whole ms/window", "span ms/window", "span / whole",
              "max |difference| on the chunk"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for line in (header, ["-" * w for w in widths], *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    return 0


def _ms_per_call(codec: Any, frames: np.ndarray, ends: list[int], calls: int) -> float:
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        codec.decode(frames, ends)
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
