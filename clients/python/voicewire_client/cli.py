"""`voicewire-client say "text" [-o out.wav] [--voice V] [--speed S] [--format F] [--timestamps] [--stats]`.

`say -` reads stdin as it arrives (`my-llm | voicewire-client say -`) and sends each piece at once, so
speech starts on the first sentence while the rest is still being written.

The output file's extension picks the format: `.wav` (16-bit WAV) and `.pcm`/`.raw` (s16le samples) are
written from audio streamed as it is synthesized; `.flac`, `.mp3`, `.opus`/`.ogg` and `.aac` are the one
whole file per utterance the server encodes. A `--format` that contradicts the extension is refused.

Exit status: 0 when the utterance was spoken, 1 on a connection or server error or when nothing was
spoken (with a one-line message on stderr), 2 on a usage error (empty text, format and file disagree).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import os
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO, Final, TextIO

from voicewire_client.audio import DECODABLE_FORMATS, Audio
from voicewire_client.events import AudioData, AudioWords
from voicewire_client.play import SoundCardPlayer, sounddevice_available
from voicewire_client.session import VoicewireError, connect
from voicewire_client.speak import SpeechCollector, SpeechResult, stream

DEFAULT_URL = "ws://127.0.0.1:8000/v1/audio/speech/stream"
FORMATS = ("pcm", "wav", "mulaw", "alaw", "flac", "mp3", "opus", "aac")

WHOLE_FILE_EXTENSIONS: Final = {".flac": "flac", ".mp3": "mp3", ".opus": "opus", ".ogg": "opus", ".aac": "aac"}
"""Output extensions that are one whole encoded file, and the wire format that gives it."""
SAMPLE_EXTENSIONS: Final = frozenset({".wav", ".pcm", ".raw"})
"""Output extensions written from decoded samples: `.wav` as a 16-bit WAV file, the others as raw s16le."""


class UsageError(Exception):
    """The command line cannot work as given; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voicewire-client", description="Talk to a voicewire speech server")
    sub = parser.add_subparsers(dest="command", required=True)
    say = sub.add_parser("say", help="speak text (or stdin with '-') and save or play the audio")
    say.add_argument("text", help="the text to speak, or '-' to stream stdin as it arrives")
    say.add_argument("-o", "--output", help="write audio here, in the format its extension names: .wav (16-bit "
                     "WAV), .pcm/.raw (s16le), .flac, .mp3, .opus/.ogg, .aac; another name gets raw s16le, or "
                     "--format's whole file; '-' writes raw audio to stdout as it arrives. Without it, play "
                     "through the sound card (needs sounddevice)")
    say.add_argument("--url", default=os.environ.get("VOICEWIRE_URL", DEFAULT_URL),
                     help="server WebSocket URL, or http://host:port (default: $VOICEWIRE_URL or %(default)s)")
    say.add_argument("--token", default=os.environ.get("VOICEWIRE_TOKEN"),
                     help="API key (default: $VOICEWIRE_TOKEN)")
    say.add_argument("--voice", help="a server voice (default: the engine's)")
    say.add_argument("--speed", type=float, help="0.25-4.0 (default 1.0)")
    say.add_argument("--format", choices=FORMATS,
                     help="audio format on the wire (default: what the output extension names, else pcm; "
                     "flac/mp3/opus/aac come as one whole file)")
    say.add_argument("--sample-rate", type=int, help="output rate in Hz (default: the engine's)")
    say.add_argument("--timestamps", action="store_true", help="print each word's time span as it arrives")
    say.add_argument("--stats", action="store_true", help="print time to first audio and audio length")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.format = wire_format(args.output, args.format)
        if args.text != "-" and not args.text.strip():
            raise UsageError("nothing to say: the text is empty")
        if args.output is None and not sounddevice_available():
            raise UsageError("no output: pass -o FILE.wav, or install voicewire-client[play] to play through "
                             "the sound card")
    except UsageError as exc:
        print(f"voicewire-client: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_say(args))
    except VoicewireError as exc:
        print(f"voicewire-client: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.stats:
        _print_stats(result, _report_stream(args))
    return 0


def wire_format(output: str | None, requested: str | None) -> str:
    """The format to ask the server for, given the output file and `--format` (None: not given). Raises
    `UsageError` when they disagree (Ogg/Opus bytes in a `.wav` file, pcm in an `.mp3`)."""
    suffix = Path(output).suffix.lower() if output not in (None, "-") else ""
    named = WHOLE_FILE_EXTENSIONS.get(suffix)
    if named is not None:
        if requested not in (None, named):
            raise UsageError(f"-o {output} is for {named} audio but --format is {requested}; drop --format "
                             "(the extension picks the format) or rename the file")
        return named
    if suffix in SAMPLE_EXTENSIONS and requested is not None and requested not in DECODABLE_FORMATS:
        raise UsageError(f"-o {output} is written from decoded samples, but --format {requested} comes as one "
                         f"encoded file; name the file .{requested} or pick one of "
                         f"{', '.join(sorted(DECODABLE_FORMATS))}")
    return requested or "pcm"


def _report_stream(args: argparse.Namespace) -> TextIO:
    """Reports go to stdout, unless stdout carries the audio."""
    return sys.stderr if args.output == "-" else sys.stdout


async def _say(args: argparse.Namespace) -> SpeechResult:
    streamable = args.format in DECODABLE_FORMATS
    report = _report_stream(args)
    text = stdin_deltas() if args.text == "-" else args.text
    async with connect(args.url, token=args.token) as session:
        await session.configure(voice=args.voice, speed=args.speed, response_format=args.format,
                                sample_rate=args.sample_rate, stream_audio=streamable,
                                split_granularity="sentence" if streamable else "none",
                                word_timestamps=True if args.timestamps else None)
        collector = SpeechCollector()
        raw_out: BinaryIO | None = sys.stdout.buffer if args.output == "-" else None
        player: SoundCardPlayer | None = None
        try:
            async for event in stream(session, collector.timed(text)):
                samples = collector.add(event)
                if isinstance(event, AudioData) and raw_out is not None:
                    raw_out.write(event.data)
                    raw_out.flush()
                if samples is not None and args.output is None:
                    if player is None:
                        player = SoundCardPlayer(collector.units[-1].sample_rate)
                    await player.write(samples)
                if isinstance(event, AudioWords) and args.timestamps:
                    for word in event.words:
                        print(f"{word.start_ms / 1000:8.3f} {word.end_ms / 1000:8.3f}  {word.word}", file=report,
                              flush=True)
        except BaseException:
            if player is not None:
                player.abort()
            raise
        if player is not None:
            await player.close()
    result = collector.finish()
    if not result.units:
        raise NothingSpokenError("nothing was spoken: the text has no words to say")
    if args.output not in (None, "-"):
        _write_output(Path(args.output), result.audio)
    return result


class NothingSpokenError(VoicewireError):
    """The server spoke no unit of the text (only whitespace or punctuation arrived)."""


def _write_output(path: Path, audio: Audio) -> None:
    if audio.encoded:
        path.write_bytes(audio.encoded)
    elif path.suffix.lower() == ".wav" or audio.format == "wav":
        audio.write_wav(path)
    else:
        path.write_bytes(audio.samples.astype("<i2").tobytes())


def _print_stats(result: SpeechResult, out: TextIO) -> None:
    ttfa = "n/a" if result.first_audio_s is None else f"{result.first_audio_s * 1000:.0f} ms"
    done = result.done
    server = "" if done is None or done.first_audio_ms is None else f" (server {done.first_audio_ms:.0f} ms)"
    audio_s = (done.audio_ms / 1000) if done is not None else result.audio.duration_s
    print(f"TTFA {ttfa}{server}; {audio_s:.2f} s of audio in {len(result.units)} units", file=out, flush=True)


async def stdin_deltas() -> AsyncIterator[str]:
    """Yield stdin's text as it arrives (whatever each read returns), decoded as UTF-8.

    A daemon thread does the blocking reads, so an early exit never waits on stdin.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    fd = sys.stdin.fileno()

    def pump() -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            try:
                loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except RuntimeError:  # the loop is closed: nobody listens any more
                return
            if not chunk:
                return

    threading.Thread(target=pump, name="voicewire-client-stdin", daemon=True).start()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := await queue.get():
        if text := decoder.decode(chunk):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


if __name__ == "__main__":
    sys.exit(main())
