"""What one server shares: `Server` from app creation to shutdown, `ServerContext` once its engine is warm.

`Server` holds what exists before the engine is ready (settings, the engine object, access control,
metrics, the voice store) and whether the engine failed to start or the server is shutting down.
`ServerContext` is built whole from the started engine's info (`ServerContext.build`, in the app's engine
cleanup context), so everything a session or request needs (scheduler, facts, voices) is there, never
None; `Server.serving()` is the one readiness check.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from voicewire.adapters.base import Engine, engine_failure
from voicewire.adapters.registry import CLONING_ENGINES, ENGINE_KINDS
from voicewire.protocol.messages import Limits
from voicewire.protocol.resume import ResumeRegistry
from voicewire.protocol.session import ServerFacts
from voicewire.realtime.auth import AccessControl
from voicewire.realtime.metrics import Metrics
from voicewire.realtime.offload import AudioThreads
from voicewire.realtime.scheduler import Scheduler
from voicewire.realtime.settings import OPENAI_VOICE_NAMES, Settings
from voicewire.realtime.voices import VoiceStore

if TYPE_CHECKING:
    from voicewire.realtime.session import SessionRuntime


@dataclass(frozen=True, slots=True, eq=False)
class ServerContext:
    """Shared state of one running server whose engine is started and warm; see `build`."""

    settings: Settings
    engine: Engine
    metrics: Metrics
    voices: VoiceStore
    """Uploaded voices; resolved by name after the engine's own voices."""
    scheduler: Scheduler
    facts: ServerFacts
    resumes: ResumeRegistry[SessionRuntime]
    """The WebSocket sessions a new connection may resume, by session id."""
    audio: AudioThreads
    """Where heavy audio work runs, off the event loop (`realtime.offload`)."""
    sessions: set[SessionRuntime] = field(default_factory=set)
    """The open WebSocket sessions."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    """Background work of sessions that outlives the call that started it (`spawn`)."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}"

    def next_session_id(self) -> str:
        """A new WebSocket session's id: `sess_000003`, after `<server_id>.` when the server has one."""
        local = self.next_id("sess")
        return local if self.settings.server_id is None else f"{self.settings.server_id}.{local}"

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` as a task held until it ends."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @classmethod
    def build(cls, settings: Settings, engine: Engine, metrics: Metrics, voices: VoiceStore,
              audio: AudioThreads) -> ServerContext:
        """The context of a started `engine`: its scheduler and session facts derive from `engine.info`."""
        info = engine.info
        s = settings
        aliases = {name: info.default_voice for name in OPENAI_VOICE_NAMES}
        # The engine's own voices match case-insensitively, and `default` names the default voice (vllm-omni's way).
        aliases.update({name.lower(): name for name in info.voices})
        aliases["default"] = info.default_voice
        aliases.update({k.lower(): v for k, v in s.voice_aliases.items()})
        facts = ServerFacts(
            info=info,
            limits=Limits(
                config_timeout_s=s.config_timeout_s, idle_timeout_s=s.idle_timeout_s,
                stall_timeout_s=s.stall_timeout_s, max_message_bytes=s.max_message_bytes,
                max_config_bytes=s.max_config_bytes, max_utterance_chars=s.max_utterance_chars,
                max_unit_chars=s.max_unit_chars, max_units_in_flight=s.max_units_in_flight,
                max_sessions=s.max_sessions, max_sessions_per_key=s.max_sessions_per_key,
                max_sessions_per_ip=s.max_sessions_per_ip, rest_requests_per_minute=s.rest_requests_per_minute,
                unit_timeout_s=s.unit_timeout_s, max_unit_audio_s=s.max_unit_audio_s,
                max_response_audio_s=s.max_response_audio_s, resume_window_s=s.resume_window_s,
                replay_buffer_bytes=s.replay_buffer_bytes),
            model_names=frozenset(s.model_aliases),
            voice_aliases=aliases,
            languages=_language_names(info.languages),
            voice_exists=voices.__contains__,
            engine_kinds=ENGINE_KINDS,
            cloning_engines=CLONING_ENGINES,
        )
        return cls(settings=settings, engine=engine, metrics=metrics, voices=voices,
                   scheduler=Scheduler(info.max_concurrency), facts=facts,
                   resumes=ResumeRegistry(s.resume_window_s), audio=audio)


@dataclass(slots=True, eq=False)
class Server:
    """One server from app creation to shutdown (the app factory makes it; the engine cleanup context sets
    `context` once the engine is warm, or `engine_error` when it failed to start)."""

    settings: Settings
    engine: Engine
    access: AccessControl
    voices: VoiceStore
    metrics: Metrics = field(default_factory=Metrics)
    audio: AudioThreads = field(default_factory=AudioThreads)
    """Threads for heavy audio work, closed at shutdown."""
    context: ServerContext | None = None
    engine_error: str | None = None
    shutting_down: bool = False

    def serving(self) -> ServerContext | None:
        """The context while the server takes new work (engine warm and not failed since, not shutting
        down), else None."""
        return None if self.shutting_down or self.engine_failure() is not None else self.context

    def engine_failure(self) -> str | None:
        """Why the engine cannot serve: it failed to start (`engine_error`) or failed after (`engine_failure`)."""
        return self.engine_error or engine_failure(self.engine)


def _language_names(codes: tuple[str, ...]) -> frozenset[str]:
    """Accept codes ("en"), regional codes ("en-us") and vllm-omni's names ("english", "auto")."""
    names = {"auto"}
    english = {"en": "english"}
    for code in codes:
        names.add(code.lower())
        if code.lower() in english:
            names.update({english[code.lower()], f"{code.lower()}-us", f"{code.lower()}-gb"})
    return frozenset(names)
