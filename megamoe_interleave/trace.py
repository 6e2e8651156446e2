"""Decoding the fused kernel's per-tile trace (``MegaMoEConfig(trace=True)``: ``MegaMoE.last_trace``)."""
from __future__ import annotations

import torch

from .config import TRACE_FIELDS


def trace_mainloop_cycles(cycles: int, t_start: int, t_ready: int, t_mainloop: int):
    """(SM clock in GHz, mainloop in cycles) of one trace row, or None without cycles (older
    traces) or for an empty span: the row's cycles cover tile start -> mainloop end, so its
    clock is cycles / ns over that span, and the mainloop (first stage landed -> last WGMMA
    retired) in cycles is that clock times its ns -- comparable with the tensor pipe's ideal
    (4096 bf16 FLOP per cycle per SM), which the GPU's DVFS clock is not."""
    if cycles <= 0 or t_mainloop <= t_start:
        return None
    clock = cycles / (t_mainloop - t_start)
    return clock, clock * (t_mainloop - t_ready)


def decode_trace(trace: torch.Tensor):
    """Per-tile records of one rank's trace tensor (see ``config.TRACE_FIELDS``): a list per CTA,
    in execution order, of dicts with phase, row, n_block and the other TRACE_FIELDS."""
    out = []
    for cta_rows in trace.cpu().tolist():
        recs = []
        for values in cta_rows:
            key = values[0]
            if key < 0:
                break
            rec = dict(phase=key >> 40, row=(key >> 16) & 0xFFFFFF, n_block=key & 0xFFFF)
            rec.update(zip(TRACE_FIELDS[1:], values[1:]))
            recs.append(rec)
        out.append(recs)
    return out
