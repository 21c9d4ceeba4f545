"""Segmenter: where streamed text is cut into synthesis units, whatever the delta sizes."""

# ruff: noqa: RUF001

from __future__ import annotations

import itertools
import random
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from voicewire.protocol.segmenter import Segment, Segmenter, SplitGranularity, speakable

GRANULARITIES: tuple[SplitGranularity, ...] = ("none", "sentence", "clause")


def feed(segmenter: Segmenter, deltas: list[str], now_ms: float = 0.0) -> list[Segment]:
    segments: list[Segment] = []
    for delta in deltas:
        segments += segmenter.push(delta, now_ms)
    return segments + segmenter.flush()


def random_deltas(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    deltas: list[str] = []
    i = 0
    while i < len(text):
        size = rng.randint(1, 4)
        deltas.append(text[i : i + size])
        i += size
    return deltas


def assert_covers(segments: list[Segment], text: str, *, timer: bool = False) -> None:
    """Exact, contiguous coverage; a whitespace-only unit only as flush()'s whole output.

    With the delay timer, flush() may also return trailing whitespace pushed after a timer cut.
    """
    assert "".join(s.text for s in segments) == text
    offset = 0
    for segment in segments:
        assert segment.text
        assert segment.start == offset
        assert segment.end == offset + len(segment.text)
        assert text[segment.start : segment.end] == segment.text
        offset = segment.end
    whitespace_only = [s for s in segments if not s.text.strip()]
    assert not whitespace_only or whitespace_only == segments[-1:]
    assert timer or len(whitespace_only) == 0 or len(segments) == 1


GOLDEN: list[tuple[str, dict[str, Any], str, list[str]]] = [
    # Plain sentences, questions, exclamations.
    ("sentence", {}, "Hello world. How are you?", ["Hello world.", "How are you?"]),
    ("sentence", {}, "Really?! Yes! No?", ["Really?!", "Yes!", "No?"]),
    ("sentence", {}, "Hello", ["Hello"]),
    ("sentence", {}, "", []),
    ("sentence", {}, "   ", [""]),
    ("sentence", {}, "This is fine. and this continues.", ["This is fine. and this continues."]),
    ("sentence", {}, "I am 25. Then I grew.", ["I am 25.", "Then I grew."]),
    ("sentence", {}, "So do I. What about you?", ["So do I.", "What about you?"]),
    # Numbers.
    ("sentence", {}, "Pi is 3.14 exactly. Yes.", ["Pi is 3.14 exactly.", "Yes."]),
    ("sentence", {}, "We sold 1,000 units. Great.", ["We sold 1,000 units.", "Great."]),
    ("sentence", {}, "Version 1.2.3 is out. Update now.", ["Version 1.2.3 is out.", "Update now."]),
    ("sentence", {}, "Prices rose 2.5% in Q3. Markets fell.", ["Prices rose 2.5% in Q3.", "Markets fell."]),
    # Abbreviations and initials.
    ("sentence", {}, "Dr. Smith went home. He slept.", ["Dr. Smith went home.", "He slept."]),
    ("sentence", {}, "Mr. and Mrs. Jones arrived. They sat.", ["Mr. and Mrs. Jones arrived.", "They sat."]),
    ("sentence", {}, "I met Ms. Smith and Mr. Jones Jr. yesterday.", ["I met Ms. Smith and Mr. Jones Jr. yesterday."]),
    (
        "sentence",
        {},
        "Prof. Xu met St. John at 5 p.m. today. Fine.",
        ["Prof. Xu met St. John at 5 p.m. today.", "Fine."],
    ),
    ("sentence", {}, "Apples, pears, etc. Are all fruit.", ["Apples, pears, etc. Are all fruit."]),
    ("sentence", {}, "Use e.g. this or i.e. that. Done.", ["Use e.g. this or i.e. that.", "Done."]),
    ("sentence", {}, "He joined the U.S. Army then. It was big.", ["He joined the U.S. Army then.", "It was big."]),
    ("sentence", {}, "The U.K. is small. Yes.", ["The U.K. is small.", "Yes."]),
    ("sentence", {}, "J. R. R. Tolkien wrote books. They sold.", ["J. R. R. Tolkien wrote books.", "They sold."]),
    ("sentence", {}, "No. 5 is mine. No. I refuse.", ["No. 5 is mine.", "No.", "I refuse."]),
    ("sentence", {}, "See Fig. 3 for details. Thanks.", ["See Fig. 3 for details.", "Thanks."]),
    ("sentence", {}, "It's approx. 5 km. Go.", ["It's approx. 5 km.", "Go."]),
    ("sentence", {}, "Acme Inc. Ltd. vs. Foo Corp. won.", ["Acme Inc. Ltd. vs. Foo Corp. won."]),
    # Ellipses.
    ("sentence", {}, "Wait... what happened? Nothing.", ["Wait... what happened?", "Nothing."]),
    ("sentence", {}, "Wait… what? Fine.", ["Wait… what?", "Fine."]),
    ("sentence", {}, "Wait... Then it ended.", ["Wait...", "Then it ended."]),
    ("sentence", {}, "Hmm… Okay then.", ["Hmm…", "Okay then."]),
    # URLs and e-mail addresses.
    (
        "sentence",
        {},
        "Visit example.com today. Or mail me@example.org now.",
        ["Visit example.com today.", "Or mail me@example.org now."],
    ),
    ("sentence", {}, "Go to https://a.b/c?d=1 now. Bye.", ["Go to https://a.b/c?d=1 now.", "Bye."]),
    # Closing quotes and brackets.
    ("sentence", {}, 'He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("sentence", {}, '"Why?" she asked. "Because."', ['"Why?" she asked.', '"Because."']),
    ("sentence", {}, '"Stop!" he yelled. Okay.', ['"Stop!" he yelled.', "Okay."]),
    ("sentence", {}, "(This is it.) Next one.", ["(This is it.)", "Next one."]),
    ("sentence", {}, "He said ‘no.’ She agreed.", ["He said ‘no.’", "She agreed."]),
    # CJK.
    ("sentence", {}, "你好。世界！再见？", ["你好。", "世界！", "再见？"]),
    ("sentence", {}, "「こんにちは。」「さようなら。」", ["「こんにちは。」", "「さようなら。」"]),
    ("sentence", {}, "数值是３．１４。好的。", ["数值是３．１４。", "好的。"]),
    ("sentence", {}, "等等……你好。", ["等等……", "你好。"]),
    ("sentence", {}, "안녕하세요. 반갑습니다.", ["안녕하세요.", "반갑습니다."]),
    ("sentence", {}, "OK. 你好。 Bye.", ["OK.", "你好。", "Bye."]),
    # Whitespace.
    ("sentence", {}, "Hello.   \n  World.", ["Hello.", "World."]),
    ("sentence", {}, "One.  Two.\tThree.\n", ["One.", "Two.", "Three."]),
    ("sentence", {}, "   Hello. World.", ["Hello.", "World."]),
    ("sentence", {}, "Heading here\n\nSecond paragraph here", ["Heading here", "Second paragraph here"]),
    ("sentence", {}, "line one\nline two", ["line one\nline two"]),
    ("sentence", {}, "Steps:\n1. Open the box.\n2. Remove it.", ["Steps:\n1. Open the box.", "2. Remove it."]),
    # Fast first unit (sentence mode).
    ("sentence", {}, "Call me at 10:30, okay? Sure.", ["Call me at 10:30,", "okay?", "Sure."]),
    (
        "sentence",
        {},
        "Well, I think that, you know, it works. And, then, more.",
        ["Well, I think that,", "you know, it works.", "And, then, more."],
    ),
    (
        "sentence",
        {"fast_first_unit": False},
        "Well, I think that, you know, it works. And, then, more.",
        ["Well, I think that, you know, it works.", "And, then, more."],
    ),
    ("sentence", {}, "So here is the thing — it works. Yes.", ["So here is the thing —", "it works.", "Yes."]),
    (
        "sentence",
        {"first_unit_min_words": 5},
        "One two three, four five six seven. End.",
        ["One two three, four five six seven.", "End."],
    ),
    ("sentence", {}, "We have 1,000,000 users, wow.", ["We have 1,000,000 users,", "wow."]),
    # Clause mode.
    (
        "clause",
        {},
        "First, we go home, then we eat; after that: sleep.",
        ["First, we go home,", "then we eat;", "after that:", "sleep."],
    ),
    ("clause", {}, "We sold 1,000 units, and 2,500 more.", ["We sold 1,000 units,", "and 2,500 more."]),
    ("clause", {}, "Yes, no, maybe so.", ["Yes, no,", "maybe so."]),
    ("clause", {}, "今天天气很好，我们去公园吧。好的。", ["今天天气很好，", "我们去公园吧。", "好的。"]),
    ("clause", {}, "The time is 10:30 – late, very late.", ["The time is 10:30 –", "late, very late."]),
    ("clause", {}, "A well—known fact, sadly.", ["A well—known fact,", "sadly."]),
    ("clause", {}, 'She said "yes, of course," and left.', ['She said "yes,', 'of course,"', "and left."]),
    ("clause", {}, "Dr. Lee, the surgeon, is here.", ["Dr. Lee,", "the surgeon,", "is here."]),
    # None mode: one unit at flush, never split.
    ("none", {}, "Hello world. How are you? Fine, thanks.", ["Hello world. How are you? Fine, thanks."]),
    # none mode keeps the unit cap too (issue 14 #4): past it, sentences are packed, long ones cut at words.
    ("none", {"max_unit_chars": 5}, "one two three four", ["one", "two", "three", "four"]),
    ("none", {"max_unit_chars": 20}, "One. Two. Three four five six.", ["One. Two.", "Three four five six."]),
    ("none", {}, "", []),
    # Force split at the length cap.
    (
        "sentence",
        {"max_unit_chars": 20},
        "one two three four five six seven eight nine ten",
        ["one two three four", "five six seven eight", "nine ten"],
    ),
    (
        "sentence",
        {"max_unit_chars": 10},
        "abcdefghijklmnopqrstuvwxyz end",
        ["abcdefghij", "klmnopqrst", "uvwxyz end"],
    ),
    (
        "clause",
        {"max_unit_chars": 30},
        "alpha beta, gamma delta epsilon zeta eta theta iota kappa.",
        ["alpha beta,", "gamma delta epsilon zeta eta", "theta iota kappa."],
    ),
    (
        "sentence",
        {"max_unit_chars": 20},
        "Short one. this sentence has no real end at all",
        ["Short one. this", "sentence has no real", "end at all"],
    ),
    # Mixed.
    (
        "sentence",
        {},
        'Dr. Lee said: "It costs $3.50." Then she left... Why? 因为太贵了。Okay.',
        ["Dr. Lee said:", '"It costs $3.50."', "Then she left...", "Why?", "因为太贵了。", "Okay."],
    ),
]


@pytest.mark.parametrize(
    ("granularity", "options", "text", "expected"),
    GOLDEN,
    ids=[f"{g}-{i}-{t[:24]}" for i, (g, _, t, _) in enumerate(GOLDEN)],
)
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_golden_segments_whole_and_in_small_deltas(
    granularity: SplitGranularity, options: dict[str, Any], text: str, expected: list[str], seed: int | None
) -> None:
    deltas = [text] if seed is None else random_deltas(text, seed)
    segments = feed(Segmenter(granularity, **options), deltas)
    assert_covers(segments, text)
    assert [s.text.strip() for s in segments] == expected


def test_whitespace_between_sentences_ends_the_earlier_segment() -> None:
    segments = feed(Segmenter(), ["Hello.  \n World. ", " Again."])
    assert [s.text for s in segments] == ["Hello.  \n ", "World.  ", "Again."]


def test_boundary_waits_for_the_next_non_space_character() -> None:
    segmenter = Segmenter()
    assert segmenter.push("Dr", 0) == []
    assert segmenter.push(".", 0) == []
    assert segmenter.push(" ", 0) == []
    assert segmenter.push("Sm", 0) == []
    assert segmenter.push("ith left.", 0) == []
    assert segmenter.push("  ", 0) == []
    [segment] = segmenter.push("He", 0)
    assert segment == Segment(0, 17, "Dr. Smith left.  ")
    assert segmenter.pending_text == "He"


def test_cjk_boundary_commits_on_the_next_character() -> None:
    segmenter = Segmenter()
    assert segmenter.push("你好。", 0) == []
    assert [s.text for s in segmenter.push("世", 0)] == ["你好。"]


def test_fast_first_unit_applies_only_to_the_first_unit() -> None:
    segmenter = Segmenter()
    first = segmenter.push("One two three, four. Five six seven, eight. X", 0)
    assert [s.text for s in first] == ["One two three, ", "four. ", "Five six seven, eight. "]


def test_reset_restarts_offsets_and_the_first_unit() -> None:
    segmenter = Segmenter()
    feed(segmenter, ["Hello there. Bye"])
    segmenter.reset()
    assert segmenter.pending_text == ""
    segments = feed(segmenter, ["Alpha beta gamma, delta. End"])
    assert segments[0] == Segment(0, 18, "Alpha beta gamma, ")


def test_flush_with_nothing_pending_returns_nothing() -> None:
    segmenter = Segmenter()
    assert segmenter.flush() == []
    segmenter.push("Hi. There", 0)
    segmenter.flush()
    assert segmenter.flush() == []


def test_none_mode_keeps_everything_pending_until_flush() -> None:
    segmenter = Segmenter("none", max_buffer_delay_ms=10)
    assert segmenter.push("Hello. World. ", 0) == []
    assert segmenter.poll(10_000) == []
    assert segmenter.next_deadline_ms() is None
    assert segmenter.pending_text == "Hello. World. "
    assert segmenter.flush() == [Segment(0, 14, "Hello. World. ")]


@pytest.mark.parametrize(
    "options",
    [
        {"granularity": "word"},
        {"max_buffer_delay_ms": -1},
        {"max_unit_chars": 0},
        {"first_unit_min_words": 0},
    ],
)
def test_invalid_options_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Segmenter(**options)


def test_a_long_token_stream_is_covered_exactly() -> None:
    text = "This is a sentence, with 3.14 and Dr. Who in it. " * 4000
    segmenter = Segmenter("clause")
    segments = feed(segmenter, random_deltas(text, 7))
    assert_covers(segments, text)
    assert len(segments) == 8000


# --- max_buffer_delay_ms ---------------------------------------------------------------------------


def test_buffer_delay_commits_up_to_the_last_word_boundary() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=500)
    assert segmenter.push("Hello wor", 0) == []
    assert segmenter.next_deadline_ms() == 500
    assert segmenter.poll(499) == []
    assert segmenter.poll(500) == [Segment(0, 6, "Hello ")]
    assert segmenter.pending_text == "wor"
    assert segmenter.next_deadline_ms() is None  # a lone partial word waits for more text


def test_overdue_text_is_cut_by_the_push_that_completes_a_word() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=500)
    segmenter.push("Hello wor", 0)
    segmenter.poll(500)
    assert segmenter.push("ld ", 600) == [Segment(6, 12, "world ")]
    assert segmenter.pending_text == ""
    assert segmenter.next_deadline_ms() is None


