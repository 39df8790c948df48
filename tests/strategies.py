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


def layout_shape(draw, max_cp: int, max_chunks: int) -> tuple[int, str, int]:
    """``(cp, balance, seq_len)`` with a ``seq_len`` every balance of that name accepts."""
    cp = draw(st.integers(1, max_cp))
    balance = draw(st.sampled_from(["contiguous", "zigzag", "doc_zigzag", "doc_local"]))
    mult = 2 * cp if balance == "zigzag" else cp
    return cp, balance, mult * draw(st.integers(1, max_chunks))
