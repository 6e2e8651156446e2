"""Markdown reports from templates: the text lives in a file under ``lab/templates/``, the code
makes the tables and numbers that fill it.

A template file is split by marker lines into named pieces, each a :class:`string.Template`:

* ``<!-- section: NAME -->`` starts a section of the document; the document is its sections in
  the file's order, each left out when the code passes None for it, separated by one blank line.
  A file with several documents names their sections ``DOCUMENT.NAME``.
* ``<!-- row: NAME -->`` starts a piece (a list item, a figure link, a message) that the code
  fills per row or per case (:meth:`Templates.row`) and puts into a section.

Text before the first marker is a comment for the reader and is not rendered.
"""
from __future__ import annotations

import re
from pathlib import Path
from string import Template
from typing import Mapping, Optional, Sequence

TEMPLATES = Path(__file__).resolve().parent / "templates"
_MARKER = re.compile(r"^<!-- (section|row): ([\w.]+) -->\n", re.MULTILINE)


def fmt(x, spec: str = "{:.3f}", none: str = "–") -> str:
    """``x`` formatted by ``spec``; ``none`` for None; str(x) where the spec does not apply."""
    try:
        return none if x is None else spec.format(x)
    except (TypeError, ValueError):
        return str(x)


def md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table (no trailing newline)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Templates:
    """The sections and rows of one template file under ``lab/templates/``."""

    def __init__(self, name: str):
        parts = _MARKER.split((TEMPLATES / name).read_text())
        self.name = name
        self.sections: dict = {}
        self.rows: dict = {}
        for kind, key, text in zip(parts[1::3], parts[2::3], parts[3::3]):
            pieces = self.sections if kind == "section" else self.rows
            if key in pieces:
                raise ValueError(f"{name}: {kind} {key!r} twice")
            pieces[key] = Template(text.rstrip("\n") if kind == "row" else text.strip("\n"))

    def row(self, key: str, /, **values) -> str:
        """The row ``key`` filled with ``values`` (every placeholder must be given)."""
        return self.rows[key].substitute(values)

    def document(self, sections: Mapping[str, Optional[Mapping]], name: Optional[str] = None) -> str:
        """The document ``name`` (None: the file's one document): every section of it with its
        values (None: the section is left out), in the file's order. A section of the document
        missing from ``sections``, or one that it does not have, is an error (a typo would
        otherwise drop text silently)."""
        prefix = "" if name is None else name + "."
        own = {k[len(prefix):]: t for k, t in self.sections.items()
               if k.startswith(prefix) and "." not in k[len(prefix):]}
        unknown, missing = set(sections) - set(own), set(own) - set(sections)
        if unknown or missing:
            raise KeyError(f"{self.name}: sections not in the template {sorted(unknown)}, "
                           f"not given {sorted(missing)}")
        filled = [t.substitute(sections[k]).strip("\n") for k, t in own.items() if sections[k] is not None]
        return "\n\n".join(filled) + "\n"