def test_buffer_delay_commits_everything_ending_in_punctuation() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=200)
    segmenter.push("Hi,", 100)
    assert segmenter.next_deadline_ms() == 300
    assert segmenter.poll(300) == [Segment(0, 3, "Hi,")]


def test_buffer_delay_counts_from_the_push_of_the_oldest_pending_character() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=500)
    segmenter.push("One ", 0)
    segmenter.push("two", 300)
    assert segmenter.poll(500) == [Segment(0, 4, "One ")]
    assert segmenter.next_deadline_ms() is None
    assert segmenter.push(" three", 700) == []
    assert segmenter.next_deadline_ms() == 800
    assert segmenter.poll(799) == []
    assert segmenter.poll(800) == [Segment(4, 8, "two ")]
    assert segmenter.pending_text == "three"


def test_sentence_boundary_restarts_the_delay_clock() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=500)
    segmenter.push("Hello. ", 0)
    assert segmenter.push("Next part", 400) == [Segment(0, 7, "Hello. ")]
    assert segmenter.next_deadline_ms() == 900


def test_buffer_delay_never_emits_whitespace_only_units() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=100)
    segmenter.push("   ", 0)
    assert segmenter.next_deadline_ms() is None
    assert segmenter.poll(1000) == []
    assert segmenter.flush() == [Segment(0, 3, "   ")]


