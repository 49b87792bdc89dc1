"""Tests for kimi.controller.stops.StopChecker: hold-back, earliest completion, include_stop_str_in_output."""

from __future__ import annotations

import random

import pytest

from kimi.controller.stops import MAX_STOP_STRINGS, StopChecker


def run(stops, pieces, include=False):
    """Feed pieces; return (emitted text incl. flush, matched stop or None, per-feed emits)."""
    sc = StopChecker(stops, include)
    emits = []
    matched = None
    for p in pieces:
        e, stopped, m = sc.feed(p)
        emits.append(e)
        if stopped:
            matched = m
            break
    emits.append(sc.flush())
    return "".join(emits), matched, emits


def chars(s):
    return list(s)


def test_stop_split_across_one_char_deltas():
    text = "Hello world. STOP here"
    out, m, emits = run(["STOP"], chars(text))
    assert (out, m) == ("Hello world. ", "STOP")
    # nothing of "STOP" was ever emitted, and the text after it neither
    assert all("S" not in e for e in emits)


def test_hold_back_releases_when_prefix_is_not_a_stop():
    sc = StopChecker(["</end>"])
    assert sc.feed("a</e") == ("a", False, None)
    assert sc.held == "</e"
    assert sc.feed("x") == ("</ex", False, None)  # resolved: not a stop
    assert sc.held == ""
    assert sc.feed("</end") == ("", False, None)
    assert sc.feed(">tail") == ("", True, "</end>")
    assert sc.feed("more") == ("", True, "</end>")
    assert sc.flush() == ""


def test_no_false_hold_back():
    sc = StopChecker(["###", "END"])
    assert sc.feed("plain text") == ("plain text", False, None)
    assert sc.feed(" abc#x") == (" abc#x", False, None)  # '#x' cannot start '###'
    assert sc.feed("E-") == ("E-", False, None)
    assert sc.held == ""


def test_hold_back_is_bounded_by_longest_stop_minus_one():
    sc = StopChecker(["aaaa"])
    e, stopped, _ = sc.feed("a" * 3)
    assert (e, stopped, sc.held) == ("", False, "aaa")
    assert sc.feed("b") == ("aaab", False, None)
    sc = StopChecker(["abcabd"])
    assert sc.feed("xxabcab") == ("xx", False, None)  # held 'abcab' (5 = len - 1)
    assert sc.feed("c") == ("abc", False, None)  # 'abcabc' -> keep the 'abc' that may start a match
    assert sc.held == "abc"
    assert sc.feed("abd") == ("", True, "abcabd")


def test_earliest_completion_wins_later_starting_shorter_stop():
    # "abcd" starts first but "bc" completes first: the output stops before "bc"
    for pieces in (chars("abcdef"), ["abcdef"], ["ab", "cdef"], ["a", "bcd", "ef"]):
        assert run(["abcd", "bc"], pieces)[:2] == ("a", "bc")
        assert run(["abcd", "bc"], pieces, include=True)[:2] == ("abc", "bc")
        assert run(["bc", "abcd"], pieces)[:2] == ("a", "bc")  # order of the list does not matter


def test_same_end_prefers_earlier_start():
    assert run(["bc", "abc"], ["xabcy"])[:2] == ("x", "abc")
    assert run(["bc", "abc"], chars("xabcy"))[:2] == ("x", "abc")


def test_first_occurrence_across_deltas():
    assert run(["<|x|>", "zz"], ["aa<|", "x", "|>bb zz"])[:2] == ("aa", "<|x|>")
    assert run(["<|x|>", "zz"], ["aa<|", "x", "|zz>"])[:2] == ("aa<|x|", "zz")


@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output(include):
    out, m, _ = run(["\n\n"], ["para one.\n", "\nnext"], include=include)
    assert m == "\n\n"
    assert out == ("para one.\n\n" if include else "para one.")


def test_flush_returns_held_text_at_end():
    sc = StopChecker(["STOP"])
    assert sc.feed("abc ST") == ("abc ", False, None)
    assert sc.flush() == "ST"
    assert sc.flush() == ""


