"""Split streamed text deltas into synthesis units.

A `Segmenter` holds the text of one utterance (everything pushed since `reset()`) and decides where
synthesis units end. It is pure: no I/O, no asyncio, no clock; callers pass the time in.

Contract
--------
* Coverage. The `Segment`s returned by `push`, `poll` and `flush`, in order, are contiguous and cover the
  utterance exactly: concatenating their `text` gives every delta pushed since `reset()`, whitespace
  included. `Segment.start`/`end` are offsets into that utterance text. Whitespace after a boundary
  belongs to the earlier segment, so every segment but the first starts with a non-space character
  (unless a timer cut, below, committed the text before it).
* No whitespace-only segments, except one: `flush()` returns the pending text as one segment even when it
  is only whitespace (callers skip segments with nothing speakable). Segments are never empty.
* Determinism. Boundaries depend only on the text, never on how it was cut into deltas: a boundary is
  committed only once the lookahead that decides it (up to the next non-space character) has arrived, and
  `flush()` commits the rest. The one exception is the `max_buffer_delay_ms` timer, which by design
  depends on time.
* Granularity. `none`: one segment, at `flush()` only (no splitting, no length cap, no timer).
  `sentence`: after . ! ? … and CJK 。！？．｡ plus trailing closing quotes/brackets; a Latin end needs
  whitespace then a character that is not lowercase; a CJK end needs nothing after it; a blank line (two
  or more newlines) also ends a sentence. `clause`: sentence ends plus , ; : — – and CJK ，、；：､
  (a Latin clause mark needs whitespace after it), never cutting a clause of fewer than two words
  (a short clause merges into the next one).
* No false splits on decimals (3.14, ３．１４), thousands (1,000), versions (1.2.3), times (10:30),
  URLs and e-mail addresses, abbreviations in `_ABBREVIATIONS` (Dr. Mr. etc. e.g. ...), dotted acronyms
  (U.S. a.m. J.R.R.), initials (a single capital letter other than "I"), numbered-list markers at the
  start of a line or unit ("1. Open the box"), or "No./Fig./p." before a number. A sentence end followed by a
  lowercase word never splits ("Wait... what", "'Stop!' he said").
* Choices on ambiguous text: an abbreviation or dotted acronym never ends a sentence, even before a
  capital ("etc. The" and "the U.S. Then" stay in one unit); an ellipsis followed by a capital does end
  one ("Wait... Then" splits after the ellipsis); "No." is an abbreviation only before a digit.
* Fast first unit (`sentence` mode, `fast_first_unit=True`): until the first unit of the utterance is
  committed, clause marks are boundaries too when the unit so far has at least `first_unit_min_words`
  words (a CJK character counts as a word), to cut time to first audio.
* Length cap (`sentence`, `clause`): when more than `max_unit_chars` characters past the unit's first
  non-space character are pending with no boundary among them, the unit is cut after the last whitespace
  within the cap (never mid-word), or at the cap when a single word is longer.
* Buffer delay (`max_buffer_delay_ms` > 0, `sentence`/`clause`): once the oldest pending character has
  waited `max_buffer_delay_ms` since the `now_ms` of the push that added it, the pending text is committed
  up to its last whitespace (a trailing partial word is kept, it may be an incomplete token), or all of it
  when it ends in whitespace or punctuation. `push()` applies this too, so an overdue buffer is cut as soon
  as a word boundary arrives. `next_deadline_ms()` says when `poll()` would cut; it is None when there is
  no timer, nothing pending, or nothing the timer could cut (a lone partial word waits for more text).
* Cost. `push()` scans only the new text plus a short lookback (the decision window around the last
  undecided mark); pending text is bounded by `max_unit_chars` plus trailing whitespace in `sentence`
  and `clause` modes. `none` mode keeps the deltas unjoined until `flush()`.
"""

# This module is about punctuation: fullwidth and typographic marks are meant, not look-alikes.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import re
import unicodedata
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal, get_args

SplitGranularity = Literal["none", "sentence", "clause"]

_GRANULARITIES: Final = frozenset(get_args(SplitGranularity))