def test_buffer_delay_disabled_by_default() -> None:
    segmenter = Segmenter()
    segmenter.push("Hello wor", 0)
    assert segmenter.next_deadline_ms() is None
    assert segmenter.poll(1e9) == []


def test_reset_cancels_the_delay_timer() -> None:
    segmenter = Segmenter(max_buffer_delay_ms=100)
    segmenter.push("Hello there", 0)
    segmenter.reset()
    assert segmenter.next_deadline_ms() is None
    assert segmenter.poll(1000) == []


def test_buffer_delay_keeps_coverage_exact() -> None:
    text = "Tokens arrive slowly, one by one. Then 3.14 and more text without end"
    segmenter = Segmenter("clause", max_buffer_delay_ms=50)
    segments: list[Segment] = []
    for i, delta in enumerate(random_deltas(text, 3)):
        segments += segmenter.push(delta, i * 20.0)
        segments += segmenter.poll(i * 20.0 + 10)
    segments += segmenter.flush()
    assert_covers(segments, text, timer=True)
    assert len(segments) > 4


# --- properties --------------------------------------------------------------------------------------

ALPHABET = "abcXYZ019 \n\t.,;:!?…—–\"'()”’。！？，、；：．「」你好世界" + "e.g. Dr. U.S. 3.14 1,000 "
texts = st.text(alphabet=st.sampled_from(list(ALPHABET)), max_size=160) | st.lists(
    st.sampled_from(["Dr.", "3.14", "1,000", "e.g.", "Hi", "ok", "...", " ", "  ", "\n\n", "。", "，", "A.", "x"]),
    max_size=40,
).map("".join)


