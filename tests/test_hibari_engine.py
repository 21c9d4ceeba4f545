"""The embedded hibari engine, driven through the `Engine` interface with the real model (no mocks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator

import numpy as np
import pytest
from hibari import Hibari
from hypothesis import given, settings
from hypothesis import strategies as st
from voicewire.adapters.base import Engine
from voicewire.adapters.hibari import DURATION_UNIT, MAX_TOKEN_CHARS, HibariEngine, phonemizer_text
from voicewire.protocol.engine import AudioPiece, SynthesisRequest, WordSpan

TOLKIEN = "On the 3rd of March 2024, Dr. Smith paid $9.99 to J. R. R. Tolkien's estate."
TOLKIEN_WORDS = [
    "On", "the", "3rd", "of", "March", "2024", "Dr", "Smith", "paid", "$9.99",
    "to", "J", "R", "R", "Tolkien's", "estate",
]  # fmt: skip
LONG_SENTENCE = (
    ", ".join(
        [
            "When the long winter finally ended and the rivers began to run again through the valley",
            "the farmers walked out into their muddy fields to measure how much of the soil had survived",
            "while their children chased each other between the fences and the old stone walls",
            "and the merchants in the town counted the barrels that had waited all season in their cellars",
            "hoping that the first boats of the spring would arrive before the prices started to fall",
            "because nobody in the valley could afford another year like the one that had just gone by",
        ]
    )
    + "."
)


@pytest.fixture(scope="module")
def engine() -> Iterator[HibariEngine]:
    started = HibariEngine(workers=1)
    asyncio.run(started.start())
    yield started
    asyncio.run(started.close())


async def collect(
    engine: HibariEngine, text: str, speed: float = 1.0, seed: int | None = 0
) -> list[AudioPiece]:
    request = SynthesisRequest(request_id="test", text=text, voice="heart", speed=speed, seed=seed)
    return [piece async for piece in engine.synthesize(request)]


def all_words(pieces: list[AudioPiece]) -> list[WordSpan]:
    return [word for piece in pieces for word in piece.words]


def assert_spans_well_formed(pieces: list[AudioPiece]) -> None:
    """Monotonic, non-overlapping, and each span ends inside the audio yielded so far."""
    end_of_audio = 0
    previous_end = 0
    for piece in pieces:
        end_of_audio += len(piece.samples)
        for word in piece.words:
            assert previous_end <= word.start_sample <= word.end_sample <= end_of_audio
            previous_end = word.end_sample


def test_engine_info_describes_hibari(engine: HibariEngine) -> None:
    assert isinstance(engine, Engine)
    info = engine.info
    assert (info.name, info.sample_rate, info.voices, info.default_voice) == (
        "hibari",
        24000,
        ("heart",),
        "heart",
    )
    assert info.languages == ("en",)
    assert info.capabilities.word_timings and "seed" in info.capabilities.fields and not info.capabilities.voice_cloning
    assert info.capabilities.speed_range == (0.5, 2.0)
    assert info.capabilities.streaming == "unit"
    assert info.max_concurrency == 1


@pytest.fixture(scope="module")
def raw_hibari() -> Hibari:
    """The library as published, to compare against."""
    return Hibari()


@pytest.mark.parametrize("text", ["Hello there.", LONG_SENTENCE, TOLKIEN, "Why? Because, well... no!"])
async def test_durations_sum_exactly_to_audio_length(
    engine: HibariEngine, raw_hibari: Hibari, text: str
) -> None:
    for phonemes in raw_hibari.phonemize(text):
        audio, durations = await engine.render_phonemes(phonemes, seed=1)
        assert len(durations) == len(raw_hibari.ids(phonemes))  # one per id, the two pads included
        assert int(durations.sum()) * DURATION_UNIT == len(audio)


async def test_word_spans_point_at_the_written_words(engine: HibariEngine) -> None:
    pieces = await collect(engine, TOLKIEN)
    assert len(pieces) == 1
    words = all_words(pieces)
    assert [TOLKIEN[w.char_start : w.char_end] for w in words] == TOLKIEN_WORDS
    assert_spans_well_formed(pieces)
    by_text = {TOLKIEN[w.char_start : w.char_end]: w for w in words}
    # "$9.99" is read as six words and "2024" as three; "to" is one short word
    assert by_text["$9.99"].end_sample - by_text["$9.99"].start_sample > 3 * (
        by_text["to"].end_sample - by_text["to"].start_sample
    )
    assert words[-1].end_sample < len(pieces[0].samples)  # the final period's pause is not part of "estate"


async def test_multi_sentence_unit_yields_each_sentence_with_its_words(engine: HibariEngine) -> None:
    text = "Hello there. How are you today?\nI'm fine!"
    pieces = await collect(engine, text)
    assert len(pieces) == 3
    assert [[text[w.char_start : w.char_end] for w in piece.words] for piece in pieces] == [
        ["Hello", "there"],
        ["How", "are", "you", "today"],
        ["I'm", "fine"],
    ]
    assert_spans_well_formed(pieces)
    first_piece_end = len(pieces[0].samples)
    assert all(w.start_sample >= first_piece_end for w in pieces[1].words)


async def test_long_sentence_split_by_the_model_keeps_words_in_their_piece(engine: HibariEngine) -> None:
    pieces = await collect(engine, LONG_SENTENCE)
    assert len(pieces) >= 2
    assert_spans_well_formed(pieces)
    written = [word.strip(",.") for word in LONG_SENTENCE.split()]
    assert [LONG_SENTENCE[w.char_start : w.char_end] for w in all_words(pieces)] == written
    piece_start = 0
    for piece in pieces:
        assert all(w.start_sample >= piece_start for w in piece.words)
        piece_start += len(piece.samples)


async def test_words_without_speech_get_no_span_and_odd_text_still_aligns(engine: HibariEngine) -> None:
    text = "$ 5 and 5 $ - ok"  # the lone symbols read differently in context: proportional alignment
    pieces = await collect(engine, text)
    assert_spans_well_formed(pieces)
    spoken = [text[w.char_start : w.char_end] for w in all_words(pieces)]
    assert "-" not in spoken
    assert spoken[-1] == "ok"
    assert "and" in spoken


async def test_level_is_six_db_above_raw_hibari_without_clipping(
    engine: HibariEngine, raw_hibari: Hibari
) -> None:
    (phonemes,) = raw_hibari.phonemize(TOLKIEN)
    raw = raw_hibari.from_phonemes(phonemes, seed=3)
    levelled, _ = await engine.render_phonemes(phonemes, seed=3)
    assert len(raw) == len(levelled)
    assert float(np.abs(levelled).max()) <= 0.98
    gain_db = 20 * np.log10(np.sqrt(np.mean(levelled**2)) / np.sqrt(np.mean(raw**2)))
    assert 5.5 <= gain_db <= 6.05


async def test_same_seed_gives_identical_audio(engine: HibariEngine) -> None:
    first = np.concatenate([p.samples for p in await collect(engine, "Seeds make noise repeatable.", seed=7)])
    again = np.concatenate([p.samples for p in await collect(engine, "Seeds make noise repeatable.", seed=7)])
    other = np.concatenate([p.samples for p in await collect(engine, "Seeds make noise repeatable.", seed=8)])
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


async def test_speed_two_halves_the_duration(engine: HibariEngine) -> None:
    normal = sum(len(p.samples) for p in await collect(engine, TOLKIEN, speed=1.0))
    fast = sum(len(p.samples) for p in await collect(engine, TOLKIEN, speed=2.0))
    assert 0.4 <= fast / normal <= 0.6


@pytest.mark.parametrize("text", ["", "   \n ", "... - !"])
async def test_text_without_speech_yields_nothing(engine: HibariEngine, text: str) -> None:
    before = engine.stats
    assert await collect(engine, text) == []
    assert engine.stats.completed == before.completed + 1


async def test_unknown_voice_is_refused_with_the_valid_names(engine: HibariEngine) -> None:
    request = SynthesisRequest(request_id="bad", text="Hello.", voice="emma")
    with pytest.raises(ValueError, match="heart"):
        async for _ in engine.synthesize(request):
            pass
    with pytest.raises(ValueError, match="heart"):
        HibariEngine(voice="emma")


async def wait_for_idle_worker(engine: HibariEngine) -> None:
    """Until no chunk job runs in the engine's threads (the timeout only guards against a hang)."""
    async with asyncio.timeout(60):
        while engine.stats.runs_in_flight:
            await asyncio.sleep(0.001)


