#!/usr/bin/env python3
"""Show X-Stage transients with the fluid simulator: how many bursts pass before
steady state, for a platform profile and a sweep of gaps.

    python scripts/simulate_transients.py --platform paper-b200-nvlink --producers 148 \
        --bytes-per-producer 32768 --gaps-us 0,1,2,4,5,5.5,6,8 [--plot out.png] [--json out.json]

Prints per gap: steady issue time and period (simulated vs eq. 2-3), and the
number of bursts until the outstanding volume settles (the transient).
"""
import argparse
import json
import sys

from xstage import model, profiles
from xstage.simulate import simulate, steady_state_index


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--platform", default="paper-b200-nvlink")
    ap.add_argument("--producers", type=int, default=None)
    ap.add_argument("--bytes-per-producer", type=int, default=32768)
    ap.add_argument("--gaps-us", default="0,1,2,3,4,5,5.5,6,7,8")
    ap.add_argument("--bursts", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    try:
        p = profiles.load(a.platform)
        gaps = [float(x) * 1e-6 for x in a.gaps_us.split(",")]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    k = a.producers or p.num_sms
    v = k * a.bytes_per_producer
    t0, q = p.t_iss0_at(k, v), p.q_at(k)
    rows = []
    print(f"{p.name}: K={k} V={v / 2**20:.3f} MiB T_iss0={t0 * 1e6:.3f} us R={p.R / 1e9:.0f} GB/s "
          f"Q={q / 2**20:.3f} MiB G*={model.recovery_gap(v, p.R, t0) * 1e6:.3f} us")
    print(f"{'G (us)':>7} {'T_iss sim':>10} {'T_iss eq3':>10} {'period sim':>11} {'period eq2':>11} {'transient':>10}")
    for g in gaps:
        r = simulate(t0, p.R, q, v, g, n=a.bursts)
        n_tr = steady_state_index(r.q_end, rel_tol=1e-9)
        row = {"gap_us": g * 1e6, "issue_sim_us": r.issue_time[-1] * 1e6,
               "issue_model_us": model.steady_issue_time(g, v, p.R, t0, q) * 1e6,
               "period_sim_us": r.period[-2] * 1e6,
               "period_model_us": (model.steady_issue_time(g, v, p.R, t0, q) + g) * 1e6,
               "transient_bursts": n_tr, "issue_trace_us": (r.issue_time[:200] * 1e6).tolist()}
        rows.append(row)
        print(f"{row['gap_us']:7.2f} {row['issue_sim_us']:10.3f} {row['issue_model_us']:10.3f} "
              f"{row['period_sim_us']:11.3f} {row['period_model_us']:11.3f} "
              f"{'>' + str(a.bursts) if n_tr is None else n_tr:>10}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"platform": p.name, "K": k, "V": v, "rows": rows}, f, indent=2)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for row in rows:
            ax.plot(row["issue_trace_us"], label=f"G={row['gap_us']:.1f} us")
        ax.set_xlabel("burst index")
        ax.set_ylabel("issue time (us)")
        ax.set_title(f"X-Stage transient, {p.name}, V={v / 2**20:.2f} MiB")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
