"""Bad input over a real WebSocket: each gets its documented error and fatality, and nothing is lost."""

from __future__ import annotations

import json
from typing import Any

import pytest
import websockets

from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send

SPEAK = {"split_granularity": "sentence", "response_format": "pcm", "stream_audio": True}


async def still_speaks(ws: websockets.ClientConnection) -> None:
    """The session is still usable: a short utterance comes back whole."""
    await send(ws, {"type": "input.text", "text": "Still working."})
    await send(ws, {"type": "input.done"})
    got = await recv_until(ws, "session.done")
    assert got.of("audio.done")[0]["error"] is False
    assert any(isinstance(i, bytes) for i in got.items)


NON_FATAL: list[tuple[str, Any, str, str]] = [
    ("invalid json", "{not json", "invalid_json", "Invalid JSON message"),
    # Malformed after a field of the wrong type: the typed decode stops at the field, the untyped one that
    # classifies the error meets the malformed part (this ended the session with 1011).
    ("malformed after a wrong type", '{"type": 5, "speed": NaN}', "invalid_json", "Invalid JSON message"),
    ("truncated after a wrong type", '{"type": "input.text", "text": 5, "x": ', "invalid_json",
     "Invalid JSON message"),
    ("json array", "[1, 2, 3]", "invalid_message", "WebSocket messages must be JSON objects"),
    ("json string", '"hello"', "invalid_message", "WebSocket messages must be JSON objects"),
    ("unknown type", {"type": "input.shout"}, "unknown_type", "Unknown message type: input.shout"),
    ("missing type", {"text": "hi"}, "unknown_type", "Unknown message type: None"),
    ("text is a number", {"type": "input.text", "text": 5}, "invalid_text", "input.text requires a string value"),
    ("speed out of range", {"type": "session.config", "speed": 9}, "invalid_config", "Invalid session config"),
    ("sample rate out of range", {"type": "session.config", "sample_rate": 100}, "invalid_config",
     "Invalid session config"),
    ("unknown voice", {"type": "session.config", "voice": "nobody"}, "invalid_config", "valid voices: "),
    ("unknown format", {"type": "session.config", "response_format": "aiff"}, "invalid_config",
     "Invalid session config"),
    ("stream a compressed format", {"type": "session.config", "stream_audio": True, "response_format": "mp3"},
     "invalid_config", "stream_audio=true needs one of"),
    ("instructions on hibari", {"type": "session.config", "instructions": "whisper"}, "invalid_config",
     "instructions: not supported by engine hibari"),
    ("voice cloning on hibari", {"type": "session.config", "ref_audio": "data:,"}, "invalid_config",
     "cannot clone voices"),
    ("codec chunking on hibari", {"type": "session.config", "initial_codec_chunk_frames": 2}, "invalid_config",
     "not a codec-token engine"),
    ("extra_params on hibari", {"type": "session.config", "extra_params": {"temperature": 0.5}}, "invalid_config",
     "extra_params: not supported by engine hibari"),
    ("ambient_sound on hibari", {"type": "session.config", "ambient_sound": "rain"}, "invalid_config",
     "ambient_sound: not supported by engine hibari"),
    # vllm-omni's streaming_mode: token_level is our text streaming (test_vllm_omni_compat); anything else
    # is refused naming the field and the values there are, never ignored.
    ("unknown streaming mode", {"type": "session.config", "streaming_mode": "sentence_level"}, "invalid_config",
     "at `$.streaming_mode`; valid values: token_level"),
    ("token-level streaming of a compressed format", {"type": "session.config", "streaming_mode": "token_level",
                                                      "response_format": "mp3"}, "invalid_config",
     "streaming_mode: token_level streams audio as it is synthesized, which needs response_format one of"),
    ("unknown model", {"type": "session.config", "model": "gpt-9"}, "invalid_config", "unknown model"),
    ("deeply nested json", '{"type": "input.text", "text": "x", "deep": ' + "[" * 50_000 + "]" * 50_000 + "}",
     "invalid_message", "JSON nested too deeply"),
    ("deeply nested array", "[" * 20_000 + "]" * 20_000, "invalid_message", "JSON nested too deeply"),
    # Numbers too large for a float or any fixed-size int (issue 14 #6): these ended the session with 1011.
    ("speed of 1e400", '{"type": "session.config", "speed": 1e400}', "invalid_config",
     "Number out of range - at `$.speed`"),
    ("sample rate of -1e400", '{"type": "session.config", "sample_rate": -1e400}', "invalid_config",
     "Number out of range - at `$.sample_rate`"),
    ("delay of 1e400", '{"type": "session.config", "max_buffer_delay_ms": 1e400}', "invalid_config",
     "at `$.max_buffer_delay_ms`"),
    ("speaker embedding of 1e400", '{"type": "session.config", "speaker_embedding": [0.5, 1e400]}',
     "invalid_config", "at `$.speaker_embedding[1]`"),
    ("seed of 10**400", '{"type": "session.config", "seed": 1' + "0" * 400 + "}", "invalid_config",
     "at `$.seed`"),
    ("max_new_tokens of 10**400", '{"type": "session.config", "max_new_tokens": 1' + "0" * 400 + "}",
     "invalid_config", "not a codec-token engine"),
    ("text of 1e400", '{"type": "input.text", "text": 1e400}', "invalid_text", "input.text requires a string"),
    ("context id of 1e400", '{"type": "input.text", "text": "x", "context_id": 1e400}', "invalid_message",
     "at `$.context_id`"),
    ("type of 1e400", '{"type": 1e400}', "unknown_type", "Unknown message type: inf"),
    ("oversized input.text", {"type": "input.text", "text": "a" * (130 * 1024)}, "message_too_large",
     "input.text message too large"),
    ("oversized input.cancel", {"type": "input.cancel", "context_id": "c" * (130 * 1024)}, "message_too_large",
     "input.cancel message too large"),
]


