"""Configuration facts of the fused kernel that the host side needs without the CuTe DSL: the
tile-math kinds, the trace row layout, the split-tail rule and the pair tiles per row. :mod:`kernel_sm90` and
:mod:`api` both take them from here (one definition, no mirrored copies)."""
from __future__ import annotations

MMA_KINDS = ("fma", "wgmma", "wgmma_cpasync", "tma_ws", "tma_ws_mcast", "tma_ws_mcast_b")
WS_KINDS = ("tma_ws", "tma_ws_mcast", "tma_ws_mcast_b")  # warp-specialized TMA mainloops

# Per-tile trace row (trace=True): phase<<40 | row<<16 | n_block, then %globaltimer (ns) at
# tile start, after the L1-dependency wait (L2; = start for L1), after the mainloop, after
# the epilogue (L2: every thread's Combine stores issued; L1: h stored, before the release),
# the SM id, and the SM cycles (%clock64) from tile start to mainloop end. tma_ws*: timestamps
# are the consumers' (thread 0); t_ready = when the tile's first ring stage had landed (for L2
# tiles that is after the producer's dependency wait).
TRACE_FIELDS = ("key", "t_start", "t_ready", "t_mainloop", "t_epilogue", "smid", "cycles")


def resolve_split_tail(mma: str, block_m: int, split_tail: bool | None) -> bool:
    """Whether m-blocks with <= 64 valid rows run as 64-row tiles (N split over the two consumer
    warpgroups): only tma_ws* with 128-row tiles can; None = on wherever it can. Raises
    ValueError when asked for where it cannot."""
    can = mma in WS_KINDS and block_m == 128
    if split_tail and not can:
        raise ValueError("split_tail needs mma in tma_ws* and block_m=128")
    return can if split_tail is None else bool(split_tail)


def pair_tiles_per_row(mma: str, n_cols: int, block_n: int) -> int:
    """Pair tiles of one scheduler row over ``n_cols`` output columns: a CTA pair covers one
    N block (tma_ws_mcast_b: the pair splits M) or two adjacent ones (the other kinds)."""
    return n_cols // block_n // (1 if mma == "tma_ws_mcast_b" else 2)
