"""Shared fixtures: one real server on loopback with the embedded engine, for the whole test run (per xdist
worker), and one that needs an API key, per test module that asks for it.

The suite runs on two pytest-xdist workers (`pytest -n 2`, the README's test command), scheduled by
`pytest_xdist_make_scheduler` below: each module's tests stay on one worker, so its module-scoped server starts
once, and the modules that start vLLM engines (`ENGINE_MODULES`) share one worker and run one after another, so
no two of those multi-process engines start or synthesize at once on a 2-core machine while the other worker
runs the rest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import pytest
from voicewire.realtime.settings import Settings
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling

from tests.server import API_KEY, ServerThread

ENGINE_MODULES: Final = frozenset({
    "tests/test_balancer_voices.py", "tests/test_omni_engine.py", "tests/test_omni_families.py",
    "tests/test_omni_own_codec.py", "tests/test_talker.py"})
"""The modules whose servers run vLLM engines (the omni engine's stage processes, the talker's engine core)."""


class EnginesTogether(LoadFileScheduling):
    """xdist's per-file scheduling, with `ENGINE_MODULES` one unit of work. (xdist's `loadgroup` marks name a
    group by rewriting a test's node id, which pytest 9.2's read-only node ids ignore.)"""

    def _split_scope(self, nodeid: str) -> str:
        module = super()._split_scope(nodeid)
        return "vllm-engines" if module in ENGINE_MODULES else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> EnginesTogether:
    return EnginesTogether(config, log)


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
