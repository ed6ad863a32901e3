"""The helpers the notebooks paste measured text with (booktext.py)."""
import pytest

from specnb.booktext import Words, table


def test_table_escapes_pipes_and_keeps_every_cell():
    md = table(["k", "a_2|1"], [[1, "0.25"], [2, "x|y"]]).splitlines()
    assert md[0] == "| k | a_2\\|1 |" and md[1] == "|---|---|"
    assert md[2:] == ["| 1 | 0.25 |", "| 2 | x\\|y |"]


def test_table_refuses_a_row_of_the_wrong_length():
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        table(["a", "b"], [[1, 2], [3]])


def test_words_paste_without_quotes():
    assert repr(Words("twice as fast")) == "twice as fast"
