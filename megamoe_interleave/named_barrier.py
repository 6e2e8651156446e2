"""Named barriers of the fused MoE kernel (0 is the CTA barrier), in the style of flash-attn-4's
``named_barrier.py``: one enum every role and test reads the ids from."""
import enum


class NamedBarrier(enum.IntEnum):
    EpilogueFull = 2  # consumers -> epilogue warps: the output tile is staged
    EpilogueEmpty = 3  # epilogue warps -> consumers: staging tile free, row metadata in smem
    Epilogue = 4  # the epilogue warps among themselves
    Dispatch = 5  # the warps copying Dispatch rows among themselves
    Consumers = 6  # W8A8 half tiles: the two consumer warpgroups exchange their rows' h amax
    Widen = 7  # W4A8 full tiles: both consumer warpgroups have widened their B rows
    WidenWg0 = 8  # W4A8 half tiles: consumer warpgroup 0 among itself
    WidenWg1 = 9  # ... warpgroup 1
    ConsumerStagger = 10  # W8A8 full tiles: warpgroup 0's first batch of the tile has completed
