"""Tokens per user, padded vs packed ranker rows (host only, no GPU).

Simulates the issue's batch (``attn_mosaic_gpu.bench.simulate_ranker_users``: 10,000
users, history log-normal with median 200 and sigma 1.0 capped at 1024, 64 candidates)
and reports, for the phoenix layout padded to S = 1152 and for first-fit-decreasing
packing at S = 2048 and 4096 (with and without a cap on users per row): rows, tokens
processed per user (``rows * S / users``: what the projections and MLPs pay), packing
efficiency and the ratio to padded. Run: ``python benchmarks/packing_stats.py``.
"""

from __future__ import annotations

import argparse
import time

from attn_common.packing import pack_users
from attn_mosaic_gpu.bench import simulate_ranker_users


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    hist, cand = simulate_ranker_users(args.users, seed=args.seed)
    n = len(hist)
    real = float((hist + cand).sum()) / n
    padded = 1152
    print(
        f"{n} users: mean {real:.1f} real tokens/user (history median 200, sigma 1.0, cap 1024, 64 candidates)"
    )
    print(
        f"{'layout':<28}{'rows':>7}{'U':>5}{'tokens/user':>13}{'efficiency':>12}{'vs padded':>11}{'pack s':>8}"
    )
    print(
        f"{'padded S=1152':<28}{n:>7}{1:>5}{padded:>13.1f}{real / padded:>12.3f}{1.0:>10.2f}x{'-':>8}"
    )
    for seq_len in (2048, 4096):
        for cap in (None, 16, 8):
            start = time.perf_counter()
            p = pack_users(hist, cand, seq_len=seq_len, max_users_per_row=cap)
            secs = time.perf_counter() - start
            per_user = p.rows * seq_len / n
            name = f"packed S={seq_len}" + ("" if cap is None else f", U<={cap}")
            print(
                f"{name:<28}{p.rows:>7}{p.users_per_row:>5}{per_user:>13.1f}"
                f"{p.efficiency:>12.3f}{padded / per_user:>10.2f}x{secs:>8.2f}"
            )


if __name__ == "__main__":
    main()