@pytest.mark.parametrize(("name", "frame", "code", "message"), NON_FATAL, ids=[c[0] for c in NON_FATAL])
async def test_bad_input_after_config_is_a_non_fatal_error(server: ServerThread, name: str, frame: Any, code: str,
                                                           message: str) -> None:
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        before = await configure(ws, **SPEAK)
        await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["code"] == code and message in error["message"] and error["fatal"] is False
        if code == "invalid_config" and "$." in message:
            assert error["param"] == message.partition("$.")[2].partition("`")[0].partition("[")[0]
        if code == "invalid_config":
            # The old config is kept: still pcm streaming.
            await send(ws, {"type": "input.text", "text": "Kept."})
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "session.done")
            assert got.of("audio.start")[0]["format"] == before["config"]["response_format"]
        await still_speaks(ws)


async def test_binary_frames_from_the_client_are_refused(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **SPEAK)
        await ws.send(b"\x00\x01\x02")
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["code"] == "binary_not_supported" and not error["fatal"]
        await still_speaks(ws)


async def test_reconfig_mid_utterance_keeps_the_old_config_and_the_text(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **SPEAK)
        await send(ws, {"type": "input.text", "text": "Half a sent"})
        await send(ws, {"type": "session.config", "response_format": "wav"})
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["code"] == "reconfig_during_utterance" and not error["fatal"]
        assert "send input.done first" in error["message"]
        await send(ws, {"type": "input.text", "text": "ence."})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    start = got.of("audio.start")[0]
    assert start["sentence_text"] == "Half a sentence." and start["format"] == "pcm"


