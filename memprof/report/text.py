"""Text from files and command lines, made safe to print.

Names in a snapshot (file names, functions, allocator settings) and in error messages come
from files anyone can write. Printed raw, an escape code clears the screen, a newline
forges a line, and rich reads ``[...]`` as markup. Every renderer passes such text
through :func:`visible` (plain strings) or :func:`plain` (rich text, never markup).
"""

from __future__ import annotations

from rich.text import Text


def visible(text: object) -> str:
    """``text`` with every non-printable character shown as an escape: ``a\\x1bb\\nc``."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else _escape(c) for c in s)


def plain(text: object, style: str = "") -> Text:
    """A rich :class:`Text` of ``visible(text)``: shown verbatim, ``[/]`` and all."""
    return Text(visible(text), style)


def _escape(c: str) -> str:
    code = ord(c)
    if c in "\n\r\t":
        return repr(c)[1:-1]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"