_LATIN_TERMINALS: Final = frozenset(".!?…")
_CJK_TERMINALS: Final = frozenset("。！？．｡")
_TERMINALS: Final = _LATIN_TERMINALS | _CJK_TERMINALS
_CLOSERS: Final = frozenset("\"'”’»›)]}」』）】〕〉》")
_OPENERS: Final = "\"'“‘«‹([{¿¡「『（【〔〈《"
_LATIN_CLAUSE: Final = frozenset(",;:—–")
_CJK_CLAUSE: Final = frozenset("，、；：､")

_CANDIDATE: Final = re.compile(
    "[" + "".join(re.escape(c) for c in sorted(_TERMINALS | _LATIN_CLAUSE | _CJK_CLAUSE | {"\n"})) + "]"
)
_CJK_RANGES: Final = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_WORD: Final = re.compile(f"[{_CJK_RANGES}]|[^\\W_{_CJK_RANGES}]+")
_CJK_CHAR: Final = re.compile(f"[{_CJK_RANGES}]")
_NON_SPACE: Final = re.compile(r"\S")
_DOTTED_ACRONYM: Final = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")

# Words (lowercase, without the final period) that a period does not end.
_ABBREVIATIONS: Final = frozenset(
    {
        "mr", "mrs", "ms", "mx", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "u.s", "u.k",
        "a.m", "p.m", "inc", "ltd", "co", "corp", "llc", "approx", "dept", "est", "gen", "gov", "lt",
        "col", "sgt", "capt", "cmdr", "rev", "hon", "mt", "ft", "ave", "blvd", "rd", "jan", "feb", "apr",
        "aug", "sept", "oct", "nov", "dec", "al", "cf", "viz", "misc",
    }
)  # fmt: skip
# Abbreviations only when a number follows ("No. 5", "Fig. 3", "p. 12"); "No. I refuse." splits.
_NUMBER_ABBREVIATIONS: Final = frozenset({"no", "nos", "fig", "figs", "vol", "p", "pp", "ch", "sec", "eq"})
# Lookback for the word before a period: longer words are never abbreviations.
_WORD_LOOKBACK: Final = 32

# Verdicts on one candidate mark.
_SPLIT: Final = 0  # a boundary: the unit ends at the returned index
_SKIP: Final = 1  # not a boundary: resume scanning at the returned index
_WAIT: Final = 2  # undecided until more text arrives: rescan from the returned index


@dataclass(frozen=True, slots=True)
class Segment:
    """One committed synthesis unit: `text == utterance_text[start:end]`."""

    start: int
    end: int
    text: str


def _skip_space(buf: str, i: int) -> int:
    n = len(buf)
    while i < n and buf[i].isspace():
        i += 1
    return i


def _is_cjk(ch: str) -> bool:
    return _CJK_CHAR.match(ch) is not None


def _has_words(text: str, end: int, count: int) -> bool:
    """Whether `text[:end]` holds at least `count` words (a CJK character counts as one)."""
    seen = 0
    for _ in _WORD.finditer(text, 0, end):
        seen += 1
        if seen >= count:
            return True
    return count <= 0


def _is_line_start(buf: str, i: int) -> bool:
    while i > 0 and buf[i - 1] in " \t":
        i -= 1
    return i == 0 or buf[i - 1] in "\r\n"


def _is_abbreviation(buf: str, p: int, following: str) -> bool:
    """Whether the period at `buf[p]` closes an abbreviation, initial or list number, not a sentence."""
    start = p
    floor = max(0, p - _WORD_LOOKBACK)
    while start > floor and not buf[start - 1].isspace():
        start -= 1
    word = buf[start:p].lstrip(_OPENERS)
    if not word:
        return False
    lower = word.lower()
    if lower in _ABBREVIATIONS or _DOTTED_ACRONYM.fullmatch(word):
        return True
    if lower in _NUMBER_ABBREVIATIONS and following.isdigit():
        return True
    if len(word) == 1 and word.isupper() and word != "I":
        return True
    return word.isdigit() and len(word) <= 3 and _is_line_start(buf, start)


