"""The clock a table's row store marks its changes with, so that a delta checkpoint holds
exactly what changed since the document written last (:mod:`tensorfleet.ps.table_deltas`).

One rule, shared by the stores of hashed and of raw ids: every change is marked with
:attr:`SaveClock.save_clock`; writing a document (:meth:`SaveClock.note_saved`) makes the
next change move the clock on, so a change made after a document always carries a larger
mark than every change that document holds, and a change made before it never does.
"""

from __future__ import annotations


class SaveClock:
    """The save clock of a row store (a base class: the store's ``__init__`` sets
    ``save_clock = 0`` and ``_saved = False``)."""

    save_clock: int
    """The mark of the changes made since the document written last."""
    _saved: bool

    def note_saved(self) -> None:
        """A document of the store as it is now was written: the next change moves
        :attr:`save_clock` on, so that it is marked after that document."""
        self._saved = True

    def _change_clock(self) -> int:
        """The clock to mark a change with."""
        if self._saved:
            self.save_clock += 1
            self._saved = False
        return self.save_clock
