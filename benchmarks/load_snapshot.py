"""The baseline: a bare restricted unpickle of a snapshot, nothing else (run as a script)."""

import pickle
import sys


class Refuse(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"{module}.{name}")


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        Refuse(f).load()
