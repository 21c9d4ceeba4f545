"""Streamed speech is intelligible: Whisper tiny.en transcribes it with a low word error rate."""

from __future__ import annotations

import numpy as np
import websockets

from tests.asr import transcribe, word_error_rate
from tests.server import ServerThread
from tests.wsclient import configure, recv_until, send, stream_tokens

SENTENCES = (
    "The weather was cold and windy this morning.",
    "She opened the window to let in some fresh air.",
    "Our team finished the project two weeks early.",
    "Please remember to bring your umbrella tomorrow.",
    "The children played in the garden after school.",
    "He drove to the city to visit his old friend.",
    "Would you like a cup of coffee or some tea?",
    "The library closes at nine on most evenings.",
    "We watched the sunset from the top of the hill.",
    "My brother plays the guitar in a small band.",
    "The doctor said that everything looks fine.",
    "Thank you very much for your help today!",
)
TEXT = " ".join(SENTENCES)


async def speak(server: ServerThread, *, streamed: bool) -> np.ndarray:
    async with websockets.connect(server.ws_url) as ws:
        await configure(ws, split_granularity="sentence", response_format="pcm", stream_audio=True,
                        sample_rate=16000, seed=7)
        if streamed:
            await stream_tokens(ws, TEXT)
        else:
            await send(ws, {"type": "input.text", "text": TEXT})
        await send(ws, {"type": "input.done"})
        got = await recv_until(ws, "session.done")
    assert got.of("session.done")[0]["total_sentences"] >= len(SENTENCES) - 1
    pcm = b"".join(i for i in got.items if isinstance(i, bytes))
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0


async def test_token_streamed_speech_is_intelligible(server: ServerThread) -> None:
    audio = await speak(server, streamed=True)
    heard = transcribe(audio, 16000)
    assert word_error_rate(TEXT, heard) <= 0.15, heard


async def test_one_message_gives_the_same_result_as_streamed_tokens(server: ServerThread) -> None:
    streamed = await speak(server, streamed=True)
    whole = await speak(server, streamed=False)
    assert len(streamed) == len(whole), "same units, same seed: same audio length"
    heard = transcribe(whole, 16000)
    assert word_error_rate(TEXT, heard) <= 0.15, heard
