"""The shipped fused-kernel builds are the program they were (CPU, sm_90a): the canonical PTX
(ptx_utils.canonical_ptx: registers renamed by first use, names and comments dropped) of the four
default builds -- DeepSeek-V4-Flash at P = 1 and loopback P = 8, both schedules, through
MegaMoEConfig.resolve -- hashes to tests/golden/megamoe_default_ptx.json, which was computed from
the kernel before the redesign; the W8A8 builds' hashes were added with the fix of issue 39 (the
scale rows' clamp). Instrumentation and other options must leave these builds alone;
a change that alters one on purpose updates the file and says why.

    python tests/test_megamoe_ptx_golden.py     # print the current hashes

The DSL's PTX depends on its toolkit flavor (xstage.cute_compile.dsl_toolkit: cu12 or cu13, the
GPU host's), so the file holds one set of hashes per flavor and the test compares the active one's.
The W4A8 builds and the small-batch builds (512 tokens per rank: the CTA pair split along N) are
pinned for cu13 only.
"""
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

# as a script: ptx_utils, and this checkout's packages before any installed copy
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from ptx_utils import canonical_ptx  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden" / "megamoe_default_ptx.json"
BUILDS = [(P, s, precision, 8192) for precision in ("bf16", "w8a8", "w4a8") for P in (1, 8)
          for s in ("expert_wave", "interleaved")]
BUILDS += [(1, "interleaved", precision, 512) for precision in ("bf16", "w8a8", "w4a8")]  # the pair split along N


def build_name(P, schedule, precision, tokens=8192):
    return f"P{P}_{schedule}" + ("" if precision == "bf16" else f"_{precision}") + ("" if tokens == 8192 else f"_T{tokens}")


def build_hash(P, schedule, precision="bf16", tokens=8192):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from megamoe_interleave.config import MegaMoEConfig
    from megamoe_interleave.kernel import compile_megamoe_sm90
    from megamoe_interleave.shapes import get_shape

    shape = get_shape("deepseek-v4-flash")
    config = MegaMoEConfig(schedule, precision=precision).resolve(shape, P, tokens, 132)
    with tempfile.TemporaryDirectory() as d:
        compile_megamoe_sm90(shape.hidden, shape.intermediate, config.kernel_key(), options=f"--keep-ptx --dump-dir={d}")
        ptx = "\n".join(Path(d, f).read_text() for f in sorted(os.listdir(d)) if f.endswith(".ptx"))
    assert ptx, "no PTX produced"
    return hashlib.sha256(canonical_ptx(ptx).encode()).hexdigest()


@pytest.mark.compile
@pytest.mark.parametrize("P,schedule,precision,tokens", BUILDS)
def test_shipped_build_is_the_golden_program(P, schedule, precision, tokens):
    from xstage.cute_compile import dsl_toolkit

    builds = json.loads(GOLDEN.read_text())["builds"]
    toolkit = dsl_toolkit()
    assert toolkit in builds, f"no golden hashes for the DSL's {toolkit} flavor in {GOLDEN.name}"
    name = build_name(P, schedule, precision, tokens)
    if name not in builds[toolkit]:  # pinned later than the first builds, for the GPU host's flavor only
        pytest.skip(f"no {toolkit} hash for {name}")
    want = builds[toolkit][name]
    assert build_hash(P, schedule, precision, tokens) == want, f"the {name} build changed: see {GOLDEN.name}"


def test_canonical_ptx_ignores_register_numbering_only():
    a = ".reg .b32 %r<9>;\n\tadd.s32 %r5, %r3, 1;\n\tst.global.b32 [%rd7], %r5; // x\n"
    b = ".reg .b32 %r<12>;\n\tadd.s32 %r8, %r2, 1;\n\tst.global.b32 [%rd1], %r8;\n"
    assert canonical_ptx(a) == canonical_ptx(b)
    assert canonical_ptx(a) != canonical_ptx(a.replace("add.s32", "sub.s32"))
    assert canonical_ptx(a) != canonical_ptx("\tadd.s32 %r5, %r3, 1;\n\tst.global.b32 [%rd7], %r3;\n")


if __name__ == "__main__":
    from xstage.cute_compile import dsl_toolkit

    for build in BUILDS:
        print(dsl_toolkit(), build_name(*build), build_hash(*build))
