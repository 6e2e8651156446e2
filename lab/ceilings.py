#!/usr/bin/env python3
"""Measure the two ceilings of the GPU (device METHOD): device-to-device copy
bandwidth (bytes read + written) and dense bf16 matrix rate on random data.

    python scripts/measure_ceilings.py --out results/h200/ceilings.json
"""
import argparse
import sys

import torch

from lab.timing import bench_graph
from xstage.provenance import write_json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/h200/ceilings.json")
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--gemm", type=int, default=8192)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    n = int(a.copy_gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy = bench_graph(lambda: dst.copy_(src), replays=10, trials=21)
    assert torch.equal(dst, src)
    copy_tbps = 2 * src.numel() * 2 / (t_copy.median_us * 1e-6) / 1e12
    src = dst = None  # free 8 GiB before the GEMM buffers
    m = a.gemm
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, m, device="cuda", dtype=torch.bfloat16)
    t_mm = bench_graph(lambda: torch.mm(x, y, out=out), replays=10, trials=21)
    ref = (x[:64].double() @ y.double()).to(torch.bfloat16)
    assert (out[:64].double() - ref.double()).norm() / ref.double().norm() < 1e-2
    tflops = 2 * m**3 / (t_mm.median_us * 1e-6) / 1e12
    print(f"copy: {copy_tbps:.2f} TB/s (read+write, {a.copy_gib} GiB), median {t_copy.median_us:.1f} us")
    print(f"bf16 gemm {m}^3: {tflops:.0f} TFLOP/s, median {t_mm.median_us:.1f} us")
    write_json(a.out, {"copy_TBps": copy_tbps, "copy": t_copy.as_dict(), "bf16_dense_tflops": tflops,
                       "gemm_n": m, "gemm": t_mm.as_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
