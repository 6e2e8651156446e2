#!/usr/bin/env python
"""FA4 + Ulysses post-attention All-to-All on one H200 (paper Section 5.3, Table 3, Fig. 11):
the command line of :mod:`lab.fa4_a2a.bench` (variants, method and flags: ``--help``).

  python scripts/bench_fa_a2a.py                       # full sweep, loopback, P = 8
  python scripts/bench_fa_a2a.py --world host --seqs 8192 16384 32768
  python scripts/bench_fa_a2a.py --stabilize --seqs 49152 65536 --variants fa_only serial serial_symm fused
  torchrun --nproc-per-node 8 scripts/bench_fa_a2a.py --world torch-symm
  python scripts/bench_fa_a2a.py --plot results/h200/fa4_a2a/bench_loopback.json
"""
import sys

from lab.fa4_a2a.bench import main

if __name__ == "__main__":
    sys.exit(main())