def test_unicode():
    stops = ["。终", "🚀!"]
    text = "你好世界。终了"
    assert run(stops, chars(text))[:2] == ("你好世界", "。终")
    assert run(stops, ["go 🚀", "!", " x"], include=True)[:2] == ("go 🚀!", "🚀!")
    # combining characters are ordinary code points: "é" as e + U+0301
    assert run(["e\u0301!"], chars("cafe\u0301!x"))[:2] == ("caf", "e\u0301!")
    sc = StopChecker(["東京"])
    assert sc.feed("東") == ("", False, None)
    assert sc.feed("西") == ("東西", False, None)


def test_no_stops_passes_through():
    sc = StopChecker([])
    assert sc.feed("anything") == ("anything", False, None)
    assert sc.flush() == ""
    assert StopChecker(None).feed("x") == ("x", False, None)


def test_validation():
    with pytest.raises(ValueError):
        StopChecker([""])
    with pytest.raises(ValueError):
        StopChecker(["a", ""])
    with pytest.raises(ValueError):
        StopChecker(["a", "b", "c", "d", "e"])
    with pytest.raises(TypeError):
        StopChecker("abc")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        StopChecker(["a", 3])  # type: ignore[list-item]
    assert len(StopChecker(["a"] * 2 + ["b", "c"]).stops) == 3
    assert MAX_STOP_STRINGS == 4


def _reference(stops, text, include, unmatched=0):
    """Character-by-character definition: stop as soon as a stop string ends at the current char, past the first
    `unmatched` characters (the text of the first min_tokens tokens: a stop may begin there, not end there)."""
    for end in range(unmatched + 1, len(text) + 1):
        hits = [(end - len(s), s) for s in stops if text[:end].endswith(s)]
        if hits:
            start, s = min(hits)
            return (text[:end] if include else text[:start]), s
    return text, None


def test_min_tokens_text_can_begin_a_stop_but_not_end_one():
    """feed(match=False) for the first min_tokens tokens' text (vLLM's rule): a stop string that begins in it and
    ends later matches, and the output is cut at its start, inside that text; one that lies wholly inside it is
    not matched; text that could begin one is held back from the start."""
    sc = StopChecker(["a.video c"])
    assert sc.feed("Anaconda", match=False) == ("Anacond", False, None)
    assert sc.feed(".video", match=True) == ("", False, None)
    assert sc.feed(" calmly", match=True) == ("", True, "a.video c")
    sc = StopChecker(["ab", "xabz"])
    assert sc.feed("xab", match=False) == ("", False, None)  # held: it may begin "xabz"
    assert sc.feed("q") == ("xabq", False, None)  # "ab" ended inside the unmatched text: no match
    assert sc.feed("ab") == ("", True, "ab")
    sc = StopChecker(["ab"])
    assert sc.feed("a", match=False) == ("", False, None)
    assert sc.feed("", match=False) == ("", False, None) and sc.held == "a"
    assert sc.feed("b") == ("", True, "ab")


@pytest.mark.parametrize("seed,cases,unmatched", [(7, 500, False), (11, 1000, True)])
def test_random_chunkings_match_reference(seed, cases, unmatched):
    """Random stops over a small alphabet, random chunkings; with `unmatched`, also empty pieces and a random
    number k of leading pieces fed with match=False (the first min_tokens tokens' text)."""
    rng = random.Random(seed)
    alphabet = "ab\n"
    for _ in range(cases):
        stops = list(
            {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))}
        )
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        include = rng.random() < 0.5
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(0 if unmatched else 1, 5)
            pieces.append(text[i : i + n])
            i += n
        k = rng.randint(0, len(pieces)) if unmatched else 0
        sc = StopChecker(stops, include)
        out, matched = [], None
        for j, p in enumerate(pieces):
            e, stopped, m = sc.feed(p, match=j >= k)
            out.append(e)
            # hold-back never exceeds max(len(stop)) - 1
            assert len(sc.held) <= max(map(len, stops)) - 1
            if stopped:
                matched = m
                break
        out.append(sc.flush())
        want = _reference(stops, text, include, sum(map(len, pieces[:k])))
        assert ("".join(out), matched) == want, (stops, text, pieces, k, include)
