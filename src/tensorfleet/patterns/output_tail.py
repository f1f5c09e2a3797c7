"""The end of what a process printed, for the message that says why it failed.

Rule. Its last :data:`LINES` non-empty lines, stripped and joined with `` | ``, and, when
its last line naming an error (``...Error``, ``...Exception``) is not among them, that line
first: a trial or an interpreter that failed while shutting down prints its traceback's
error and then more (a warning, a thread dump), and the error is what the user needs. The
whole is kept within :data:`LIMIT` characters by dropping whole lines from the front, never
by cutting one in the middle (a sweep's report showed ``...rror: the learning rate must``
where the cut fell); a single line longer than the limit keeps its end, marked ``...``.

Why here: three places (a sweep's trial, a warm executor, a preloaded interpreter) said
why a process ended, each cutting the joined lines at a character count.
"""

from __future__ import annotations

import re

#: Lines of the end shown.
LINES = 3
#: Characters shown at most.
LIMIT = 400
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b")


def output_tail(text: str, lines: int = LINES, limit: int = LIMIT) -> str:
    """The end of ``text`` (a process's output) as the module says: "" when it printed
    nothing."""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    shown = kept[-lines:]
    errors = [line for line in kept if _ERROR_LINE.search(line)]
    if errors and errors[-1] not in shown:
        shown = [errors[-1], *shown]
    protected = errors[-1] if errors else None
    while len(shown) > 1 and len(" | ".join(shown)) > limit:
        # Drop the oldest line that is not the error line.
        others = [i for i, line in enumerate(shown) if line != protected]
        if not others:
            break
        del shown[others[0]]
    joined = " | ".join(shown)
    return joined if len(joined) <= limit else "..." + joined[-(limit - 3) :]
