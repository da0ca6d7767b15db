"""What the Hopper sparse-MLA op spends on its row table, and cheaper ways to build it.

Times, per benchmark case (CUPTI median), ``sparse_mla_units`` + ``selected_rows`` as
the op runs them, the ``[N, K]`` sort alone, and, for token-level selections
(``read_block == 1``), a two-sort build (sort; mark repeats absent; sort again) that
needs no prefix sum and no scatter; its table is checked equal to ``selected_rows``'s::

    python benchmarks/sparse_mla_row_table.py --out /tmp/r --cases 'flat-h128-*'

Writes ``sparse_mla_row_table.json`` into ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from fnmatch import fnmatch
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import selected_rows, sparse_mla_units
from attn_common.bench import device_ms, provenance
from attn_common.bench_sparse_mla import CASES
from attn_common.sparse_mla_rows import row_table_width

sys.path.insert(0, str(Path(__file__).parent))
from sparse_mla_variants import case_problem  # a sibling script

BLOCK = 64  # the kernel's row-table multiple (2 * block_k)
_ABSENT = 2**31 - 1


def two_sort_rows(units, *, block: int = BLOCK):
    """``selected_rows`` for ``read_block == 1`` by two sorts (no cumsum, no scatter)."""
    n, top_k = units.first_row.shape
    width = row_table_width(top_k, 1, block)
    valid = (units.first_row >= 0) & (units.first_pos <= units.position[:, None])
    valid &= units.first_pos < units.kv_len[:, None]
    key = jnp.sort(jnp.where(valid, units.first_row, _ABSENT), axis=1)
    repeat = jnp.concatenate([jnp.zeros((n, 1), bool), key[:, 1:] == key[:, :-1]], axis=1)
    key = jnp.sort(jnp.where(repeat, _ABSENT, key), axis=1)
    counts = (key != _ABSENT).sum(axis=1, dtype=jnp.int32)
    rows = jnp.where(key == _ABSENT, -1, key)
    return jnp.pad(rows, ((0, 0), (0, width - top_k)), constant_values=-1), counts


def time_case(case, iterations: int) -> list[dict]:
    """The row-table variants of one benchmark case (see the module docstring)."""
    inputs, problem, tables = case_problem(case)
    _, kv, idx, pos = inputs["args"]

    def units_only(kv, idx, pos, tables):
        return sparse_mla_units(problem, kv, idx, pos, **tables)[0]

    def table(kv, idx, pos, tables):
        units = units_only(kv, idx, pos, tables)
        return selected_rows(units, read_block=problem.read_block, block=BLOCK)

    def sort_only(kv, idx, pos, tables):
        return jnp.sort(units_only(kv, idx, pos, tables).first_row, axis=1)

    fns = {"op's row table": table, "units": units_only, "sort only": sort_only}
    if problem.read_block == 1:
        fns["two sorts"] = lambda *a: two_sort_rows(units_only(*a))
    results, reference = [], None
    for label, fn in fns.items():
        fn = jax.jit(fn)
        ms, _ = device_ms(fn, kv, idx, pos, tables, iterations=iterations)
        row = {"case": case.name, "variant": label, "ms": ms}
        if label == "op's row table":
            reference = [np.asarray(x) for x in fn(kv, idx, pos, tables)]
        if label == "two sorts":
            got = [np.asarray(x) for x in fn(kv, idx, pos, tables)]
            row["equal"] = all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))
        results.append(row)
        print(f"{case.name:18s} {label:16s} {ms:8.3f} ms {row.get('equal', '')}", flush=True)
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
