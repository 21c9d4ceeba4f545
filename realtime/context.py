"""What every session and request of one server shares: engine, scheduler, settings, metrics, voices."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from voicewire.adapters.base import Engine
from voicewire.adapters.registry import CLONING_ENGINES
from voicewire.protocol.messages import Limits
from voicewire.protocol.session import ServerFacts
from voicewire.realtime.auth import AccessControl
from voicewire.realtime.metrics import Metrics
from voicewire.realtime.scheduler import Scheduler
from voicewire.realtime.settings import OPENAI_VOICE_NAMES, Settings
from voicewire.realtime.voices import VoiceStore


@dataclass(slots=True)
class ServerContext:
    """Shared state of one running server. Created by the app factory; engine started in cleanup_ctx."""

    settings: Settings
    engine: Engine
    access: AccessControl
    metrics: Metrics = field(default_factory=Metrics)
    scheduler: Scheduler | None = None
    facts: ServerFacts | None = None
    ready: bool = False
    engine_error: str | None = None
    shutting_down: bool = False
    sessions: set[object] = field(default_factory=set)
    voices: VoiceStore | None = None
    """Uploaded voices (set up with the REST routes); resolved by name after the engine's own voices."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}"

    def on_engine_started(self) -> None:
        """Derive the scheduler and the session facts from the started engine's info."""
        info = self.engine.info
        s = self.settings
        self.scheduler = Scheduler(info.max_concurrency)
        aliases = {name: info.default_voice for name in OPENAI_VOICE_NAMES}
        aliases.update({k.lower(): v for k, v in s.voice_aliases.items()})
        self.facts = ServerFacts(
            info=info,
            limits=Limits(
                config_timeout_s=s.config_timeout_s, idle_timeout_s=s.idle_timeout_s,
                stall_timeout_s=s.stall_timeout_s, max_message_bytes=s.max_message_bytes,
                max_config_bytes=s.max_config_bytes, max_utterance_chars=s.max_utterance_chars,
                max_unit_chars=s.max_unit_chars, max_units_in_flight=s.max_units_in_flight,
                max_sessions=s.max_sessions, max_sessions_per_key=s.max_sessions_per_key,
                max_sessions_per_ip=s.max_sessions_per_ip, rest_requests_per_minute=s.rest_requests_per_minute,
                unit_timeout_s=s.unit_timeout_s),
            model_names=frozenset({info.name, *s.model_aliases}),
            voice_aliases=aliases,
            languages=_language_names(info.languages),
            voice_exists=self._uploaded_voice_exists,
            cloning_engines=CLONING_ENGINES,
        )
        self.ready = True

    def _uploaded_voice_exists(self, name: str) -> bool:
        return self.voices is not None and name in self.voices


def _language_names(codes: tuple[str, ...]) -> frozenset[str]:
    """Accept codes ("en"), regional codes ("en-us") and vllm-omni's names ("english", "auto")."""
    names = {"auto"}
    english = {"en": "english"}
    for code in codes:
        names.add(code.lower())
        if code.lower() in english:
            names.update({english[code.lower()], f"{code.lower()}-us", f"{code.lower()}-gb"})
    return frozenset(names)
