"""The README's results table quotes numbers its sources hold: every number of a row's value cell is,
to the digits quoted, a number of the document the row links to -- or its reciprocal, since the table states every ratio as our time / the baseline's
while a source may state the baseline / ours. A result rerun and a table not updated (or the
other way round) fails here. CPU only."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])")
HEADER = "| measurement | value | baseline | source |"


def results_rows(text):
    """(measurement, value cell, linked path) of each row of the README's results table."""
    lines = text.splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        link = re.search(r"\]\(([^)#]+)", cells[3])
        rows.append((cells[0], cells[1], link.group(1) if link else None))
    return rows


def source_numbers(doc: Path):
    """Every decimal number of the linked document (not of its data files: among their thousands of
    numbers a quoted one would be found by chance)."""
    return [float(m) for m in NUMBER.findall(doc.read_text())]


def quoted_by(value: str, numbers) -> bool:
    digits = len(value.split(".")[1])
    want = float(value)
    return any(round(n, digits) == want or (n > 0 and round(1 / n, digits) == want) for n in numbers)


def unsourced(text):
    """(measurement, number, source) of each quoted number its source does not hold."""
    bad = []
    for what, value, link in results_rows(text):
        numbers = source_numbers(ROOT / link) if link else []
        bad += [(what, v, link) for v in NUMBER.findall(value) if not quoted_by(v, numbers)]
    return bad


def test_readme_results_are_their_sources_numbers():
    rows = results_rows((ROOT / "README.md").read_text())
    assert len(rows) >= 10 and all(link for _, _, link in rows), "every row links its source"
    assert unsourced((ROOT / "README.md").read_text()) == []


def test_the_check_can_fail():
    text = (ROOT / "README.md").read_text()
    what, value, link = results_rows(text)[0]
    changed = text.replace(f"| {value} |", "| 0.1234x |", 1)
    assert unsourced(changed) == [(what, "0.1234", link)]