@pytest.mark.parametrize(("first", "message"), [
    ({"type": "input.text", "text": "hi"}, "Expected session.config, got: input.text"),
    ({"type": "input.done"}, "Expected session.config, got: input.done"),
    ({"type": "session.config", "speed": 0}, "Invalid session config"),
    ({"type": "session.config", "voice": "nobody"}, "unknown voice"),
    ("not json", "Invalid JSON message"),
])
async def test_a_missing_or_invalid_first_config_is_fatal(server: ServerThread, first: Any, message: str) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(first if isinstance(first, str) else json.dumps(first))
        got = await recv_until(ws, "error")
        error = got.of("error")[0]
        assert message in error["message"] and error["fatal"] is True
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_utterance_size_and_frame_size_limits() -> None:
    from voicewire.realtime.settings import Settings

    srv = ServerThread(Settings(max_utterance_chars=40, max_config_bytes=64 * 1024, max_message_bytes=1024))
    try:
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            updated = await configure(ws, **SPEAK)
            assert updated["limits"]["max_utterance_chars"] == 40
            await send(ws, {"type": "input.text", "text": "Twenty characters!! "})
            await send(ws, {"type": "input.text", "text": "x" * 30})
            error = (await recv_until(ws, "error")).of("error")[0]
            assert error["code"] == "utterance_too_large" and not error["fatal"]
            await send(ws, {"type": "input.done"})
            got = await recv_until(ws, "session.done")
            assert [e["sentence_text"] for e in got.of("audio.start")] == ["Twenty characters!!"]
            # A frame beyond the transport limit closes with 1009 (message too big).
            await ws.send(json.dumps({"type": "input.text", "text": "y" * (70 * 1024)}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        # The server is unharmed.
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **SPEAK)
            await still_speaks(ws)
    finally:
        srv.stop()


async def test_config_timeout_and_idle_timeout_close_the_session() -> None:
    from voicewire.realtime.settings import Settings

    srv = ServerThread(Settings(config_timeout_s=0.3, idle_timeout_s=0.5))
    try:
        async with websockets.connect(srv.ws_url) as ws:
            got = await recv_until(ws, "error")
            assert got.of("error")[0]["message"] == "Timeout waiting for session.config"
            assert got.of("error")[0]["fatal"] is True
        async with websockets.connect(srv.ws_url) as ws:
            await configure(ws, **SPEAK)
            got = await recv_until(ws, "error")
            assert got.of("error")[0]["message"] == "Idle timeout: no message received"
    finally:
        srv.stop()


async def test_a_burst_of_refused_deltas_is_answered_in_full_without_closing(server: ServerThread) -> None:
    """Hundreds of errors queued faster than they are sent pause the reader instead of closing."""
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **SPEAK)
        for n in range(400):
            await ws.send(json.dumps({"type": "input.shout", "n": n}))
        got = await recv_until(ws, "error", count=400)
        assert len(got.of("error")) == 400
        await still_speaks(ws)


async def test_session_close_closes_with_1000(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **SPEAK)
        await send(ws, {"type": "session.close"})
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000


HUGE = "v" * (4 * 1024 * 1024 - 1024)
"""Just under the transport's 4 MiB frame cap for a session.config."""


@pytest.mark.parametrize(("frame", "code", "keeps"), [
    ({"type": "session.config", "voice": HUGE}, "invalid_config", "valid voices: "),
    ({"type": "session.config", "model": HUGE}, "invalid_config", "this server serves "),
    ({"type": "session.config", "language": HUGE}, "invalid_config", "supported: "),
    ({"type": "session.config", "response_format": HUGE}, "invalid_config", "at `$.response_format`"),
    ({"type": HUGE[:100_000]}, "unknown_type", "Unknown message type: vvv"),
], ids=["voice", "model", "language", "format", "type"])
async def test_an_error_quotes_only_a_clip_of_a_huge_value(server: ServerThread, frame: dict[str, Any], code: str,
                                                           keeps: str) -> None:
    """Issue 14 #17: a 4 MiB voice name came back whole in the error."""
    from voicewire.protocol.messages import ERROR_MESSAGE_CHARS

    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **SPEAK)
        await send(ws, frame)
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["code"] == code and not error["fatal"] and keeps in error["message"]
        assert len(error["message"]) <= ERROR_MESSAGE_CHARS + 40
        await still_speaks(ws)


async def test_a_context_mismatch_quotes_only_a_clip_of_the_context_id(server: ServerThread) -> None:
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, **SPEAK)
        await send(ws, {"type": "input.text", "text": "Hello", "context_id": "a"})
        await send(ws, {"type": "input.text", "text": "x", "context_id": "c" * 100_000})
        error = (await recv_until(ws, "error")).of("error")[0]
        assert error["code"] == "context_mismatch" and len(error["message"]) < 400
        assert "'a' is open" in error["message"]
