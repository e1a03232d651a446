"""How a name or value a person sent is shown inside a one-line message: escaped, and shortened.

A file name may hold a newline or bytes that are not UTF-8, a --set value may be 100 KB of brackets;
the message that names them must still be one readable line.
"""

from __future__ import annotations

import reprlib
from typing import Any

SHOWN_CHARACTERS = 120  # Of a value echoed in a message; the rest is counted, not shown.


def printable(text: str) -> str:
    """`text` as a terminal shows it on one line: escaped as repr escapes it when it holds a newline or another
    control character, or bytes that are not UTF-8 (surrogate-escaped names); left as it is otherwise."""
    return text if text.isprintable() else repr(text)[1:-1]


def shortened(text: str, limit: int = SHOWN_CHARACTERS) -> str:
    """`text` cut to `limit` characters, saying how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


_BRIEF = reprlib.Repr()  # Python 3.11's Repr takes its limits as attributes.
_BRIEF.maxlevel, _BRIEF.maxdict, _BRIEF.maxlist, _BRIEF.maxtuple, _BRIEF.maxset = 3, 4, 4, 4, 4
_BRIEF.maxstring = _BRIEF.maxother = SHOWN_CHARACTERS
_BRIEF.maxlong = 40


def brief(value: Any) -> str:
    """repr(value), bounded however large or deeply nested the value: only what is shown is visited."""
    return shortened(_BRIEF.repr(value), 2 * SHOWN_CHARACTERS)


def duration(seconds: float) -> str:
    """About how long, in the unit a person reads best: 40 s, 16 min, 2.3 h."""
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"
