"""lab.report: templates split into sections and rows, documents assembled from the sections given,
and the shipped templates parse with every section a renderer passes."""
from pathlib import Path

import pytest

from lab import report


def _templates(tmp_path, monkeypatch, text):
    monkeypatch.setattr(report, "TEMPLATES", tmp_path)
    (tmp_path / "t.md").write_text(text)
    return report.Templates("t.md")


TEXT = """a comment for the reader
<!-- section: head -->
# $title

<!-- section: notes -->
$notes

<!-- section: other.body -->
second document: $x
<!-- row: item -->
 - $name
"""


def test_document_joins_the_sections_given_in_file_order(tmp_path, monkeypatch):
    t = _templates(tmp_path, monkeypatch, TEXT)
    assert t.document({"notes": {"notes": "n"}, "head": {"title": "T"}}) == "# T\n\nn\n"
    assert t.document({"head": {"title": "T"}, "notes": None}) == "# T\n"
    assert t.document({"body": {"x": 1}}, "other") == "second document: 1\n"
    assert t.row("item", name="a") == " - a"  # a row keeps its leading space, loses its newline


def test_document_rejects_missing_and_unknown_sections(tmp_path, monkeypatch):
    t = _templates(tmp_path, monkeypatch, TEXT)
    with pytest.raises(KeyError, match="not given"):
        t.document({"head": {"title": "T"}})
    with pytest.raises(KeyError, match="not in the template"):
        t.document({"head": {"title": "T"}, "notes": None, "typo": {}})
    with pytest.raises(KeyError):
        t.document({"head": {}, "notes": None})  # a placeholder without a value


def test_md_table_and_fmt():
    assert report.md_table(["a", "b"], [[1, None]]) == "| a | b |\n|---|---|\n| 1 | None |"
    assert report.fmt(None) == "–" and report.fmt(1.23456) == "1.235" and report.fmt("x", "{:.2f}") == "x"


@pytest.mark.parametrize("name, documents", [
    ("megamoe_xstage_readme.md", {None: 14}),
    ("multigpu_report.md", {"topology": 1, "calibration": 3, "fa4_a2a": 3, "megamoe": 1, "correctness": 1}),
])
def test_shipped_templates_parse(name, documents):
    t = report.Templates(name)
    for doc, n in documents.items():
        prefix = "" if doc is None else doc + "."
        assert sum(k.startswith(prefix) and "." not in k[len(prefix):] for k in t.sections) == n


def test_sanitizer_site_table_counts_every_report():
    """lab.sanitize summarises racecheck's listing per (kind, write site, read site): on the committed
    full W8A8 listing, the table over the reports the log kept counts each of them once, and the
    table the run wrote over all 388,192 holds only the staging handoff's two source-line pairs."""
    from lab.sanitize import summarise_sites

    log = Path(__file__).resolve().parents[1] / "results/h200/sanitizers/w8a8/megamoe_w8a8_expert_wave.racecheck.log"
    lines = log.read_text().splitlines()
    sites = summarise_sites(lines)
    assert sum(sites.values()) == sum("Potential RAW hazard" in line for line in lines) > 0
    assert {(k, w.split()[0], r.split()[0]) for k, w, r in sites} == {("RAW", "sm90_fp8.py:284", "sm90_epilogue.py:93")}
    table = lines[lines.index("hazard sites (kind, write, read): reports") + 1:]
    rows = [line.split() for line in table if line.startswith("  RAW ")]
    assert {(r[2], r[5]) for r in rows} == {("sm90_fp8.py:284", "sm90_epilogue.py:93"), ("sm90_fp8.py:274", "sm90_fp8.py:111")}
    assert sum(int(r[-1]) for r in rows) == 388_168