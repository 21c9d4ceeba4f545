"""Several WebSocket frames in one socket write.

aiohttp writes every frame it sends with its own `transport.write` (two for a payload over 16 KiB: header,
then payload), and uvloop turns each into a `send` system call at once while the socket takes it. A session
often has several frames ready together (`audio.start` and the first audio; the last audio, `audio.done` and
`session.done`; a whole utterance from a fast engine), and under a burst of sessions those calls are a large
share of the event loop's work. `write_frames` encodes the frames itself (RFC 6455 server frames: final,
unmasked, uncompressed) and hands them to the transport in one `writelines`, one system call.

Only for connections that negotiated no compression (voicewire's never do) and only when the socket takes
the bytes at once: the caller checks that the transport's buffer is empty and stays under its high-water
mark (`realtime.session._fits_unpaused`), so no flow control is skipped. Frames written this way and frames
aiohttp writes (pings, pongs, close) never interleave: each write is whole frames, on the one event loop.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Final, Protocol

OP_TEXT: Final = 0x1
OP_BINARY: Final = 0x2
_FINAL: Final = 0x80
_SHORT: Final = struct.Struct("!BB")
_MEDIUM: Final = struct.Struct("!BBH")
_LONG: Final = struct.Struct("!BBQ")


class LinesWriter(Protocol):
    """The part of a transport `write_frames` uses (uvloop's and asyncio's stream transports)."""

    def writelines(self, data: Sequence[bytes]) -> None: ...


def frame_header(opcode: int, length: int) -> bytes:
    """The header of a final, unmasked, uncompressed server frame of `length` payload bytes."""
    if length < 126:
        return _SHORT.pack(_FINAL | opcode, length)
    if length < 1 << 16:
        return _MEDIUM.pack(_FINAL | opcode, 126, length)
    return _LONG.pack(_FINAL | opcode, 127, length)


def encoded(frames: Sequence[str | bytes]) -> list[bytes]:
    """`frames` as header and payload byte strings, in order: a `str` as a text frame (UTF-8), `bytes` as a
    binary frame."""
    parts: list[bytes] = []
    for frame in frames:
        if isinstance(frame, str):
            payload, opcode = frame.encode(), OP_TEXT
        else:
            payload, opcode = frame, OP_BINARY
        parts += (frame_header(opcode, len(payload)), payload)
    return parts


def write_frames(transport: LinesWriter, frames: Sequence[str | bytes]) -> None:
    """Write `frames` (module doc) in one `writelines`."""
    transport.writelines(encoded(frames))