async def test_cancel_terminates_the_model_run_and_frees_the_worker(engine: HibariEngine) -> None:
    before = engine.stats
    consumer = asyncio.create_task(collect(engine, LONG_SENTENCE))
    async with asyncio.timeout(60):
        while engine.stats.runs_in_flight == 0:
            await asyncio.sleep(0.001)
    consumer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await wait_for_idle_worker(engine)
    after = engine.stats
    assert after.cancelled == before.cancelled + 1
    assert after.audio_seconds == before.audio_seconds  # the terminated run produced no audio
    short = await collect(engine, "Still here.")
    assert short and short[0].words
    assert engine.stats.completed == after.completed + 1


async def test_closing_the_iterator_after_the_first_piece_stops_the_next_chunk(engine: HibariEngine) -> None:
    before = engine.stats
    request = SynthesisRequest(request_id="close", text=LONG_SENTENCE, voice="heart")
    pieces = engine.synthesize(request)
    assert isinstance(pieces, AsyncGenerator)
    first = await anext(pieces)
    assert len(first.samples) > 0
    await pieces.aclose()
    await wait_for_idle_worker(engine)
    assert engine.stats.cancelled == before.cancelled + 1
    assert engine.stats.completed == before.completed


# --- hostile text (issue 14 #4, #17) ----------------------------------------------------------------------

