"""Option declarations shared by the commands."""

from __future__ import annotations

from typing import Any

import typer


def flag(*decls: str, help: str, **kwargs: Any) -> Any:
    """A switch (``--force``). Its help row shows no value type: recent typer labels every
    option with one, and ``<bool>`` reads as if the switch took a value."""
    return typer.Option(*decls, help=help, metavar="", **kwargs)
