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


def canonical_ptx(ptx: str) -> str:
    """PTX with comments, debug lines, register declarations and the kernel's (class-derived)
    name removed and every register renamed by first use: two builds of the same program --
    whatever Python code structure or SSA order produced them -- give the same text."""
    ptx = re.sub(r"kernel_cutlass_kernel_\w*?_object_at_", "KERNEL_", ptx)
    maps = {}

    def rename(m):
        regs = maps.setdefault(m.group(1), {})
        return "%" + m.group(1) + str(regs.setdefault(m.group(2), len(regs)))
    out = []
    for line in ptx.splitlines():
        line = line.split("//")[0].rstrip()
        s = line.strip()
        if not s or s.startswith((".loc", ".file", ".reg ")):
            continue
        out.append(re.sub(r"%([a-z]+)(\d+)\b", rename, line))
    return "\n".join(out)
