"""Hypothesis strategies shared by the layout and mask tests."""

from hypothesis import strategies as st


def doc_row(draw, seq_len: int) -> list[int]:
    """Random positive document lengths summing to ``seq_len`` (inside an ``@st.composite``)."""
    row, left = [], seq_len
    while left:
        n = draw(st.integers(1, left))
        row.append(n)
        left -= n
    return row
