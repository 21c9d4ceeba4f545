"""Shared fixtures: one real server on loopback with the embedded engine, for the whole test run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server import ServerThread


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    srv = ServerThread()
    yield srv
    srv.stop()
