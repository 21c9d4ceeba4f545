"""Shared fixtures: one real server on loopback with the embedded engine, for the whole test run, and one that
needs an API key, per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from voicewire.realtime.settings import Settings

from tests.server import API_KEY, ServerThread


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    srv = ServerThread()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerThread]:
    """A server that needs the API key `API_KEY` (the shared `server` runs open)."""
    srv = ServerThread(Settings(api_keys=(API_KEY,)))
    yield srv
    srv.stop()
