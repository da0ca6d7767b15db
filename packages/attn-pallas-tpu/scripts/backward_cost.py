"""Counted bytes, FLOPs and DMAs and modelled time of the sparse-MLA backward kernels.

No TPU is needed: ``attn_pallas_tpu.sparse_mla_bwd.backward_cost`` counts what the dq
and dKV kernels move and compute at issue 40's shape (4096 prefill queries at the end
of the context, 2048 selected tokens each from a 32K flat bf16 cache of 640-feature
rows, Dv 512, H 64 and 128; 2048 tokens as 128 units of 16 and as 32 units of 64) and
times it with ``attn_pallas_tpu.plan``'s assumptions. Prints the Markdown table of
docs/tpu_sparse_mla.md ("Training"), one row per (H, unit) for each chip given.

Run (CPU, a second)::

    PYTHONPATH=common/src:packages/attn-pallas-tpu/src \\
        python packages/attn-pallas-tpu/scripts/backward_cost.py --chips v5e
"""

from __future__ import annotations

import argparse

from attn_pallas_tpu.plan import TPU_CHIPS
from attn_pallas_tpu.sparse_mla_bwd import backward_cost

QUERIES, SELECTED, CACHE_ROWS, DK_PAD, DV = 4096, 2048, 32768, 640, 512


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def table(chips) -> str:
    lines = [
        "| chip | H | unit x K | dq bytes (key rows) | dq TFLOP | dq DMAs | dq ms "
        "| dKV bytes (query rows) | dKV TFLOP | dKV DMAs | dKV ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for chip in chips:
        for heads in (64, 128):
            for unit in (16, 64):
                cost = backward_cost(
                    TPU_CHIPS[chip], queries=QUERIES, heads=heads, units=SELECTED // unit,
                    read_block=unit, cache_rows=CACHE_ROWS, dk_pad=DK_PAD, dv=DV,
                )  # fmt: skip
                dq, dkv = cost["dq"], cost["dkv"]
                lines.append(
                    f"| {chip} | {heads} | {unit} x {SELECTED // unit} "
                    f"| {_gib(dq['bytes'])} ({_gib(dq['kv_bytes'])}) | {dq['flops'] / 1e12:.2f} "
                    f"| {dq['dmas']} | {dq['seconds'] * 1e3:.0f} "
                    f"| {_gib(dkv['bytes'])} ({_gib(dkv['kv_bytes'])}) "
                    f"| {dkv['flops'] / 1e12:.2f} | {dkv['dmas']} | {dkv['seconds'] * 1e3:.0f} |"
                )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chips", nargs="+", default=["v5e"], choices=sorted(TPU_CHIPS))
    print(table(parser.parse_args(argv).chips))


if __name__ == "__main__":
    main()