class Segmenter:
    """Incremental segmenter for one utterance at a time; see the module docstring for the contract."""

    def __init__(
        self,
        granularity: SplitGranularity = "sentence",
        *,
        max_buffer_delay_ms: int = 0,
        max_unit_chars: int = 250,
        fast_first_unit: bool = True,
        first_unit_min_words: int = 3,
    ) -> None:
        if granularity not in _GRANULARITIES:
            raise ValueError(f"granularity must be one of {sorted(_GRANULARITIES)}, not {granularity!r}")
        if max_buffer_delay_ms < 0:
            raise ValueError(f"max_buffer_delay_ms must be >= 0, not {max_buffer_delay_ms}")
        if max_unit_chars < 1:
            raise ValueError(f"max_unit_chars must be >= 1, not {max_unit_chars}")
        if first_unit_min_words < 1:
            raise ValueError(f"first_unit_min_words must be >= 1, not {first_unit_min_words}")
        self._granularity: SplitGranularity = granularity
        self._delay_ms = max_buffer_delay_ms
        self._max_unit_chars = max_unit_chars
        self._fast_first_unit = fast_first_unit
        self._first_unit_min_words = first_unit_min_words
        self._buf = ""  # pending text (sentence/clause modes)
        self._parts: list[str] = []  # pending deltas, unjoined (none mode)
        self._base = 0  # utterance offset of the first pending character
        self._scan = 0  # index in _buf before which every mark is decided not to be a boundary
        self._units = 0  # units committed in this utterance
        self._arrivals: deque[tuple[int, float]] = deque()  # (utterance offset, now_ms) of each push

    @property
    def pending_text(self) -> str:
        """Text pushed but not yet committed."""
        return "".join(self._parts) if self._granularity == "none" else self._buf

    def reset(self) -> None:
        """Start a new utterance: drop pending text; offsets restart at 0."""
        self._buf = ""
        self._parts.clear()
        self._base = 0
        self._scan = 0
        self._units = 0
        self._arrivals.clear()

    def push(self, delta: str, now_ms: float) -> list[Segment]:
        """Append a text delta received at `now_ms`; return the units it commits, in order."""
        if not delta:
            return []
        if self._granularity == "none":
            self._parts.append(delta)
            return []
        if self._delay_ms:
            self._arrivals.append((self._base + len(self._buf), now_ms))
        self._buf += delta
        out = self._drain(final=False)
        out += self._cut_if_overdue(now_ms)
        return out

    def poll(self, now_ms: float) -> list[Segment]:
        """Return the unit the `max_buffer_delay_ms` timer forces out at `now_ms`, if any."""
        return self._cut_if_overdue(now_ms)

    def next_deadline_ms(self) -> float | None:
        """When `poll()` would next commit a unit; None when no timer is pending."""
        if not self._arrivals or self._timer_cut() is None:
            return None
        return self._arrivals[0][1] + self._delay_ms

    def flush(self) -> list[Segment]:
        """End of input: commit everything pending ([] when nothing is)."""
        if self._granularity == "none":
            text = "".join(self._parts)
            self._parts.clear()
            return [self._segment(text)] if text else []
        out = self._drain(final=True)
        if self._buf:
            out.append(self._commit(len(self._buf)))
        return out

    def _segment(self, text: str) -> Segment:
        segment = Segment(self._base, self._base + len(text), text)
        self._base += len(text)
        self._units += 1
        return segment

    def _commit(self, cut: int) -> Segment:
        segment = self._segment(self._buf[:cut])
        self._buf = self._buf[cut:]
        self._scan = 0
        arrivals = self._arrivals
        if not self._buf:
            arrivals.clear()
        while len(arrivals) > 1 and arrivals[1][0] <= self._base:
            arrivals.popleft()
        return segment

    def _drain(self, *, final: bool) -> list[Segment]:
        out: list[Segment] = []
        while self._buf:
            cut = self._next_cut(final=final)
            if cut is None:
                break
            out.append(self._commit(cut))
        return out

    def _next_cut(self, *, final: bool) -> int | None:
        """Where the first pending unit ends, or None while that is undecided."""
        buf = self._buf
        n = len(buf)
        first = _NON_SPACE.search(buf)
        if first is None:
            return None
        limit = first.start() + self._max_unit_chars
        end = min(n, limit)
        pos = self._scan
        while (mark := _CANDIDATE.search(buf, pos, end)) is not None:
            verdict, at = self._judge(buf, mark.start())
            if verdict == _SPLIT:
                return at
            if verdict == _WAIT:
                self._scan = at
                return None
            pos = at
        self._scan = max(pos, end)
        if n <= limit:
            return None
        return self._force_cut(first.start(), limit, final=final)

    def _force_cut(self, first: int, limit: int, *, final: bool) -> int | None:
        """Cut an over-long unit after its last whitespace within `limit`, or at `limit` mid-word."""
        buf = self._buf
        for i in range(limit, first, -1):
            if buf[i].isspace():
                end = _skip_space(buf, i)
                if end == len(buf) and not final:
                    return None
                return end
        return limit

    def _timer_cut(self) -> int | None:
        buf = self._buf
        first = _NON_SPACE.search(buf)
        if first is None:
            return None
        last = buf[-1]
        if last.isspace() or unicodedata.category(last).startswith("P"):
            return len(buf)
        for i in range(len(buf) - 1, first.start(), -1):
            if buf[i].isspace():
                return i + 1
        return None

    def _cut_if_overdue(self, now_ms: float) -> list[Segment]:
        deadline = self.next_deadline_ms()
        if deadline is None or now_ms < deadline:
            return []
        cut = self._timer_cut()
        assert cut is not None  # next_deadline_ms() checked it
        return [self._commit(cut), *self._drain(final=False)]

    def _judge(self, buf: str, p: int) -> tuple[int, int]:
        ch = buf[p]
        if ch in _TERMINALS:
            return self._judge_sentence_end(buf, p)
        if ch == "\n":
            return self._judge_blank_line(buf, p)
        return self._judge_clause(buf, p)

    def _judge_sentence_end(self, buf: str, p: int) -> tuple[int, int]:
        n = len(buf)
        run_end = p
        while run_end < n and buf[run_end] in _TERMINALS:
            run_end += 1
        j = run_end
        while j < n and buf[j] in _CLOSERS:
            j += 1
        if j == n:
            return _WAIT, p
        run = buf[p:run_end]
        after = buf[j]
        if any(c in _CJK_TERMINALS for c in run):
            if run == "．" and p > 0 and buf[p - 1].isdigit() and after.isdigit():
                return _SKIP, j
            return self._split_after_space(buf, p, j)
        if not after.isspace():
            if p > 0 and _is_cjk(buf[p - 1]) and _is_cjk(after):
                return _SPLIT, j
            return _SKIP, j
        k = _skip_space(buf, j)
        if k == n:
            return _WAIT, p
        following = buf[k]
        if following.islower():
            return _SKIP, j
        if run == "." and j == run_end and _is_abbreviation(buf, p, following):
            return _SKIP, j
        return _SPLIT, k

    def _judge_blank_line(self, buf: str, p: int) -> tuple[int, int]:
        k = _skip_space(buf, p)
        if k == len(buf):
            return _WAIT, p
        if buf.count("\n", p, k) >= 2 and _NON_SPACE.search(buf, 0, p) is not None:
            return _SPLIT, k
        return _SKIP, k

    def _judge_clause(self, buf: str, p: int) -> tuple[int, int]:
        if self._granularity == "clause":
            min_words = 2
        elif self._fast_first_unit and self._units == 0:
            min_words = self._first_unit_min_words
        else:
            return _SKIP, p + 1
        n = len(buf)
        j = p + 1
        while j < n and buf[j] in _CLOSERS:
            j += 1
        if j == n:
            return _WAIT, p
        after = buf[j]
        if buf[p] in _CJK_CLAUSE:
            if p > 0 and buf[p - 1].isdigit() and after.isdigit():
                return _SKIP, j
        elif not after.isspace():
            return _SKIP, j
        if not _has_words(buf, p, min_words):
            return _SKIP, j
        return self._split_after_space(buf, p, j)

    @staticmethod
    def _split_after_space(buf: str, p: int, j: int) -> tuple[int, int]:
        """Split the mark at `p`, whose run ends at `j`, after the whitespace that follows it."""
        k = _skip_space(buf, j)
        if k == len(buf):
            return _WAIT, p
        return _SPLIT, k
