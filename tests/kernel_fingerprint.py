"""Fingerprints of the Hopper kernels' jaxprs, to show a refactor changed nothing.

For a set of shapes, bounds layouts and configs, traces ``jax.grad`` of
``attn_mosaic_gpu.ranker_attention`` (forward, dq and dk/dv kernels; and two forward-only
configs) and the sparse-MLA row-table kernel (``sparse-mla``: its schedules, H=128)
and prints a hash of a canonical text of the jaxpr: sub-jaxprs inlined (the
printer's sharing of equal sub-jaxprs depends on how the code is factored), variables
renamed in order of definition, source locations and object addresses dropped. Equal
hashes mean the kernels trace to the same operations, so the lowered kernels are the
same. Runs on a CPU (tracing only). Compare two checkouts:

    PYTHONPATH=<old>/common/src:<old>/packages/attn-reference/src:<old>/packages/attn-mosaic-gpu/src \\
        python tests/kernel_fingerprint.py > old.txt
    python tests/kernel_fingerprint.py > new.txt && diff old.txt new.txt

``--only NAME`` traces one shape; ``--dump DIR`` writes each canonical text.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.extend import core

from attn_common import CapMethod, CapParams, KernelConfig
from attn_mosaic_gpu import ranker_attention

SOFT_SIGN = CapParams(CapMethod.SOFT_SIGN, 80.0)
TANH = CapParams(CapMethod.TANH, 30.0)
# name, B, S, Hq, Hkv, D, cap, dtype
SHAPES = [
    ("phoenix", 64, 1152, 20, 4, 128, SOFT_SIGN, jnp.bfloat16),
    ("long", 8, 5120, 16, 16, 128, TANH, jnp.bfloat16),
    ("small-d64", 128, 640, 8, 8, 64, None, jnp.bfloat16),
    ("d256", 8, 1000, 16, 4, 256, TANH, jnp.bfloat16),
    ("d256-fp16", 4, 777, 8, 8, 256, None, jnp.float16),
    ("odd-d64-ss", 3, 333, 6, 2, 64, CapParams(CapMethod.SOFT_SIGN, 8.0), jnp.float16),
]
FORWARD_CONFIGS = (
    KernelConfig(block_q=64, block_kv=128, num_stages=2, exp2_fma_cols=32, rcp_fma_cols=32),
    KernelConfig(block_q=64, block_kv=64, num_stages=3),
)


def canonical(closed: core.ClosedJaxpr) -> str:
    """The jaxpr as text with sub-jaxprs inlined and names, locations, addresses dropped."""
    names: dict = {}
    counter = iter(range(1 << 62))

    def bind(v) -> str:
        """A fresh name for a binder: a sub-jaxpr shared by two equations (the same
        object) is named afresh on each visit, as if it were two copies."""
        if isinstance(v, core.DropVar):
            return "_"
        names[v] = f"v{next(counter)}:{v.aval.str_short()}"
        return names[v]

    def name(v) -> str:
        if isinstance(v, core.Literal):
            return f"lit({v.val!r}:{v.aval.str_short()})"
        return names[v]

    def param(v, depth: int) -> str:
        if isinstance(v, core.ClosedJaxpr):
            return walk(v.jaxpr, depth + 1)
        if isinstance(v, core.Jaxpr):
            return walk(v, depth + 1)
        if isinstance(v, tuple | list):
            return "(" + ", ".join(param(x, depth) for x in v) + ")"
        text = re.sub(r"[\w/.\-]+\.py:\d+(:\d+)?", "SRC", str(v))
        text = re.sub(r" at 0x[0-9a-f]+", "", text)
        return re.sub(r"line \d+", "line N", text)

    def walk(jaxpr: core.Jaxpr, depth: int) -> str:
        pad = "  " * depth
        head = " ".join(map(bind, jaxpr.constvars)) + " ; " + " ".join(map(bind, jaxpr.invars))
        lines = [pad + "{ " + head]
        for eqn in jaxpr.eqns:
            ins = " ".join(map(name, eqn.invars))
            params = ", ".join(
                f"{k}={param(eqn.params[k], depth)}"
                for k in sorted(eqn.params)
                if k not in ("name", "source_info")
            )
            outs = " ".join(map(bind, eqn.outvars))
            lines.append(f"{pad}{outs} = {eqn.primitive.name}[{params}] {ins}")
        lines.append(pad + "} -> " + " ".join(map(name, jaxpr.outvars)))
        return "\n".join(lines)

    return walk(closed.jaxpr, 0)


def cases(only: str | None):
    """(label, function, argument shapes) for every traced case."""
    sds = jax.ShapeDtypeStruct
    for name, b, s, hq, hkv, d, cap, dtype in SHAPES:
        if only and name != only:
            continue
        for packed in (False,) if d == 256 else (False, True):  # packed rows: D 64/128
            qkv = (
                sds((b, s, hq, d), dtype),
                sds((b, s, hkv, d), dtype),
                sds((b, s, hkv, d), dtype),
            )
            args = (*qkv, sds((b, 8, 4) if packed else (b, 4), jnp.int32))

            def loss(q, k, v, bounds, cap=cap):
                out, lse = ranker_attention(q, k, v, bounds, cap=cap, return_lse=True)
                return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

            yield f"{name}-packed{packed}-grad", jax.grad(loss, argnums=(0, 1, 2)), args
            if name == "phoenix" and not packed:
                for config in FORWARD_CONFIGS:

                    def forward(q, k, v, bounds, cap=cap, config=config):
                        return ranker_attention(q, k, v, bounds, cap=cap, config=config)

                    yield f"{name}-fwd-{config}", forward, args


def sparse_mla_cases():
    """The sparse-MLA kernel at the benchmark's H=128 shape, each schedule (configs built
    positionally, so older revisions trace too; one a revision refuses is left out)."""
    from attn_mosaic_gpu.sparse_mla_kernel import SparseMlaKernelConfig, sparse_mla_rows_attention

    sds = jax.ShapeDtypeStruct
    args = (
        sds((256, 128, 576), jnp.bfloat16),
        sds((8192, 576), jnp.bfloat16),
        sds((256, 2048), jnp.int32),
        sds((256,), jnp.int32),
    )
    for block_k, stages, exchange in ((32, 2, "one_way"), (64, 1, "lockstep"), (64, 1, "one_way")):
        try:
            config = SparseMlaKernelConfig(block_k, stages, exchange)
        except ValueError:  # a revision without this schedule
            continue

        def attend(q, store, rows, counts, config=config):
            return sparse_mla_rows_attention(q, store, rows, counts, sm_scale=0.07, config=config)

        yield f"sparse-mla-{block_k}x{stages}-{exchange}", attend, args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one shape name of SHAPES, or sparse-mla")
    parser.add_argument("--dump", type=Path, help="write each canonical text into DIR")
    args = parser.parse_args()
    ranker = [] if args.only == "sparse-mla" else cases(args.only)
    sparse = sparse_mla_cases() if args.only in (None, "sparse-mla") else []
    for label, fn, shapes in (*ranker, *sparse):
        text = canonical(jax.make_jaxpr(fn)(*shapes))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{label}.txt").write_text(text)
        print(label, hashlib.sha256(text.encode()).hexdigest()[:16], flush=True)


if __name__ == "__main__":
    main()
