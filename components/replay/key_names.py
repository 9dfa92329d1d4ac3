"""Which key parts a disk replay can store as file names: one rule, for the storage, a resume's check and the plan.

Its own module, free of tensordict, so the plan and a resume check read it
without loading tensordict (and ``torch._dynamo``, about 2 s of a fresh process)
before a run knows it will start.
"""

from __future__ import annotations

import re
from typing import Any

_FILE_NAME_PART = re.compile(r"[A-Za-z0-9_.-]+")


def names_a_file(part: Any) -> bool:
    """Whether one part of a key may name a file (or directory) of a disk storage: plain characters, not ``.``
    or ``..``. A resume checks a saved layout with it, the plan a Dict observation's keys.

    Examples:
        >>> names_a_file("pixels"), names_a_file("a/b"), names_a_file(".."), names_a_file(3)
        (True, False, False, False)
    """
    return isinstance(part, str) and bool(_FILE_NAME_PART.fullmatch(part)) and part not in (".", "..")
