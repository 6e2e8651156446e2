"""Environment and world check before the multi-GPU measurements (issue 6, step 0).

Per rank: GPU name and SM count, peer access to every other GPU, the packages the kernels need
(CuTe DSL, flash-attn-4, quack), NVLink multicast switched off; across ranks: an NCCL
all-reduce with a known answer, and a symmetric-memory round trip (rank r writes a rank-tagged
pattern into rank r+1's buffer through the peer mapping, every rank checks what it received,
for both the ``xstage.world`` peer table addresses and torch's peer views).  Rank 0 writes
``env.json`` with every rank's report, the topology (``nvidia-smi topo -m``) and provenance;
exit status 1 when any check failed.

  torchrun --nproc-per-node=8 -m lab.multigpu_envcheck --world torch-symm --out results/h200x8/topology
  python -m lab.multigpu_envcheck --world loopback --P 4 --out results/h200x1-loopback/topology

(``scripts/multigpu/envcheck.py`` is the same command line.)
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from lab import bench
from lab import multigpu as mg

# Checked by name only (an import that fails is reported): xstage itself uses none of them.
PACKAGES = ("cutlass", "flash_attn.cute", "quack", "fa4_a2a", "megamoe_interleave", "calibration")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mg.add_world_args(p, default_out="results/h200xN/topology", trials=1)
    return p.parse_args(argv)


def package_report():
    out = {}
    for name in PACKAGES:
        try:
            m = importlib.import_module(name)
            out[name] = getattr(m, "__version__", "ok")
        except Exception as e:  # report, do not stop: the summary flags it
            out[name] = f"MISSING: {type(e).__name__}: {e}"
    return out


def rank_report(ctx) -> dict:
    import torch

    dev = ctx.device
    n = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(dev)
    rep = {"rank": ctx.rank, "device": str(dev), "name": props.name, "sms": props.multi_processor_count,
           "capability": list(torch.cuda.get_device_capability(dev)), "visible_gpus": n,
           "peer_access": {str(j): bool(torch.cuda.can_device_access_peer(dev.index, j))
                           for j in range(n) if j != dev.index},
           "packages": package_report(), "env": {k: os.environ.get(k) for k in mg.MULTICAST_ENV},
           "checks": {}}
    rep["checks"]["hopper"] = rep["capability"] == [9, 0]
    rep["checks"]["packages"] = not any(str(v).startswith("MISSING") for v in rep["packages"].values())
    rep["checks"]["multicast_off"] = all(os.environ.get(k) == v for k, v in mg.MULTICAST_ENV.items()) \
        or ctx.backend == "loopback"
    return rep


def round_trip(ctx) -> dict:
    """NCCL all-reduce and symmetric-memory peer writes with known answers (every rank)."""
    import torch

    P, res = ctx.P, {}
    if ctx.distributed:
        import torch.distributed as dist

        t = torch.full((4,), float(ctx.rank + 1), device=ctx.device)
        dist.all_reduce(t)
        res["nccl_all_reduce"] = bool(torch.all(t == P * (P + 1) / 2).item())
    n = 1 << 20
    # torch peer views (the symmetric-memory A2A baseline's path): r writes r+1's buffer.
    views, keep = mg.symm_peer_views(ctx, (n,), torch.int32)
    for r in ctx.local_ranks:
        views[r][r].fill_(-1)
    ctx.world.barrier()
    for r in ctx.local_ranks:
        views[r][(r + 1) % P].copy_(torch.arange(n, device=ctx.device, dtype=torch.int32) + 1000 * r)
    ctx.world.barrier()
    ok = True
    for r in ctx.local_ranks:
        src = (r - 1) % P
        ok &= bool(torch.equal(views[r][r], torch.arange(n, device=ctx.device, dtype=torch.int32) + 1000 * src))
    res["symm_peer_views"] = ok
    # xstage.world peer table (what the kernels use): addresses seen from r must be distinct, aligned.
    buf = ctx.world.alloc((n,), torch.int32)
    for r in ctx.local_ranks:
        addrs = buf.addresses(r)
        res.setdefault("world_peer_table", True)
        res["world_peer_table"] &= len(set(addrs)) == P and all(a % 16 == 0 for a in addrs) \
            and addrs[r] == buf.local(r).data_ptr()
    ctx.world.barrier()
    del keep, buf
    return res


def _run(ctx, args) -> int:
    rep = rank_report(ctx)
    try:
        rep["checks"].update(round_trip(ctx))
    except Exception as e:
        rep["checks"]["round_trip"] = False
        rep["round_trip_error"] = f"{type(e).__name__}: {e}"
    reports = ctx.gather(rep)
    ok = False
    if ctx.is_root:
        ok = all(all(r["checks"].values()) for r in reports)
        payload = {**mg.header(ctx, "topology", args), "ranks": reports, "all_ok": ok,
                   "nvlink_status": mg.run_text(["nvidia-smi", "nvlink", "--status"])}
        path = bench.write_result(args.out, "env", payload)
        for r in reports:
            bad = [k for k, v in r["checks"].items() if not v]
            print(f"rank {r['rank']}: {r['name']} sms={r['sms']} " + ("ok" if not bad else f"FAILED {bad}"))
        print(f"wrote {path}")
    return 0 if ctx.from_root(ok) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    return mg.run_entry(args, lambda ctx: _run(ctx, args))


if __name__ == "__main__":
    sys.exit(main())
