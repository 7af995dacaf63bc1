"""The script's own command-line flags, read from its command and its argparse source
(never run): the value a flag has, the aliases that set it, and the command with it set.

    flags = option_flags(Path("main.py"), "batch-size")  # ["--batch-size", "-b"]
    flag_value(["-b", "32"], flags)                       # 32
    with_arg(["-b", "32"], flags, 8)                      # ["-b", "8"]
    with_arg(["trainer.batch=32"], ["trainer.batch"], 8)  # ["trainer.batch=8"]: an override
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def with_arg(args: list[str], flags: list[str], value: int) -> list[str]:
    """``args`` with the option ``flags`` names (``--batch-size`` and its aliases, ``-b``)
    set to ``value`` where one is given (``--name V``, ``--name=V``, ``-bV``; the last, which
    argparse keeps); else the first flag appended."""
    out = list(args)
    for i, arg in reversed(list(enumerate(out))):
        for flag in flags:
            if arg == flag and i + 1 < len(out):
                out[i + 1] = str(value)
                return out
            if arg.startswith(flag + "=") or _attached(arg, flag):
                out[i] = f"{flag}={value}" if arg.startswith(flag + "=") else f"{flag}{value}"
                return out
    return [*out, flags[0], str(value)]


def _attached(arg: str, flag: str) -> bool:
    """Whether ``arg`` is a short option's value written onto it (``-b32``)."""
    return len(flag) == 2 and flag[1] != "-" and arg.startswith(flag) and arg[2:].isdigit()


def _options(name: str) -> set[str]:
    """``--name`` with dashes or underscores (a one-letter name: ``-n`` too)."""
    bare = name.lstrip("-")
    return {f"--{bare}", f"--{bare.replace('_', '-')}", f"--{bare.replace('-', '_')}",
            *([f"-{bare}"] if len(bare) == 1 else [])}


def _add_argument(script: Path, name: str) -> Any:
    """The ``add_argument`` call of ``--name`` in ``script``'s source (an ``ast.Call``, read,
    never run), or None."""
    import ast

    options = _options(name)
    try:
        tree = ast.parse(script.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    return next((node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                 and any(isinstance(a, ast.Constant) and a.value in options
                         for a in node.args)), None)


def parser_default(script: Path, name: str) -> int | None:
    """The integer ``default=`` of ``add_argument("--name", ...)`` in ``script``'s source
    (``--name`` with dashes or underscores); None when there is none."""
    call = _add_argument(script, name)
    for keyword in getattr(call, "keywords", ()):
        value = getattr(keyword.value, "value", None)
        if keyword.arg == "default" and type(value) is int and value > 0:
            return value
    return None


def option_flags(script: Path | None, name: str) -> list[str]:
    """The flags that set ``--name``: its ``add_argument``'s own option strings in
    ``script``'s source (``-b``, ``--batch-size``), the long one first; else ``--name``."""
    call = _add_argument(script, name) if script is not None else None
    given = [a.value for a in getattr(call, "args", ()) if isinstance(getattr(a, "value", None),
                                                                     str) and a.value[:1] == "-"]
    return sorted(given, key=lambda f: not f.startswith("--")) or [f"--{name.lstrip('-')}"]


def flag_value(args: list[str], flags: list[str]) -> int | None:
    """The last value ``args`` give any of ``flags`` (argparse keeps the last)."""
    found = None
    for i, arg in enumerate(args):
        for flag in flags:
            text = args[i + 1] if arg == flag and i + 1 < len(args) else \
                arg.split("=", 1)[1] if arg.startswith(flag + "=") else \
                arg[2:] if _attached(arg, flag) else None
            if text is not None:
                found = int(text) if text.isdigit() else None
    return found
