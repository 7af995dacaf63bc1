"""What memprof says on stderr while a script runs: each note once, and once for a whole
cluster. The ranks of ``memprof run --nproc-per-node`` share a folder of the notes said
(``$MEMPROF_SAID_DIR``, the launcher's), so that eight ranks that read the same
placeholder values say so once, not eight times.

    say("memprof: virtual GPU: ...")
"""

from __future__ import annotations

import hashlib
import os
import sys

SAID_DIR = "MEMPROF_SAID_DIR"
_said: set[str] = set()


def say(text: str) -> None:
    """Print ``text`` on stderr unless this process, or a rank of its cluster, said it."""
    if text in _said:
        return
    _said.add(text)
    folder = os.environ.get(SAID_DIR)
    if folder:
        mark = os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:32])
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
        except OSError:  # the folder went: say it, as a process of its own would
            pass
    print(text, file=sys.stderr)
