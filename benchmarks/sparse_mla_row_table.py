"""What the Hopper sparse-MLA op spends on its row table, and cheaper ways to build it.

Times, per benchmark case (CUPTI median), ``sparse_mla_units`` + ``selected_rows`` as
the Hopper op runs them (token-level selections by the table kernel of
``attn_mosaic_gpu.row_sort``: sort, repeats dropped, compaction), the same with XLA's
sorts (with ``num_rows``: one packed 1-D array, CUB's radix sort; without: the batched
``[N, K]`` sort), XLA's sorts and the table kernel alone; for unit selections, the
expansion of units to rows by a scatter, a scan and gathers against the op's fused
max-reduction; for token-level selections
(``read_block == 1``), two-sort builds (sort; mark repeats absent; sort again) that
need no prefix sum and no scatter, batched and packed, and the op's table of the same
ids with one repeated (a batch with a repeat pays for the compaction that one without
skips). Every variant's table but that one is checked equal to the op's, and its sorts
and scatters are listed from the compiled HLO::

    python benchmarks/sparse_mla_row_table.py --out /tmp/r --cases 'flat-h128-*'

Writes ``sparse_mla_row_table.json`` into ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from fnmatch import fnmatch
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import sparse_mla_rows as rows_module
from attn_common.cli_args import provenance
from attn_common.sparse_mla_rows import (
    ABSENT,
    row_table_width,
    selected_rows,
    sort_rows,
    sparse_mla_units,
)
from attn_mosaic_gpu import row_sort
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.bench_sparse_mla import CASES

sys.path.insert(0, str(Path(__file__).parent))
from sparse_mla_variants import case_problem  # a sibling script

BLOCK = 64  # the kernel's row-table multiple (2 * block_k)


def two_sort_rows(units, *, block: int = BLOCK, num_rows: int | None = None):
    """``selected_rows`` for ``read_block == 1`` by two sorts (no cumsum, no scatter)."""
    n, top_k = units.first_row.shape
    width = row_table_width(top_k, 1, block)
    valid = (units.first_row >= 0) & (units.first_pos <= units.position[:, None])
    valid &= units.first_pos < units.kv_len[:, None]
    key = sort_rows(jnp.where(valid, units.first_row, ABSENT), num_rows)
    repeat = jnp.concatenate([jnp.zeros((n, 1), bool), key[:, 1:] == key[:, :-1]], axis=1)
    key = sort_rows(jnp.where(repeat, ABSENT, key), num_rows)
    counts = (key != ABSENT).sum(axis=1, dtype=jnp.int32)
    rows = jnp.where(key == ABSENT, -1, key)
    return jnp.pad(rows, ((0, 0), (0, width - top_k)), constant_values=-1), counts


def time_case(case, iterations: int) -> list[dict]:
    """The row-table variants of one benchmark case (see the module docstring)."""
    inputs, problem, tables = case_problem(case)
    _, kv, idx, pos = inputs["args"]

    def units_only(kv, idx, pos, tables):
        return sparse_mla_units(problem, kv, idx, pos, **tables)[0]

    num_rows = int(np.prod(kv.shape[:-1]))  # the store's rows, as the op passes them

    def table(kv, idx, pos, tables, num_rows=num_rows, token_table=row_sort.token_rows):
        units = units_only(kv, idx, pos, tables)
        return selected_rows(
            units,
            read_block=problem.read_block,
            block=BLOCK,
            num_rows=num_rows,
            token_table=token_table,
        )

    def table_scatter(kv, idx, pos, tables):  # its own function: its own jit trace
        return table(kv, idx, pos, tables)

    def sort_only(kv, idx, pos, tables, num_rows=None):
        first_row = units_only(kv, idx, pos, tables).first_row
        return sort_rows(jnp.where(first_row >= 0, first_row, ABSENT), num_rows)

    def kernel_only(kv, idx, pos, tables):
        first_row = units_only(kv, idx, pos, tables).first_row
        return row_sort.distinct_sorted_rows(jnp.where(first_row >= 0, first_row, ABSENT))

    fns = {"op's row table": table, "units": units_only, "batched sort only": sort_only}
    if problem.read_block > 1:
        fns["scatter expansion"] = table_scatter  # traced with EXPAND_BY_MAX_COMPARES = 0
    if problem.read_block == 1:
        fns["packed sort (XLA)"] = functools.partial(table, token_table=None)
        fns["batched sort"] = functools.partial(table, num_rows=None, token_table=None)
        fns["packed sort only"] = functools.partial(sort_only, num_rows=num_rows)
        fns["table kernel alone"] = kernel_only
        fns["two sorts"] = lambda *a: two_sort_rows(units_only(*a))
        fns["two packed sorts"] = lambda *a: two_sort_rows(units_only(*a), num_rows=num_rows)

        def with_a_repeat(kv, idx, pos, tables):
            first = (0,) * (idx.ndim - 1)  # the first query's second id made its first
            return table(kv, idx.at[(*first, 1)].set(idx[(*first, 0)]), pos, tables)

        fns["op's table, a repeat"] = with_a_repeat  # the compaction the op skips without
    results, reference = [], None
    for label, fn in fns.items():
        limit = 0 if label == "scatter expansion" else rows_module.EXPAND_BY_MAX_COMPARES
        with mock.patch.object(rows_module, "EXPAND_BY_MAX_COMPARES", limit):
            fn = jax.jit(fn).lower(kv, idx, pos, tables).compile()  # traced here
        ms, _ = device_ms(fn, kv, idx, pos, tables, iterations=iterations)
        # How XLA sorts (its own sort op, or a custom call: a library sort) and scatters.
        sorts = [
            line.split("=", 1)[1].strip()[:120]
            for line in fn.as_text().splitlines()
            if any(op in line for op in (" sort(", "custom-call(", " scatter("))
        ]
        row = {"case": case.name, "variant": label, "ms": ms, "sort_ops": sorts}
        if label == "op's row table":
            reference = [np.asarray(x) for x in fn(kv, idx, pos, tables)]
        checked = "only" not in label and "repeat" not in label and label != "units"
        if label != "op's row table" and checked:
            got = [np.asarray(x) for x in fn(kv, idx, pos, tables)]
            row["equal"] = all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))
        results.append(row)
        print(f"{case.name:18s} {label:18s} {ms:8.3f} ms {row.get('equal', '')}", flush=True)
        for op in sorts:
            print(f"    {op}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", nargs="*", default=["flat-h128-t8k", "paged-h128-t32k"])
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    results = []
    for case in [c for c in CASES if any(fnmatch(c.name, p) for p in args.cases)]:
        results += time_case(case, args.iterations)
    data = {
        **provenance(),
        "device": jax.devices()[0].device_kind,
        "command": "sparse_mla_row_table.py " + " ".join(sys.argv[1:]),
        "rows": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sparse_mla_row_table.json").write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