@st.composite
def splits(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text))))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@settings(max_examples=400, deadline=None)
@given(data=st.data(), text=texts, granularity=st.sampled_from(GRANULARITIES), cap=st.integers(1, 60))
def test_segments_cover_the_input_whatever_the_deltas(
    data: st.DataObject, text: str, granularity: SplitGranularity, cap: int
) -> None:
    deltas = data.draw(splits(text))
    streamed = feed(Segmenter(granularity, max_unit_chars=cap), deltas)
    assert_covers(streamed, text)
    assert streamed == feed(Segmenter(granularity, max_unit_chars=cap), [text])


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    text=texts,
    granularity=st.sampled_from(GRANULARITIES),
    delay=st.integers(0, 100),
    gaps=st.lists(st.integers(0, 80), min_size=1),
)
def test_segments_cover_the_input_with_the_delay_timer(
    data: st.DataObject, text: str, granularity: SplitGranularity, delay: int, gaps: list[int]
) -> None:
    segmenter = Segmenter(granularity, max_buffer_delay_ms=delay, max_unit_chars=40)
    segments: list[Segment] = []
    now = 0.0
    for i, delta in enumerate(data.draw(splits(text))):
        now += gaps[i % len(gaps)]
        deadline = segmenter.next_deadline_ms()
        if deadline is not None and deadline <= now:
            segments += segmenter.poll(deadline)
        segments += segmenter.push(delta, now)
    segments += segmenter.flush()
    assert_covers(segments, text, timer=True)


