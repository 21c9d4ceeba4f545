"""PyAV stand-in: `av.audio.resampler` (see `av/__init__.py`): mono float32 at the input's own rate only."""

from __future__ import annotations

from av import AudioFrame, _unavailable


class AudioResampler:
    """Downmixes a frame to one float32 plane; any other format, layout or a rate change raises."""

    def __init__(self, format: str = "flt", layout: str = "mono", rate: int | None = None) -> None:
        if format != "flt" or layout != "mono":
            raise _unavailable(f"AudioResampler(format={format!r}, layout={layout!r})")
        self.rate = rate

    def resample(self, frame: AudioFrame | None) -> list[AudioFrame]:
        if frame is None:
            return []
        if self.rate is not None and frame.sample_rate != self.rate:
            raise _unavailable(f"resampling {frame.sample_rate} Hz to {self.rate} Hz")
        return [AudioFrame(frame.to_ndarray().mean(axis=0, keepdims=True), frame.sample_rate)]
