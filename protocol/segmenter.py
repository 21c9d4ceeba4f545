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
* Unit size, in every granularity: a segment's text without its leading and trailing whitespace is at
  most `max_unit_chars` characters.
* Granularity. `none`: everything at `flush()` only (no timer); one segment when the text fits in
  `max_unit_chars`, else the fewest segments that do, each ending where `sentence` would end a unit
  (consecutive sentences are packed together while they fit).
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
  within the cap (never mid-word), or at the cap when a single word is longer. A mark whose run of
  terminals and closing quotes reaches past the cap is no boundary ("Hello!!!!..." is cut by the cap).
* Buffer delay (`max_buffer_delay_ms` > 0, `sentence`/`clause`): once the oldest pending character has
  waited `max_buffer_delay_ms` since the `now_ms` of the push that added it, the pending text is committed
  up to its last whitespace (a trailing partial word is kept, it may be an incomplete token), or all of it
  when it ends in whitespace or punctuation. `push()` applies this too, so an overdue buffer is cut as soon
  as a word boundary arrives. `next_deadline_ms()` says when `poll()` would cut; it is None when there is
  no timer, nothing pending, or nothing the timer could cut (a lone partial word waits for more text).
* Cost: linear in the text received, whatever its shape. Decisions look only at the pending unit from its
  first non-space character (at most `max_unit_chars` plus the lookahead of its last mark); leading
  whitespace is set aside unread, and a delta that cannot change the decision being waited for (more
  whitespace after a sentence end, more "!" in a run) is only checked and held, never rescanned. So a push
  costs O(len(delta) + max_unit_chars) at worst, O(len(delta)) while a decision waits, and a flood of
  one-space deltas costs O(1) each. `chars_examined` meters it.
