"""Whether a report's command was recorded by ``memprof run`` here, for this user.

``memprof suggest --verify`` and ``--fit-batch`` re-run the command a report recorded. A
report is a file anyone can hand over (a CI artifact, an issue attachment), and a command
such as ``-m timeit -s CODE`` runs any code, so a recorded command is re-run only when the
report carries a signature that only this user's memprof can make: an HMAC-SHA256 of
everything a re-run takes from the report, keyed by a secret kept in the user's config
folder (created on first use, readable by the user alone), as Jupyter trusts the notebooks
a user saved. Any other report's command is re-run only when the user gives it.

    facts["signature"] = sign(facts)    # memprof run, before writing report.json
    if not signed_here(facts): ...      # memprof suggest, before re-running
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

KEY_BYTES = 32
SIGNED = ("command", "cwd", "virtual_gpu", "predicted", "allocator_conf", "optimizer_steps",
          "world_size", "rank")


def key_path() -> Path:
    """The secret's file: ``$XDG_CONFIG_HOME/memprof/run-key`` (``~/.config`` by default)."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "memprof" / "run-key"


def sign(facts: dict[str, Any]) -> str | None:
    """The signature of a run's facts, or None where no secret can be kept (an unwritable
    home): such a report's command is then re-run only when the user gives it."""
    key = _key(create=True)
    return None if key is None else _mac(key, facts)


def signed_here(facts: dict[str, Any]) -> bool:
    """Whether ``facts`` carry this user's signature of exactly what a re-run uses."""
    key = _key(create=False)
    signature = facts.get("signature")
    return key is not None and isinstance(signature, str) and \
        hmac.compare_digest(signature, _mac(key, facts))


def _mac(key: bytes, facts: dict[str, Any]) -> str:
    # a launcher's variables and the cards, where there were any (reports signed before
    # they were kept stay signed): dropping or adding them breaks the signature either way
    names = SIGNED + tuple(name for name in ("launcher_env", "cards")
                           if facts.get(name) is not None)
    signed = json.dumps([facts.get(name) for name in names], sort_keys=True, default=repr)
    return hmac.new(key, signed.encode(), hashlib.sha256).hexdigest()


def _key(create: bool) -> bytes | None:
    path = key_path()
    with contextlib.suppress(OSError):
        key = path.read_bytes()
        return key if len(key) == KEY_BYTES else None
    if not create:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another memprof made it a moment ago
        return _key(create=False)
    except OSError:
        return None
    key = secrets.token_bytes(KEY_BYTES)
    with os.fdopen(fd, "wb") as out:
        out.write(key)
    return key
