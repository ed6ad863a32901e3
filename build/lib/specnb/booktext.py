"""What the notebooks use to paste measured numbers and sentences into their prose (MyST-NB glue).

Every number and every measurement-dependent sentence of the book is computed in a notebook cell
and glued into the text, so the text cannot disagree with the run that built it (the book's rule:
no hand-typed figure). Not covered: figures (the notebooks glue those with ``myst_nb.glue``
directly, under a numbered caption).
"""
from __future__ import annotations

import numpy as np


class Words(str):
    """Text that glue pastes without quotes: a sentence chosen by the code from this run's numbers."""

    def __repr__(self) -> str:
        return str(self)


def g(name: str, value) -> None:
    """Glue ``value`` under ``name`` without displaying it; numpy scalars become plain Python numbers
    (the book build warns on them)."""
    from myst_nb import glue

    glue(name, value.item() if isinstance(value, np.generic) else value, display=False)


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table: ``header`` and ``rows`` of cells (``str()`` of each, ``|`` escaped).

    The notebooks show it with ``display(Markdown(table(...)))``; one helper so that no chapter
    builds table syntax by hand.
    """
    def cell(x) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    if any(len(r) != len(header) for r in rows):
        raise ValueError(f"every row needs {len(header)} cells, as the header has: "
                         f"{[len(r) for r in rows if len(r) != len(header)]}")
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)
