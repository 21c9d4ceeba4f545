"""The talker's codec frames straight to the server, for decoding in voicewire's own codec path
(`omni_codec.Qwen3Codec`, `talker_codec.CodecBatcher`) instead of vllm-omni's code2wav stage.

vllm-omni calls the talker stage's processor once per talker step per request, in the talker stage's
process. `talker2code2wav_own` (named by the deploy YAML like the pacer, `omni_compat.register_paced_pipeline`)
sends each step's frame (16 codes) to the server over a UNIX datagram socket (`FrameRouter`, whose path the
codec connector's `extra` carries under `EXTRA_KEY`), tagged with the request's ticket (`FRAMES_KEY` in its
`additional_information`) and the frame's index; after the last step, a final datagram with the frame count.
A cloning request's reference codes (in-context cloning: `codes.ref`, the talker's encoding of the reference
audio) go first, bounded as vllm-omni bounds them for its first chunk (the connector's
`ref_code_context_frames`, else `codec_left_context_frames`): the server's codec decodes the unit's first
windows with them as left context, as vllm-omni's code2wav does. It hands vllm-omni's own processor the
request's first frame only and no chunk before the end, so the code2wav stage decodes one frame per request,
at its end (the request then finishes as vllm-omni's pipeline expects; the server drops that audio).

Loopback UNIX datagrams arrive whole and in order (the sender blocks while the receiver's buffer is full),
so the server sees each request's frames as the talker made them. A datagram for a ticket the server no
longer holds (an aborted unit, or a last step vllm-omni processes twice) is dropped.

Wire format: `<QIB` (ticket, frame index, flags) then codes as int16. Flags 0: frame `index`, its codes;
`FINAL`: the end after `index` frames, no codes; `REFERENCE`: `index` reference frames, their codes frame by
frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import struct
import tempfile
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from voicewire.adapters import omni_compat

log = logging.getLogger(__name__)

FRAMES_KEY: Final = "voicewire_frames"
"""The `additional_information` key of a request's ticket on the frame channel."""

EXTRA_KEY: Final = "voicewire_frames"
"""The codec connector's `extra` key holding `{"socket": path}`."""

PROCESSOR: Final = f"{__name__}.talker2code2wav_own"
"""What the deploy YAML names as the talker stage's processor."""

FINAL: Final = 1
REFERENCE: Final = 2
_HEADER: Final = struct.Struct("<QIB")

Frame = npt.NDArray[np.int64]
"""One frame's codes, shape (codes per frame,); the reference's frames, shape (frames, codes per frame)."""

REFERENCE_INDEX: Final = -1
"""The index a queue item of reference frames carries (`FrameRouter`)."""


def encode(ticket: int, index: int, codes: Sequence[int] | None, flags: int = 0) -> bytes:
    """A datagram (module doc): frame `index` of `ticket`'s request with its `codes`; (codes None) the
    request's end after `index` frames; (`flags` `REFERENCE`) `index` reference frames, `codes` flat."""
    if codes is None:
        return _HEADER.pack(ticket, index, FINAL)
    return _HEADER.pack(ticket, index, flags) + array("h", codes).tobytes()


def decode(data: bytes) -> tuple[int, int, Frame | None]:
    """(ticket, index, codes) of a datagram: codes None for the end; for reference frames, index
    `REFERENCE_INDEX` and codes of shape (frames, codes per frame). Raises ValueError for a malformed one."""
    if len(data) < _HEADER.size:
        raise ValueError("omni frames: short datagram")
    ticket, index, flags = _HEADER.unpack_from(data)
    if flags & FINAL:
        return ticket, index, None
    codes = np.frombuffer(data, np.int16, offset=_HEADER.size).astype(np.int64)
    if flags & REFERENCE:
        if index < 1 or len(codes) % index:
            raise ValueError("omni frames: reference codes do not divide into their frames")
        return ticket, REFERENCE_INDEX, codes.reshape(index, -1)
    return ticket, index, codes


