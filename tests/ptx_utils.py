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
    # the entry's name, class and argument types mangled in (a typed-arguments object renames it)
    for name in set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx)):
        ptx = ptx.replace(name, "KERNEL")
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


def window_states(lines, opens, closes, *, must: bool):
    """Per line of ``lines`` (one straight-line region of PTX, e.g. one warp role's code): whether
    control is inside a window that a line matching ``opens`` starts and one matching ``closes``
    ends, following the branches (labels, ``bra``; a predicated branch may fall through).
    ``must``: inside on every path (a line needs the window); else on some path (a line must
    stay out of it). Branches to labels outside the region are exits. The state at the region's
    start is "outside"."""
    label_at = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^\s*(\$?[\w.]+):", ln))}
    starts = sorted({0, *label_at.values()} | {i + 1 for i, ln in enumerate(lines) if re.search(r"\bbra\b", ln)})
    starts = [s for s in starts if s < len(lines)]
    ends = starts[1:] + [len(lines)]
    block_of = {s: b for b, s in enumerate(starts)}
    succ = []
    for s, e in zip(starts, ends):
        last = lines[e - 1]
        nxt = []
        m = re.search(r"\bbra(?:\.uni)?\s+(\$?[\w.]+);", last)
        if m and m.group(1) in label_at:
            nxt.append(block_of[label_at[m.group(1)]])
        unconditional = m and not re.match(r"^\s*@", last)
        if not unconditional and not re.search(r"\b(ret|exit)\b", last) and e < len(lines):
            nxt.append(block_of[e])
        succ.append(nxt)

    def run(block, state):
        out = []
        for ln in lines[starts[block]:ends[block]]:
            if re.search(opens, ln):
                state = True
            elif re.search(closes, ln):
                state = False
            out.append(state)
        return state, out

    unset = object()
    state_in = [unset] * len(starts)
    state_in[0] = False
    work = [0]
    while work:
        b = work.pop()
        out_state, _ = run(b, state_in[b])
        for n in succ[b]:
            old = state_in[n]
            new = out_state if old is unset else ((old and out_state) if must else (old or out_state))
            if old is unset or new != old:  # states only fall (must) or rise (may): this ends
                state_in[n] = new
                work.append(n)
    states = []
    for b in range(len(starts)):
        # a block no path reaches keeps "outside"
        states += run(b, False if state_in[b] is unset else state_in[b])[1]
    return states