# --- bounds: unit size and cost (issue 14 #4, #5) ---------------------------------------------------------

hostile_texts = texts | st.lists(
    st.sampled_from(["Hi.", "ok", " ", " " * 70, "\n" * 30, "!" * 40, ")" * 40, "word " * 12, "x" * 90, ", ",
                     "。", "Dr.", "1. ", "”"]),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), text=hostile_texts, granularity=st.sampled_from(GRANULARITIES), cap=st.integers(1, 60),
       delay=st.sampled_from([0, 40]))
def test_units_fit_the_cap_and_cost_is_linear_whatever_the_text(
    data: st.DataObject, text: str, granularity: SplitGranularity, cap: int, delay: int
) -> None:
    """Every mode keeps a unit within `max_unit_chars` (whitespace around it aside), and the work done is
    a constant per character plus at most about one unit's worth per push (the contract's cost)."""
    deltas = data.draw(splits(text))
    segmenter = Segmenter(granularity, max_unit_chars=cap, max_buffer_delay_ms=delay)
    segments: list[Segment] = []
    for i, delta in enumerate(deltas):
        segments += segmenter.poll(i * 30.0)
        segments += segmenter.push(delta, i * 30.0)
    segments += segmenter.flush()
    assert_covers(segments, text, timer=delay > 0)
    assert all(len(s.text.strip()) <= cap for s in segments)
    assert segmenter.chars_examined <= 12 * len(text) + 2 * (cap + 1) * len(deltas)