HOSTILE = {
    "hyphen chain": "-".join(["ab"] * 84),
    "camel case": "aB" * 125,
    "letters and digits": "a1" * 125,
    "at signs": "a@b." * 60,
    "slashes": "/".join(["ab"] * 84),
}


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab1-/. \n,'")), max_size=300))
def test_phonemizer_text_cuts_long_runs_and_maps_every_character_back(text: str) -> None:
    spoken, origin = phonemizer_text(text)
    assert all(len(run) <= MAX_TOKEN_CHARS for run in spoken.split())
    if origin is None:
        assert spoken == text
        return
    assert len(origin) == len(spoken) and origin == sorted(origin)
    kept = [i for i, index in enumerate(origin) if i == 0 or index != origin[i - 1]]
    assert "".join(spoken[i] for i in kept) == text  # only spaces were inserted


def lexicon_calls(raw_hibari: Hibari, text: str) -> int:
    """How many lexicon lookups hibari's G2P makes for `text` as our engine hands it over."""
    g2p = raw_hibari.g2p
    lexicon = g2p.lexicon
    calls = 0

    def counted(*args: object) -> object:
        nonlocal calls
        calls += 1
        return lexicon(*args)

    try:
        g2p.lexicon = type("CountedLexicon", (), {"__call__": staticmethod(counted),
                                                  "__getattr__": lambda _self, attr: getattr(lexicon, attr)})()
        raw_hibari.phonemize(phonemizer_text(text)[0])
    finally:
        g2p.lexicon = lexicon
    return calls


G2P_CALLS_PER_CHAR = MAX_TOKEN_CHARS // 2 + 4
"""k sub-tokens in a run cost about k * k / 2 lookups, and a run holds at most `MAX_TOKEN_CHARS`."""


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_g2p_work_per_character_is_bounded_for_text_built_to_be_expensive(raw_hibari: Hibari, name: str) -> None:
    """hibari's G2P tries every span of a whitespace-free run's sub-tokens against its lexicon (cubic): the
    text it gets from us keeps the lexicon lookups to a constant per character (about 60 per character and
    seconds of CPU for some of these as sent)."""
    text = HOSTILE[name]
    assert lexicon_calls(raw_hibari, text) <= G2P_CALLS_PER_CHAR * len(text)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("aB1-/@.'_ ")), min_size=1, max_size=250))
def test_g2p_work_per_character_is_bounded_for_any_unit_of_hostile_characters(raw_hibari: Hibari,
                                                                              text: str) -> None:
    assert lexicon_calls(raw_hibari, text) <= G2P_CALLS_PER_CHAR * len(text)


async def test_a_run_of_100_digits_is_spoken(engine: HibariEngine) -> None:
    """hibari's number reader raised IndexError past 36 digits; the run is read in pieces instead."""
    text = "Call " + "7" * 100 + " now."
    pieces = await collect(engine, text)
    assert sum(len(p.samples) for p in pieces) > 0
    assert_spans_well_formed(pieces)
    spoken = [text[w.char_start : w.char_end] for w in all_words(pieces)]
    assert spoken[0] == "Call" and spoken[-1] == "now"
    assert "".join(spoken[1:-1]) == "7" * 100


async def test_word_spans_of_a_cut_run_index_the_text_as_sent(engine: HibariEngine) -> None:
    text = "See " + HOSTILE["hyphen chain"] + " here."
    pieces = await collect(engine, text)
    assert_spans_well_formed(pieces)
    words = all_words(pieces)
    assert text[words[0].char_start : words[0].char_end] == "See"
    assert text[words[-1].char_start : words[-1].char_end] == "here"
    assert all(text[w.char_start : w.char_end].strip("-") for w in words)
