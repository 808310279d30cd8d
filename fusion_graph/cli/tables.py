"""Tables that read at 80 columns: numbers are never cut, text cells wrap at spaces.

Rich shrinks the columns that may wrap before any other; a ``no_wrap`` column
it must still shrink is cut with ``…``. So each table keeps its number columns
``no_wrap`` and few enough that, with one wrapping text column, they fit in 80.
"""

from __future__ import annotations

from rich import box
from rich.table import Table


def compact_table(title: str | None = None, caption: str | None = None) -> Table:
    """A table with one space between columns and none at its edges, a rule under the header.

    Title and caption sit on the left and wrap like any text.
    """
    return Table(
        title=title,
        caption=caption,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 0),
        pad_edge=False,
        title_justify="left",
        caption_justify="left",
    )


def add_number_columns(table: Table, *names: str) -> None:
    """Right-aligned columns that never wrap or cut (counts, shares, dollars)."""
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