FLOODS: list[tuple[str, SplitGranularity, str, str]] = [
    ("spaces after a sentence end", "sentence", "Hello.", " "),
    ("spaces before any text", "sentence", "", " "),
    ("newlines after a word", "sentence", "Hi", "\n"),
    ("periods after a word", "sentence", "Hello", "."),
    ("closing brackets after a sentence end", "sentence", "Hello.", ")"),
    ("spaces after a clause mark", "clause", "One two,", " "),
    ("spaces after an over-long unit", "sentence", "word " * 60, " "),
    ("letters of one endless word", "sentence", "", "x"),
    ("spaces after a sentence, none mode", "none", "Hello.", " "),
]


@pytest.mark.parametrize(("granularity", "prefix", "delta"), [f[1:] for f in FLOODS], ids=[f[0] for f in FLOODS])
@pytest.mark.parametrize("delay", [0, 100])
def test_a_flood_of_tiny_deltas_costs_a_constant_per_character(
    granularity: SplitGranularity, prefix: str, delta: str, delay: int
) -> None:
    """The attack of issue 14 #5 ("Hello." then 30,000 one-space deltas) was quadratic: every push rescanned
    the pending run. Now a push that cannot change the decision is only checked and held."""
    for count in (2_000, 30_000):
        segmenter = Segmenter(granularity, max_buffer_delay_ms=delay)
        segments = feed(segmenter, [prefix, *[delta] * count, " World."])
        text = prefix + delta * count + " World."
        assert_covers(segments, text, timer=delay > 0)
        assert segmenter.chars_examined <= 8 * len(text)


def test_one_message_of_many_sentences_costs_a_constant_per_character() -> None:
    text = "Ab. " * 30_000
    segmenter = Segmenter("sentence")
    assert len(feed(segmenter, [text])) == 30_000
    assert segmenter.chars_examined <= 8 * len(text)


def test_a_mark_run_past_the_cap_is_cut_by_the_cap() -> None:
    segments = feed(Segmenter(max_unit_chars=20), ["Hello" + "!" * 40 + " Next one."])
    assert [s.text.strip() for s in segments] == ["Hello" + "!" * 15, "!" * 20, "!" * 5, "Next one."]


@given(data=st.data(), text=texts, cap=st.integers(1, 200))
def test_none_mode_keeps_text_within_the_cap_whole(data: st.DataObject, text: str, cap: int) -> None:
    """Text whose content (spaces around it aside) fits `max_unit_chars` is one unit, exactly as pushed; past
    the cap it is packed into more than one."""
    segments = feed(Segmenter("none", max_unit_chars=cap), data.draw(splits(text)))
    if not text:
        assert segments == []
    elif len(text.strip()) <= cap:
        assert segments == [Segment(0, len(text), text)]
    else:
        assert len(segments) > 1
        assert_covers(segments, text)


def test_speakable_is_str_isalnum_for_every_character() -> None:
    assert [hex(c) for c in range(sys.maxunicode + 1) if speakable(chr(c)) != chr(c).isalnum()] == []
    assert not speakable(" .,!?-_ ") and speakable("_a_") and speakable("٣")  # ARABIC-INDIC DIGIT THREE


def test_none_mode_packs_sentences_into_units_that_fit_the_cap() -> None:
    text = "First sentence here. Second one. " * 20 + "A" + " long tail" * 40
    segments = feed(Segmenter("none", max_unit_chars=100), [text])
    assert_covers(segments, text)
    assert all(len(s.text.strip()) <= 100 for s in segments)
    pair = "First sentence here. Second one. "
    assert [s.text for s in segments[:7]] == [pair * 3] * 6 + [pair * 2]
    assert "".join(s.text for s in segments[7:]) == "A" + " long tail" * 40
