"""Incremental stop strings against a brute-force oracle that rescans the whole text."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from mlx_pte.serving.text.stops import MAX_STOP_CHARS, MAX_STOPS, StopStringError, StopStrings, StopText

ALPHABET = "aab\n"  # few letters, so stops overlap, repeat and straddle pieces often


def oracle(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """Generation ends after the first piece at which some stop occurs in the full text so
    far; the text is cut at the earliest occurrence of any stop."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], True
    return text, False


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    stop_text = StopText(StopStrings.of(stops))
    released = ""
    expected, _ = oracle(pieces, stops)
    for piece in pieces:
        released += stop_text.push(piece)
        # What is streamed is always a prefix of the final text: no part of a stop leaks.
        assert expected.startswith(released)
        if stop_text.stopped:
            break
    return released + stop_text.flush(), stop_text.stopped


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet=ALPHABET, max_size=6), max_size=12),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=7), max_size=MAX_STOPS),
)
def test_incremental_checker_equals_rescanning_the_full_text(pieces, stops):
    assert run(pieces, stops) == oracle(pieces, stops)


@settings(max_examples=50, deadline=None)
@given(period=st.text(alphabet="ab", min_size=1, max_size=3), repeats=st.integers(1, 60),
       piece_len=st.integers(1, 5))
def test_long_periodic_stops_match_the_oracle(period, repeats, piece_len):
    # Periodic stops are KMP's hard case: many partial matches fall back at once.
    stop = (period * repeats)[:MAX_STOP_CHARS]
    text = period * (repeats + 2)
    pieces = [text[i : i + piece_len] for i in range(0, len(text), piece_len)]
    assert run(pieces, [stop, stop + "b"]) == oracle(pieces, [stop, stop + "b"])


@pytest.mark.parametrize("stops, message", [
    (["x"] * (MAX_STOPS + 1), f"at most {MAX_STOPS} stop strings"),
    (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
    ([""], "non-empty"),
    ("abc", "sequence of non-empty strings"),
])
def test_stops_past_the_bounds_are_refused(stops, message):
    with pytest.raises(StopStringError, match=message):
        StopStrings.of(stops)
