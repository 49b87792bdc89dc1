"""Stop strings for streamed text, with hold-back (OpenAI `stop`, vLLM `include_stop_str_in_output`).

A `StopChecker` sits between the detokenizer (or the content stream of `parsers.OutputParser`) and the
client. It never emits text that could still turn out to be the start of a stop string, and it stops at
the first stop string that completes, however the text was split into deltas.

Which match wins: the one that *completes first* in the text (smallest end position); among matches that
end at the same position, the one that starts first (the longer one). This is what generating the text
one character at a time would do, so the result does not depend on how the text is chunked: with stops
["abcd", "bc"] and text "abcd", "bc" completes at position 3 before "abcd" completes at 4, so the output is
"a" (or "abc" with include_stop_str_in_output) and the matched stop is "bc", whether "abcd" arrives in one
delta or four.

Hold-back: after each delta the checker keeps back the longest suffix of the unemitted text that is a
prefix of some stop string (at most max(len(stop)) - 1 characters); everything before it is emitted.
Text that cannot begin a stop string is never held. Characters are Python str code points, so multi-byte
UTF-8 and combining characters are handled as the detokenizer delivered them (it never splits a
character).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 4


class StopChecker:
    """Stop-string matcher for one request's streamed text.

    Args:
        stop: up to `MAX_STOP_STRINGS` non-empty strings (duplicates are ignored; an empty list disables
            matching and every delta passes through unchanged).
        include_stop_str_in_output: when True the emitted text ends with the matched stop string, else it
            ends right before it.

    Raises:
        ValueError: more than 4 stop strings, or an empty string among them.
        TypeError: a stop that is not a str.
    """

    def __init__(self, stop: Sequence[str] | None, include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a list of strings, not a single str")
        stops = list(stop or [])
        for s in stops:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be str, got {type(s).__name__}")
            if s == "":
                raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self._unmatched = 0  # leading characters of _held fed with match=False: no match may end within them
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def held(self) -> str:
        """Text received but not emitted yet (a possible stop-string prefix)."""
        return self._held

    def feed(self, text_delta: str, match: bool = True) -> tuple[str, bool, str | None]:
        """Add the next piece of text.

        Returns `(emit_text, stopped, matched_stop)`: emit_text is safe to send now ("" possible);
        stopped is True once a stop string has matched (emit_text then ends before it, or after it with
        include_stop_str_in_output, and nothing after the match is ever emitted); matched_stop is the stop
        string that matched, else None. After a stop every later call returns ("", True, matched_stop).

        match=False (the text of the first min_tokens tokens): no stop string may end in this text, but text
        that could begin one is still held back, so a stop string that begins here and ends in later text
        matches then (vLLM's rule: the search reaches back into the earlier text).
        """
        if self.stopped:
            return "", True, self.matched_stop
        if not self.stops:
            return text_delta, False, None
        buf = self._held + text_delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        old = self._unmatched
        for s in self.stops if match else ():
            i = buf.find(s, max(0, old - len(s) + 1))  # the earliest-ending occurrence that ends past `old`
            if i >= 0:
                cand = (i + len(s), i, s)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, s = best
            self._held = ""
            self.stopped = True
            self.matched_stop = s
            return (buf[:end] if self.include_stop_str_in_output else buf[:start]), True, s
        hold = self._hold_len(buf)
        cut = len(buf) - hold
        self._held = buf[cut:]
        self._unmatched = len(self._held) if not match else max(0, old - cut)
        return buf[:cut], False, None

    def flush(self) -> str:
        """End of stream without a match: return (and forget) the held text; "" after a stop."""
        if self.stopped:
            return ""
        out, self._held, self._unmatched = self._held, "", 0
        return out

    def _hold_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self.max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
