"""PTX text helpers shared by the compile tests."""
import re


def try_wait_loops(ptx):
    """For every mbarrier.try_wait in the PTX: the lines of the innermost loop (a backward
    branch and its target label) that contains it, or None when it is in no loop (the fast
    first try of a bounded wait)."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^\s*(\$?[\w.]+):", ln))}
    loops = []
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$?[\w.]+);", ln)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            loops.append((labels[m.group(1)], i))
    out = []
    for i, ln in enumerate(lines):
        if "mbarrier.try_wait" in ln:
            inner = [(a, b) for a, b in loops if a <= i <= b]
            a, b = min(inner, key=lambda ab: ab[1] - ab[0]) if inner else (None, None)
            out.append(None if a is None else lines[a:b + 1])
    return out
