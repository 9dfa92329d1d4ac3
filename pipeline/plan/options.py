"""The option files of ``conf/``: which groups a user picks from, and what each option says of itself.

``python -m pipeline --help``, the generated config reference and the plan's
preset line all describe options by the first comment of their files; this
module reads those files, so the description lives in the yaml only.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline import CONF_DIR

#: groups Hydra applies on its own (``specialize: ${trainer}_${env}``): not a choice
AUTOMATIC = ("specialize",)


def option_summary(path: Path, width: int | None = 76) -> str:
    """The first sentence of an option file's opening comment (after a ``@package`` line), cut to ``width``.

    ``width=None``: the whole comment.
    """
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not text.startswith("@package"):
            words.append(text)
    text = " ".join(words)
    if width is None:
        return text
    end = re.search(r"(?<!e\.g)(?<!i\.e)\. ", text)
    text = text[: end.start() + 1] if end else text
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def groups(conf_dir: Path = CONF_DIR) -> dict[str, list[Path]]:
    """Each group a user picks from (a folder of option files) and its options, sorted."""
    out = {}
    for folder in sorted(p for p in conf_dir.iterdir() if p.is_dir() and p.name not in AUTOMATIC):
        options = sorted(folder.glob("*.yaml"))
        if options:
            out[folder.name] = options
    return out
