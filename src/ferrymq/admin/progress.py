"""Progress of long CLI operations on stderr: a rich bar (known total) or a spinner (unknown).

Theory of operation
-------------------
A command that may take long (``dlq redrive`` moves chunk after chunk, ``dlq purge`` and
``topic delete`` on a big topic, ``cluster reassign`` waiting for new replicas) wraps its work
in :func:`progress` and calls :meth:`Tracker.advance` as it goes. Progress is for people: it is
drawn only when stderr is a terminal (rich's own test, which also honours ``FORCE_COLOR`` and
``TTY_COMPATIBLE``, so a test or a CI log can force it) and never with ``--json``. It goes to
stderr only, so whatever a script reads on stdout is the same with or without it; without a
terminal nothing at all is written (a :class:`Tracker` that draws nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["Tracker", "progress", "progress_shown"]


class Tracker:
    """What a command reports its progress to; draws nothing unless made by :func:`progress`
    with a terminal on stderr."""

    def __init__(self, bar: Progress | None = None, task: TaskID | None = None) -> None:
        self._bar = bar
        self._task = task

    @property
    def shown(self) -> bool:
        """Whether anything is drawn (a command may skip work done only for the bar)."""
        return self._bar is not None

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)

    def set_total(self, total: int | None) -> None:
        """The number of units the whole operation has (``None``: unknown, a spinner)."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, total=total)

    def describe(self, text: str) -> None:
        """Change the line's description (what is being waited for)."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text)


def progress_shown(json_mode: bool) -> bool:
    """Whether progress is drawn: stderr is a terminal (or forced) and the output is not JSON."""
    return not json_mode and Console(stderr=True).is_terminal


@contextlib.contextmanager
def progress(description: str, *, json_mode: bool, total: int | None = None) -> Iterator[Tracker]:
    """Show one progress line on stderr while the block runs (nothing when not shown).

    Args:
        description: what is being done (``"redriving"``).
        json_mode: the command prints JSON: nothing is drawn.
        total: units of the whole operation; ``None`` draws a spinner and a count.

    Yields:
        The tracker to advance.
    """
    if not progress_shown(json_mode):
        yield Tracker()
        return
    console = Console(stderr=True, highlight=False)
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=console)
    with bar:
        yield Tracker(bar, bar.add_task(description, total=total))
