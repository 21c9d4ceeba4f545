"""A thin test client over the real `websockets` library: send messages, collect events and audio."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

Event = dict[str, Any]


@dataclass
class Received:
    """Everything a client saw, in order: JSON events as dicts, binary frames as bytes."""

    items: list[Event | bytes] = field(default_factory=list)

    @property
    def events(self) -> list[Event]:
        return [i for i in self.items if isinstance(i, dict)]

    def types(self) -> list[str]:
        return ["<binary>" if isinstance(i, bytes) else str(i["type"]) for i in self.items]

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e["type"] == kind]


async def send(ws: ClientConnection, message: dict[str, Any]) -> None:
    await ws.send(json.dumps(message))


async def recv_until(ws: ClientConnection, kind: str, into: Received | None = None, timeout: float = 120.0,
                     count: int = 1) -> Received:
    """Receive until `count` events of type `kind` (or the socket closes)."""
    got = into or Received()
    seen = 0
    async with asyncio.timeout(timeout):
        while seen < count:
            try:
                frame = await ws.recv()
            except websockets.ConnectionClosed:
                return got
            item: Event | bytes = frame if isinstance(frame, bytes) else json.loads(frame)
            got.items.append(item)
            if isinstance(item, dict) and item["type"] == kind:
                seen += 1
    return got


async def configure(ws: ClientConnection, **config: Any) -> Event:
    await send(ws, {"type": "session.config", **config})
    got = await recv_until(ws, "session.updated")
    assert got.events[-1]["type"] == "session.updated", got.items
    return got.events[-1]


async def utter(ws: ClientConnection, text: str, timeout: float = 120.0) -> Received:
    """Send `text` as one whole utterance (`input.text`, then `input.done`) and receive up to its `session.done`."""
    await send(ws, {"type": "input.text", "text": text})
    await send(ws, {"type": "input.done"})
    return await recv_until(ws, "session.done", timeout=timeout)


async def stream_tokens(ws: ClientConnection, text: str, sizes: tuple[int, ...] = (1, 3, 2, 4)) -> None:
    """Send `text` as an LLM would: deltas of 1-4 characters."""
    i = k = 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        await send(ws, {"type": "input.text", "text": text[i:i + n]})
        i += n
        k += 1
