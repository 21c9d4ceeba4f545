"""PyAV stand-in: `av.audio.stream` (see `av/__init__.py`)."""


class AudioStream:
    """A name only (voicewire uses it in a cast)."""
