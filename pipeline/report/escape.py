"""Escaping what the report embeds: JSON for ``<script>`` elements, plotly labels, media URLs, the CSP.

Why this module exists: everything the report page embeds comes from run
directories, which anyone who can write under the report's root (or who
shared a run directory) controls, so none of it may become markup or code.
These are the helpers :mod:`pipeline.report.page` writes it through:
:func:`script_json`/:func:`escape_json_text` (``<``, ``>``, ``&`` and
U+2028/2029 as ``\\u`` escapes: ``</script>`` or ``<!--`` cannot occur),
:func:`plot_text` (plotly reads a subset of HTML in labels),
:func:`media_url` and :func:`csp` (a Content-Security-Policy naming each
script the page may run by its hash).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from typing import Any
from urllib.parse import quote

_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_JSON_UNSAFE = str.maketrans(_JSON_ESCAPES)


def script_json(value: Any) -> str:
    """``value`` as JSON text that is safe inside any ``<script>`` element (see the module docstring)."""
    return escape_json_text(json.dumps(value, allow_nan=False))


def escape_json_text(text: str) -> str:
    """JSON text with ``<``, ``>``, ``&``, U+2028 and U+2029 written as ``\\u`` escapes (still the same JSON).

    Those characters only occur inside JSON strings, where the escape means
    the same character, so any JSON text (plotly's too) stays valid.
    """
    return text.translate(_JSON_UNSAFE)


def plot_text(text: Any) -> str:
    """Text for plotly to draw as it is: plotly reads a subset of HTML (links, styles) in labels.

    Only ``&``, ``<``, ``>`` are escaped: plotly decodes exactly those
    entities (and numeric ones) back to characters, not ``&quot;``.
    """
    return html.escape(str(text), quote=False)


def media_url(relative: str) -> str:
    """The URL by which the page refers to a media file at ``relative`` (under the report's root)."""
    return quote(relative, safe="/")


def csp(scripts: list[str]) -> str:
    """A Content-Security-Policy that lets exactly ``scripts`` (inline, by hash) run, and nothing else."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    return f"script-src {hashes}; object-src 'none'; base-uri 'none'; form-action 'none'"
