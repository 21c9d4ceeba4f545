"""voicewire-client: an asyncio client and CLI for the voicewire realtime speech WebSocket.

    async with connect("ws://127.0.0.1:8000/v1/audio/speech/stream", token=key) as session:
        await session.configure(voice="heart", word_timestamps=True)
        result = await speak(session, llm_tokens())     # any str, iterable or async iterable of deltas
        result.audio.write_wav("answer.wav")

See `docs/clients.md` in the voicewire repository for the full guide.
"""

from voicewire_client.audio import DECODABLE_FORMATS, Audio, UnitDecoder
from voicewire_client.events import (
    AudioCancelled,
    AudioData,
    AudioDone,
    AudioStart,
    AudioWords,
    EngineInfo,
    ErrorEvent,
    Event,
    SessionDone,
    SessionUpdated,
    UnknownEvent,
    WordTiming,
    decode_event,
    parse_event,
)
from voicewire_client.play import SoundCardPlayer, sounddevice_available
from voicewire_client.session import (
    STREAMING_DEFAULTS,
    ConnectError,
    ServerError,
    Session,
    SessionClosedError,
    VoicewireError,
    connect,
    stream_url,
)
from voicewire_client.speak import SpeechCollector, SpeechResult, TextSource, speak, stream

__all__ = [
    "DECODABLE_FORMATS",
    "STREAMING_DEFAULTS",
    "Audio",
    "AudioCancelled",
    "AudioData",
    "AudioDone",
    "AudioStart",
    "AudioWords",
    "ConnectError",
    "EngineInfo",
    "ErrorEvent",
    "Event",
    "ServerError",
    "Session",
    "SessionClosedError",
    "SessionDone",
    "SessionUpdated",
    "SoundCardPlayer",
    "SpeechCollector",
    "SpeechResult",
    "TextSource",
    "UnitDecoder",
    "UnknownEvent",
    "VoicewireError",
    "WordTiming",
    "connect",
    "decode_event",
    "parse_event",
    "sounddevice_available",
    "speak",
    "stream",
    "stream_url",
]
