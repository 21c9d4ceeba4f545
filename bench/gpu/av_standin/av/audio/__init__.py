"""PyAV stand-in: `av.audio` (see `av/__init__.py`)."""