"""

# This module is about punctuation: fullwidth and typographic marks are meant, not look-alikes.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

import re
import sys
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

_MARKS: Final = "".join(re.escape(c) for c in sorted(_TERMINALS | _LATIN_CLAUSE | _CJK_CLAUSE | {"\n"}))
_CANDIDATE: Final = re.compile(f"[{_MARKS}]")
_CJK_RANGES: Final = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_WORD: Final = re.compile(f"[{_CJK_RANGES}]|[^\\W_{_CJK_RANGES}]+")
_CJK_CHAR: Final = re.compile(f"[{_CJK_RANGES}]")
_NON_SPACE: Final = re.compile(r"\S")
_DOTTED_ACRONYM: Final = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")
# Runs (each matches the empty string, so `match` never fails).
_SPACES: Final = re.compile(r"\s*")
_TERMINAL_RUN: Final = re.compile("[" + "".join(re.escape(c) for c in sorted(_TERMINALS)) + "]*")
_CLOSER_RUN: Final = re.compile("[" + "".join(re.escape(c) for c in sorted(_CLOSERS)) + "]*")
_NO_MARK_RUN: Final = re.compile(f"[^{_MARKS}]*")

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
# Undecided until more text arrives (rescan from the returned index), and what the lookahead reached the end
# of the text in: more of the same characters cannot decide it.
_WAIT_TERMINALS: Final = 2
_WAIT_CLOSERS: Final = 3
_WAIT_SPACE: Final = 4
_WAIT_RUNS: Final = {_WAIT_TERMINALS: _TERMINAL_RUN, _WAIT_CLOSERS: _CLOSER_RUN, _WAIT_SPACE: _SPACES}
_UNBOUNDED: Final = sys.maxsize


_ALNUM: Final = re.compile(r"[^\W_]")
"""One character `str.isalnum()` holds for (a word character that is not `_`; checked over every code point)."""


def speakable(text: str) -> bool:
    """Whether `text` has anything to speak: a letter or digit (`str.isalnum()`), not only spaces and marks."""
    return _ALNUM.search(text) is not None


@dataclass(frozen=True, slots=True)
class Segment:
    """One committed synthesis unit: `text == utterance_text[start:end]`."""

    start: int
    end: int
    text: str


def _is_cjk(ch: str) -> bool:
    return _CJK_CHAR.match(ch) is not None


class Segmenter:
    """Incremental segmenter for one utterance at a time; see the module docstring for the contract.

    Pending text is three pieces, in order: `_lead` (whitespace before the unit's first non-space
    character: no decision reads it), `_buf[_head:]` (from that character on: what decisions read; text
    before `_head` is committed and dropped at the next append) and `_tail` (deltas held back unread:
    while a decision waits, a delta made only of `_wait_run`'s characters that keeps `len(_buf)` plus the
    tail within `_wait_until` cannot change it).
    """

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
        self.chars_examined = 0
        """Characters read, searched or copied since construction (never reset): the cost the module
        docstring bounds, in the units it is stated in."""
        self._parts: list[str] = []  # pending deltas, unjoined (none mode)
        self._lead: list[str] = []
        self._lead_len = 0
        self._buf = ""
        self._head = 0
        self._tail: list[str] = []
        self._tail_len = 0
        self._wait_run: re.Pattern[str] | None = None
        self._wait_until = 0
        self._offset = 0  # utterance offset of the first pending character
        self._scan = 0  # index in _buf before which every mark is decided not to be a boundary
        self._last_space = -1  # index in _buf of its last whitespace character
        self._words = 0  # words counted in _buf[_head:_words_to], up to the count a clause needs
        self._words_to = 0
        self._units = 0  # units committed in this utterance
        self._arrivals: deque[tuple[int, float]] = deque()  # (utterance offset, now_ms) of each push

    @property
    def pending_text(self) -> str:
        """Text pushed but not yet committed."""
        if self._granularity == "none":
            return "".join(self._parts)
        return "".join((*self._lead, self._buf[self._head :], *self._tail))

    def reset(self) -> None:
        """Start a new utterance: drop pending text; offsets restart at 0."""
        self._parts.clear()
        self._lead.clear()
        self._lead_len = 0
        self._buf = ""
        self._head = 0
        self._tail.clear()
        self._tail_len = 0
        self._wait_run = None
        self._offset = 0
        self._scan = 0
        self._last_space = -1
        self._words = 0
        self._words_to = 0
        self._units = 0
        self._arrivals.clear()

    def push(self, delta: str, now_ms: float) -> list[Segment]:
        """Append a text delta received at `now_ms`; return the units it commits, in order."""
        if not delta:
            return []
        if self._granularity == "none":
            self._parts.append(delta)
            return []
        timed = self._delay_ms > 0
        end = len(self._buf) + self._tail_len
        if timed:
            self._arrivals.append((self._offset + self._lead_len + end - self._head, now_ms))
        run = self._wait_run
        if run is not None and end + len(delta) <= self._wait_until and run.fullmatch(delta) is not None:
            self.chars_examined += len(delta)
            if timed:
                self._note_last_space(delta, end)
            self._tail.append(delta)
            self._tail_len += len(delta)
            return self._cut_if_overdue(now_ms) if timed else []
        self._append(delta)
        out = self._drain(final=False)
        if timed:
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
            return self._flush_none()
        self._merge_tail()
        out = self._drain(final=True)
        if self._lead or self._head < len(self._buf):
            out.append(self._commit(len(self._buf)))
        return out

    # -- none mode ------------------------------------------------------------------------------------

    def _flush_none(self) -> list[Segment]:
        """The pending text as one segment, or, past `max_unit_chars`, its sentences packed into the
        fewest segments that fit."""
        text = "".join(self._parts)
        self._parts.clear()
        self.chars_examined += len(text)
        if not text:
            return []
        if len(text.strip()) <= self._max_unit_chars:
            # Fits whole: packing its sentences (which cover it exactly) would make this one segment.
            self.chars_examined += 2 * len(text)
            self._offset += len(text)
            self._units += 1
            return [Segment(self._offset - len(text), self._offset, text)]
        sentences = Segmenter("sentence", max_unit_chars=self._max_unit_chars, fast_first_unit=False)
        groups: list[tuple[int, int]] = []  # (start, end) in `text` of each packed segment
        content_start = 0  # where the last group's first non-space character is
        for segment in (*sentences.push(text, 0.0), *sentences.flush()):
            first = segment.start + len(segment.text) - len(segment.text.lstrip())
            content_end = segment.start + len(segment.text.rstrip())
            if groups and content_end - content_start <= self._max_unit_chars:
                groups[-1] = (groups[-1][0], segment.end)
            else:
                groups.append((segment.start, segment.end))
                content_start = first
        self.chars_examined += sentences.chars_examined + 2 * len(text)
        out = [Segment(self._offset + start, self._offset + end, text[start:end]) for start, end in groups]
        self._offset += len(text)
        self._units += len(out)
        return out

    # -- sentence and clause modes ----------------------------------------------------------------------

    def _append(self, delta: str) -> None:
        """Add the held-back tail and `delta` to the text decisions read (compacting committed text
        away); whitespace before the unit's first non-space character goes to `_lead` instead."""
        head = self._head
        if head == len(self._buf):  # no unit text yet, so no tail either
            first = _NON_SPACE.search(delta)
            cut = len(delta) if first is None else first.start()
            self.chars_examined += cut + 1
            if cut:
                self._lead.append(delta[:cut])
                self._lead_len += cut
                delta = delta[cut:]
            if not delta:
                return
        start = len(self._buf) - head + self._tail_len
        self._buf = "".join((self._buf[head:], *self._tail, delta))
        self.chars_examined += len(self._buf)
        self._tail.clear()
        self._tail_len = 0
        self._wait_run = None
        self._head = 0
        self._scan -= head
        self._words_to -= head
        if self._delay_ms:
            self._last_space -= head
            self._note_last_space(delta, start)

    def _merge_tail(self) -> None:
        """Move the held-back tail into `_buf`, without compacting (indices into `_buf` stay valid)."""
        if not self._tail:
            return
        self._buf = "".join((self._buf, *self._tail))
        self.chars_examined += len(self._buf)
        self._tail.clear()
        self._tail_len = 0
        self._wait_run = None

    def _note_last_space(self, text: str, start: int) -> None:
        """Update `_last_space` for `text`, appended at index `start` of `_buf` followed by the tail (kept
        only with a timer: it is where a timer cut falls)."""
        i = len(text) - 1
        while i >= 0 and not text[i].isspace():
            i -= 1
        self.chars_examined += len(text) - i
        if i >= 0:
            self._last_space = start + i

    def _commit(self, cut: int) -> Segment:
        """Commit the lead and `_buf[_head:cut]` as one segment."""
        text = self._buf[self._head : cut]
        if self._lead:
            text = "".join((*self._lead, text))
            self._lead.clear()
            self._lead_len = 0
        self.chars_examined += len(text)
        segment = Segment(self._offset, self._offset + len(text), text)
        self._offset += len(text)
        self._units += 1
        self._head = self._scan = self._words_to = cut
        self._words = 0
        self._wait_run = None
        arrivals = self._arrivals
        if cut == len(self._buf):
            arrivals.clear()
        while len(arrivals) > 1 and arrivals[1][0] <= self._offset:
            arrivals.popleft()
        return segment

    def _drain(self, *, final: bool) -> list[Segment]:
        out: list[Segment] = []
        while self._head < len(self._buf):
            cut = self._next_cut(final=final)
            if cut is None:
                break
            out.append(self._commit(cut))
        return out

    def _next_cut(self, *, final: bool) -> int | None:
        """Where the first pending unit ends, or None while that is undecided (`_wait_run` and
        `_wait_until` then say what text cannot decide it)."""
        self._wait_run = None
        buf = self._buf
        n = len(buf)
        first = self._head
        limit = first + self._max_unit_chars
        end = min(n, limit)
        pos = self._scan
        while (mark := _CANDIDATE.search(buf, pos, end)) is not None:
            p = mark.start()
            self.chars_examined += p + 1 - pos
            verdict, at = self._judge(buf, p, limit)
            if verdict == _SPLIT:
                return at
            if verdict != _SKIP:
                self._scan = p
                self._wait_run = _WAIT_RUNS[verdict]
                self._wait_until = _UNBOUNDED if verdict == _WAIT_SPACE else limit
                return None
            pos = at
        self.chars_examined += max(0, end - pos)
        self._scan = max(pos, end)
        if n <= limit:
            self._wait_run = _NO_MARK_RUN
            self._wait_until = limit
            return None
        return self._force_cut(first, limit, final=final)

    def _force_cut(self, first: int, limit: int, *, final: bool) -> int | None:
        """Cut an over-long unit after its last whitespace within `limit`, or at `limit` mid-word."""
        buf = self._buf
        for i in range(limit, first, -1):
            if buf[i].isspace():
                self.chars_examined += limit - i
                end = self._run(_SPACES, i, len(buf))
                if end == len(buf) and not final:
                    self._wait_run = _SPACES
                    self._wait_until = _UNBOUNDED
                    return None
                return end
        self.chars_examined += limit - first
        return limit

    def _timer_cut(self) -> int | None:
        """Where the timer would cut (an index into `_buf` followed by the tail), or None."""
        buf = self._buf
        if self._head == len(buf):
            return None
        last = self._tail[-1][-1] if self._tail else buf[-1]
        if last.isspace() or unicodedata.category(last).startswith("P"):
            return len(buf) + self._tail_len
        if self._last_space > self._head:
            return self._last_space + 1
        return None

    def _cut_if_overdue(self, now_ms: float) -> list[Segment]:
        deadline = self.next_deadline_ms()
        if deadline is None or now_ms < deadline:
            return []
        cut = self._timer_cut()
        assert cut is not None  # next_deadline_ms() checked it
        self._merge_tail()
        return [self._commit(cut), *self._drain(final=False)]

    def _run(self, pattern: re.Pattern[str], i: int, stop: int) -> int:
        """End of the run of `pattern`'s characters starting at `_buf[i]`, at most `stop`."""
        match = pattern.match(self._buf, i, stop)
        assert match is not None  # every run pattern matches the empty string
        self.chars_examined += match.end() - i + 1
        return match.end()

    def _judge(self, buf: str, p: int, limit: int) -> tuple[int, int]:
        ch = buf[p]
        if ch in _TERMINALS:
            return self._judge_sentence_end(buf, p, limit)
        if ch == "\n":
            return self._judge_blank_line(buf, p)
        return self._judge_clause(buf, p, limit)

    def _judge_sentence_end(self, buf: str, p: int, limit: int) -> tuple[int, int]:
        n = len(buf)
        stop = min(n, limit + 1)
        run_end = self._run(_TERMINAL_RUN, p, stop)
        j = self._run(_CLOSER_RUN, run_end, stop)
        if j > limit:
            return _SKIP, j
        if j == n:
            return (_WAIT_TERMINALS if run_end == n else _WAIT_CLOSERS), p
        run = buf[p:run_end]
        after = buf[j]
        if any(c in _CJK_TERMINALS for c in run):
            if run == "．" and p > self._head and buf[p - 1].isdigit() and after.isdigit():
                return _SKIP, j
            return self._split_after_space(buf, p, j)
        if not after.isspace():
            if p > self._head and _is_cjk(buf[p - 1]) and _is_cjk(after):
                return _SPLIT, j
            return _SKIP, j
        k = self._run(_SPACES, j, n)
        if k == n:
            return _WAIT_SPACE, p
        following = buf[k]
        if following.islower():
            return _SKIP, j
        if run == "." and j == run_end and self._is_abbreviation(buf, p, following):
            return _SKIP, j
        return _SPLIT, k

    def _judge_blank_line(self, buf: str, p: int) -> tuple[int, int]:
        k = self._run(_SPACES, p, len(buf))
        if k == len(buf):
            return _WAIT_SPACE, p
        if p > self._head and buf.count("\n", p, k) >= 2:
            self.chars_examined += k - p
            return _SPLIT, k
        return _SKIP, k

    def _judge_clause(self, buf: str, p: int, limit: int) -> tuple[int, int]:
        if self._granularity == "clause":
            min_words = 2
        elif self._fast_first_unit and self._units == 0:
            min_words = self._first_unit_min_words
        else:
            return _SKIP, p + 1
        n = len(buf)
        j = self._run(_CLOSER_RUN, p + 1, min(n, limit + 1))
        if j > limit:
            return _SKIP, j
        if j == n:
            return _WAIT_CLOSERS, p
        after = buf[j]
        if buf[p] in _CJK_CLAUSE:
            if p > self._head and buf[p - 1].isdigit() and after.isdigit():
                return _SKIP, j
        elif not after.isspace():
            return _SKIP, j
        if not self._has_words(buf, p, min_words):
            return _SKIP, j
        return self._split_after_space(buf, p, j)

    def _split_after_space(self, buf: str, p: int, j: int) -> tuple[int, int]:
        """Split the mark at `p`, whose run ends at `j`, after the whitespace that follows it."""
        k = self._run(_SPACES, j, len(buf))
        if k == len(buf):
            return _WAIT_SPACE, p
        return _SPLIT, k

    def _has_words(self, buf: str, p: int, count: int) -> bool:
        """Whether the unit before `p` holds at least `count` words (a CJK character counts as one).
        Counts on from the last mark asked about, so a unit's words are read once."""
        if self._words < count and self._words_to < p:
            for _ in _WORD.finditer(buf, self._words_to, p):
                self._words += 1
                if self._words >= count:
                    break
            self.chars_examined += p - self._words_to
            self._words_to = p
        return self._words >= count

    def _is_abbreviation(self, buf: str, p: int, following: str) -> bool:
        """Whether the period at `buf[p]` closes an abbreviation, initial or list number, not a sentence."""
        start = p
        floor = max(self._head, p - _WORD_LOOKBACK)
        while start > floor and not buf[start - 1].isspace():
            start -= 1
        self.chars_examined += p - start
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
        return word.isdigit() and len(word) <= 3 and self._is_line_start(buf, start)

    def _is_line_start(self, buf: str, i: int) -> bool:
        """Whether `buf[i]` starts the unit, or a line (only spaces and tabs between it and a newline)."""
        start = i
        while i > self._head and buf[i - 1] in " \t":
            i -= 1
        self.chars_examined += start - i
        return i == self._head or buf[i - 1] in "\r\n"
