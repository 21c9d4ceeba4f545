"""PyAV stand-in: `av.container` (see `av/__init__.py`)."""


class OutputContainer:
    """A name only (voicewire uses it in an annotation)."""
