"""A TCP proxy on loopback that can cut connections at a chosen byte, for resume tests and benches."""

from __future__ import annotations

import asyncio


class Proxy:
    """A TCP proxy between a client and the server that can cut the connections through it once `n` bytes
    have passed in one direction (`limits`, which a cut resets): both sides are aborted, no close
    handshake, like a network that vanished. Connections made after a cut pass through, unless the test
    keeps the network down: while `refusing`, a new connection is dropped at once (`refused` counts them),
    and so are the first `refuse_after_cut` connections after each cut; while `admit` is clear, it is
    accepted but waits there before it reaches the server (`held` counts those), like a reconnect still
    under way."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.limits: dict[str, int | None] = {"down": None, "up": None}
        self.passed = {"down": 0, "up": 0}
        self.cut = asyncio.Event()
        """Set by the first cut."""
        self.cuts = 0
        """Cuts so far."""
        self.refusing = False
        self.refuse_after_cut = 0
        self._refuse_left = 0
        self.refused = 0
        self.admit = asyncio.Event()
        self.admit.set()
        self.held = 0
        self.upstream_ports: list[int] = []
        """The local port of each connection made to the server (its peer port there)."""
        self._server: asyncio.Server | None = None
        self._open: list[tuple[asyncio.Event, list[asyncio.BaseTransport]]] = []

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
        assert self._server is not None
        self._server.close()

    def url(self, query: str = "") -> str:
        return f"ws://127.0.0.1:{self.port}/v1/audio/speech/stream{query}"

    def abort(self) -> None:
        """Cut every connection through the proxy now."""
        for stop, transports in self._open:
            stop.set()
            for transport in transports:
                transport.abort()  # type: ignore[attr-defined]
        self._open.clear()
        self.limits = {"down": None, "up": None}
        self.cuts += 1
        self._refuse_left = self.refuse_after_cut
        self.cut.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing or self._refuse_left > 0:
            self._refuse_left -= 1
            self.refused += 1
            writer.transport.abort()
            return
        if not self.admit.is_set():
            self.held += 1
            await self.admit.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self.upstream_ports.append(up_writer.get_extra_info("sockname")[1])
        stop = asyncio.Event()
        self._open.append((stop, [writer.transport, up_writer.transport]))
        await asyncio.gather(self._pump(reader, up_writer, "up", stop), self._pump(up_reader, writer, "down", stop),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                    stop: asyncio.Event) -> None:
        while not stop.is_set():
            data = await reader.read(4096)
            if not data:
                writer.close()
                return
            limit = self.limits[direction]
            if limit is not None and self.passed[direction] + len(data) >= limit:
                writer.write(data[:limit - self.passed[direction]])
                self.passed[direction] = limit
                self.abort()
                return
            self.passed[direction] += len(data)
            writer.write(data)
            await writer.drain()
