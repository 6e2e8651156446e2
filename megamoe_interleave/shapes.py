"""MoE layer shapes of the paper's models (hidden H, expert intermediate I, routed experts E, top-k).

``None`` fields are unknown: we found no public configuration we could cite.
Each shape's ``source`` cites the DeepGEMM Mega MoE test/bench defaults it comes from, as
``<repo> <commit or branch> <file>:<lines>``: UP is upstream
https://github.com/deepseek-ai/DeepGEMM and FK the fork https://github.com/AichenF/DeepGEMM;
one shape cites an issue of https://github.com/sgl-project/DeepGEMM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: Optional[int]
    intermediate: Optional[int]
    num_experts: Optional[int]
    topk: Optional[int]
    source: str

    @property
    def known(self) -> bool:
        return None not in (self.hidden, self.intermediate, self.num_experts, self.topk)

    def flops_per_token_pick(self) -> int:
        """Multiply-adds x2 of one (token, expert) pick: L1 (H x 2I) + L2 (I x H)."""
        return 2 * self.hidden * self.intermediate * 3


SHAPES = {
    s.name: s
    for s in [
        MoEShape("deepseek-v4-pro", 7168, 3072, 384, 6,
                 "UP 54e2261 tests/test_mega_moe.py:287-291; FK megamoe_sm90_opt tests/bench_mega_moe_sm90.py:31-36"),
        MoEShape("deepseek-v4-flash", 4096, 2048, 256, 6,
                 "FK megamoe_sm90_opt tests/bench_mega_moe_sm90.py:25-30"),
        MoEShape("mimo-v2.5-pro", 6144, 2048, 384, 8,
                 "FK opt/megamoe-sm90-fp8-h200-retune scripts/h200_fp8_matrix_runner.py:33-38"),
        MoEShape("mimo-v2-flash", 4096, 2048, 256, 8,
                 "UP refs/pull/360/head tests/test_mega_moe_sm90_mimo.py:99-112"),
        MoEShape("deepseek-r1", 7168, 2048, 256, 8,
                 "FK megamoe_nvfp4 NVFP4_MEGAMOE.md:68 (DeepSeek-V3/R1 geometry)"),
        MoEShape("glm-5.3-flash", 4096, 2048, 288, 8,
                 "sgl-project/DeepGEMM#88 description (issue text, not a config file)"),
        MoEShape("dit-moe", None, None, None, None, "unknown: no public config found for the paper's variant"),
        MoEShape("qwen3.5", None, None, None, None, "unknown: no public config found"),
        MoEShape("hunyuan-hy3", None, None, None, None, "unknown: no public config found"),
        MoEShape("glm-5.2", None, None, None, None, "unknown: no public config found"),
    ]
}


def get_shape(name: str) -> MoEShape:
    try:
        s = SHAPES[name]
    except KeyError:
        raise KeyError(f"unknown shape {name!r}; known: {sorted(SHAPES)}") from None
    if not s.known:
        raise ValueError(f"shape {name!r} has unknown dimensions ({s.source})")
    return s