class FrameRouter(asyncio.DatagramProtocol):
    """The server's end: a UNIX datagram socket (in /dev/shm where there is one; `close` removes it) whose
    datagrams go, by ticket, to the queue of the unit that claimed it. Each queue gets (index, codes) per
    frame, (count, None) at the request's end and, for a cloning request before its frames,
    (`REFERENCE_INDEX`, reference frames)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._malformed_logged = False
        """Whether a malformed datagram was logged yet (one warning per router)."""
        self.history: dict[int, list[Frame]] | None = None
        """When set to a dict: every frame routed is also kept there, by ticket (for traces and tests), and
        each reference in `references`."""
        self.references: dict[int, Frame] = {}
        self._queues: dict[int, asyncio.Queue[tuple[int, Frame | None]]] = {}
        self._unstarted: set[int] = set()
        """Claimed tickets with no frame (nor the end) read yet (`unstarted`)."""
        self._tickets = itertools.count(1)
        self._transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def open(cls) -> FrameRouter:
        """A router listening on a new socket path."""
        sock = await asyncio.to_thread(_bound_socket)
        router = cls(sock.getsockname())
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: router, sock=sock)
        return router

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def claim(self) -> tuple[int, asyncio.Queue[tuple[int, Frame | None]]]:
        """A ticket for a new request and the queue its frames arrive on."""
        ticket = next(self._tickets)
        queue: asyncio.Queue[tuple[int, Frame | None]] = asyncio.Queue()
        self._queues[ticket] = queue
        self._unstarted.add(ticket)
        return ticket, queue

    def release(self, ticket: int) -> None:
        """`ticket`'s request has ended: later datagrams for it are dropped."""
        self._queues.pop(ticket, None)
        self._unstarted.discard(ticket)

    @property
    def unstarted(self) -> int:
        """Claimed tickets with no frame (nor the end) read yet: prompts waiting for the talker's prefill,
        which makes the talker's next step longer for every running request, or whose first frame of the
        latest step is still in the socket."""
        return len(self._unstarted)

    @property
    def claimed(self) -> int:
        """Tickets claimed and not yet released: the units running on the own codec path (0 when none runs)."""
        return len(self._queues)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            ticket, index, codes = decode(data)
        except ValueError as exc:
            if not self._malformed_logged:  # a sender's bug, not load: say it once, not per datagram
                self._malformed_logged = True
                log.warning("omni frames: a malformed datagram was dropped (%s); later ones are dropped silently",
                            exc)
            return
        queue = self._queues.get(ticket)
        if queue is None:  # its unit ended (aborted, or a last step processed twice): nothing waits for it
            return
        queue.put_nowait((index, codes))
        if index != REFERENCE_INDEX:
            self._unstarted.discard(ticket)
        if self.history is not None and codes is not None:
            if index == REFERENCE_INDEX:
                self.references[ticket] = codes
            else:
                self.history.setdefault(ticket, []).append(codes)

    def close(self) -> None:
        """Stop listening and remove the socket."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))


def _bound_socket() -> socket.socket:
    """A UNIX datagram socket bound at a new path, with a 4 MiB receive buffer."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = os.path.join(tempfile.mkdtemp(prefix="voicewire-omni-frames-", dir=shm), "frames.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(path)
    return sock


@dataclass(slots=True)
class _TalkerSide:
    """The processor's state in the talker stage's process: the socket, and each request's ticket and
    frames sent."""

    path: str
    hold: list[int]
    """The chunk-ramp table that makes vllm-omni's processor cut nothing before a request's end (its steady
    chunk, `codec_chunk_frames`)."""
    reference_frames: int
    """The most reference frames sent (vllm-omni's bound on its first chunk's reference context)."""
    sock: socket.socket = field(default_factory=lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)
    """request id -> (ticket, frames sent)."""
    references: dict[str, list[int]] = field(default_factory=dict)
    """request id -> reference codes (flat) not sent yet: they go with the request's first frame."""

    def send(self, data: bytes) -> None:
        self.sock.sendto(data, self.path)

    def send_reference(self, ticket: int, reference: list[int], width: int) -> None:
        """The last `reference_frames` frames of `reference` (flat, `width` codes a frame); a reference that
        does not divide into frames is left out with a warning, as vllm-omni's processor leaves it out."""
        if len(reference) % width:
            log.warning("omni frames: reference codes (%d) do not divide into frames of %d; decoding without "
                        "them", len(reference), width)
            return
        count = min(len(reference) // width, self.reference_frames)
        if count > 0:
            self.send(encode(ticket, count, reference[len(reference) - count * width:], REFERENCE))


def talker2code2wav_own(transfer_manager: Any, multimodal_output: Any, request: Any,
                        is_finished: bool = False) -> Any:
    """vllm-omni's talker-to-code2wav step for Qwen3-TTS with the frames sent to the server (module doc); the
    same signature and result as vllm-omni's `talker2code2wav_async_chunk`, which it calls for the request's
    first frame and its end."""
    processor = omni_compat.qwen3_tts_chunk_processor()
    side: _TalkerSide | None = getattr(transfer_manager, "_voicewire_frames", None)
    if side is None:
        extra = omni_compat.connector_extra(transfer_manager)
        given = extra.get(EXTRA_KEY)
        if not isinstance(given, dict) or "socket" not in given:
            raise ValueError(f"omni frames: the codec connector's extra has no {EXTRA_KEY} with a socket")
        side = transfer_manager._voicewire_frames = _TalkerSide(
            str(given["socket"]), [int(extra.get("codec_chunk_frames", 25))],
            int(extra.get("ref_code_context_frames") or extra.get("codec_left_context_frames", 25)))
    request_id, finished = omni_compat.chunk_request_state(request, is_finished)
    state = side.sent.get(request_id)
    if state is None:
        ticket = omni_compat.request_number(request, FRAMES_KEY)
        state = (ticket or 0, 0)
    ticket, sent = state
    if sent == 0 and ticket and request_id not in side.references:
        reference = omni_compat.reference_codes(multimodal_output)
        if reference:
            side.references[request_id] = reference
    codes = omni_compat.last_codec_frame(multimodal_output)
    if codes is not None and ticket:
        reference = side.references.pop(request_id, None)
        if reference:  # before the first frame: the server's streamer takes it as that frame's left context
            side.send_reference(ticket, reference, len(codes))
        side.send(encode(ticket, sent, codes))
        sent += 1
    side.sent[request_id] = (ticket, sent)
    # vllm-omni's processor keeps the first frame only and cuts nothing before the end: one frame for code2wav
    omni_compat.set_chunk_ramp(transfer_manager, side.hold)
    held = omni_compat.frames_held(transfer_manager, request_id)
    payload = processor(transfer_manager, multimodal_output if held == 0 else None, request, is_finished)
    if finished:
        if ticket:
            side.send(encode(ticket, sent, None))
        side.sent.pop(request_id, None)
        side.references.pop(request_id, None)
    return payload
