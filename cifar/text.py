"""How a name or value a person sent is shown inside a one-line message: escaped, and shortened.

A file name may hold a newline or bytes that are not UTF-8, a --set value may be 100 KB of brackets;
the message that names them must still be one readable line.
"""

from __future__ import annotations

SHOWN_CHARACTERS = 120  # Of a value echoed in a message; the rest is counted, not shown.


def printable(text: str) -> str:
    """`text` as a terminal shows it on one line: escaped as repr escapes it when it holds a newline or another
    control character, or bytes that are not UTF-8 (surrogate-escaped names); left as it is otherwise."""
    return text if text.isprintable() else repr(text)[1:-1]


def shortened(text: str, limit: int = SHOWN_CHARACTERS) -> str:
    """`text` cut to `limit` characters, saying how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"
