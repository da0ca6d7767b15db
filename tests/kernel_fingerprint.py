"""Fingerprints of the Hopper kernels' jaxprs, to show a refactor changed nothing.

For a set of shapes, bounds layouts and configs, traces ``jax.grad`` of
``attn_mosaic_gpu.ranker_attention`` (forward, dq and dk/dv kernels; and two forward-only
configs) and the Hopper sparse-MLA op (``sparse-mla``: flat and ragged paged, unit- and
token-level selections, H 16/64/128, the prefill wrapper, the row-table kernel alone over
a bf16 and an FP8 store, the backward kernel alone, and the row-sort kernel alone, each at the default config) and prints a hash of a canonical text of the jaxpr: sub-jaxprs inlined (the
printer's sharing of equal sub-jaxprs depends on how the code is factored), variables
renamed in order of definition, source locations and object addresses dropped. Equal
hashes mean the kernels trace to the same operations, so the lowered kernels are the
same. Inline Mosaic GPU code (the sparse-MLA gather, the row-sort kernel) is in the jaxpr
only by name, so the sparse-MLA and row-sort cases print a second hash: of their Mosaic
GPU modules lowered for CUDA, as text without locations. Runs on a CPU (tracing only). Compare two checkouts:

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
import numpy as np
from jax.extend import core

from attn_common import CapMethod, CapParams, Fp8LatentCache, KernelConfig
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


# An inline Mosaic GPU function, named in place of its Python name: its code is compared
# through the lowered module (``lowered_kernels``), not by what it is called.
INLINE = "<inline Mosaic GPU function>"


def canonical(closed: core.ClosedJaxpr) -> str:
    """The jaxpr as text with sub-jaxprs inlined and names, locations, addresses dropped
    (inline Mosaic GPU functions too: see ``INLINE``)."""
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
            # The value and its type: a Python int and a NumPy scalar of the same dtype
            # (``x & 1``, ``x & jnp.int32(1)``) print differently and lower the same.
            value = np.asarray(v.val)
            return f"lit({value.item() if value.ndim == 0 else v.val!r}:{v.aval.str_short()})"
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
                f"{k}={INLINE if k == 'mgpu_fn' else param(eqn.params[k], depth)}"
                for k in sorted(eqn.params)
                if k not in ("name", "source_info")
            )
            outs = " ".join(map(bind, eqn.outvars))
            lines.append(f"{pad}{outs} = {eqn.primitive.name}[{params}] {ins}")
        lines.append(pad + "} -> " + " ".join(map(name, jaxpr.outvars)))
        return "\n".join(lines)

    return walk(closed.jaxpr, 0)


def lowered_kernels(fn, shapes) -> str:
    """The Mosaic GPU modules of ``fn`` lowered for CUDA (on any host), as text without
    locations. The jaxpr holds an inline Mosaic GPU body (the sparse-MLA gather, the
    row-sort kernel) only as a function name; its lowered module holds its code."""
    from jaxlib.mlir import ir

    lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    modules = []

    def visit(op) -> None:
        op = op.operation
        if op.name == "stablehlo.custom_call" and "mhlo.backend_config" in op.attributes:
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            if "module" in config:
                modules.append(ir.StringAttr(config["module"]).value_bytes)
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner)

    stablehlo = lowered.compiler_ir("stablehlo")
    visit(stablehlo.operation)
    texts = []
    with stablehlo.context as context:  # JAX's context: the upstream dialects registered
        context.allow_unregistered_dialects = True  # Mosaic GPU's serialized dialects
        for raw in modules:
            module = ir.Module.parse(raw)
            texts.append(module.operation.get_asm(enable_debug_info=False))
    return "\n".join(texts)


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


# name, heads, read_block, top_k: flat sparse-MLA cases (B=2, S=128, T=4096 tokens).
# read_block 1 with K = 2048 builds its row table with the row-sort kernel; K = 96, with
# XLA's sort (the kernel takes powers of two in [512, 4096]).
SPARSE_FLAT = [
    ("flat-unit", 128, 64, 32),
    ("flat-token", 128, 1, 2048),
    ("flat-token", 64, 1, 2048),
    ("flat-token", 16, 1, 2048),
    ("flat-token-xla-sort", 64, 1, 96),
]
# name, heads: ragged paged cases (4 requests, 256 tokens, 64-token pages, 32 pages each).
SPARSE_PAGED = [("paged", 128), ("paged", 64), ("paged", 16)]
ROW_SORT_KEYS = (512, 2048, 4096)
# Cases whose lowered Mosaic GPU modules are hashed too (a second hash): the kernels with
# inline Mosaic GPU code, which the jaxpr names but does not hold.
LOWERED_PREFIXES = ("sparse-mla-", "row-sort-")


def sparse_mla_cases():
    """The Hopper sparse-MLA op as users call it (its row table, the row-sort kernel and
    the kernel's shipped schedule, at the default config): flat unit- and token-level,
    ragged paged, the prefill wrapper (Q's latent and rope features apart), the kernel
    alone at 128 heads, and the row-sort kernel alone."""
    from attn_mosaic_gpu import prefill_write_and_attend_ragged, sparse_mla_attention
    from attn_mosaic_gpu.row_sort import distinct_sorted_rows
    from attn_mosaic_gpu.sparse_mla_kernel import sparse_mla_rows_attention

    sds = jax.ShapeDtypeStruct
    bf16, i32 = jnp.bfloat16, jnp.int32
    for name, heads, read_block, top_k in SPARSE_FLAT:
        args = (
            sds((2, 128, heads, 576), bf16),
            sds((2, 4096, 576), bf16),
            sds((2, 128, top_k), i32),
            sds((2, 128), i32),
        )

        def flat(q, kv, idx, pos, read_block=read_block):
            return sparse_mla_attention(
                q, kv, idx, pos, sm_scale=0.07, read_block=read_block, return_lse=True
            )

        yield f"sparse-mla-{name}-h{heads}", flat, args
    tokens, requests, page_size, pages = 256, 4, 64, 128
    tables = (sds((requests,), i32), sds((requests + 1,), i32), sds((pages,), i32))
    cache = sds((pages, page_size // 2, 2, 640), bf16)
    for name, heads in SPARSE_PAGED:
        args = (
            sds((1, tokens, heads, 576), bf16),
            cache,
            sds((1, tokens, 32), i32),
            sds((1, tokens), i32),
            sds((tokens,), i32),
            *tables,
        )

        def paged(q, kv, idx, pos, q_seq_id, seq_lens, cu_kv_lens, page_indices):
            return sparse_mla_attention(
                q, kv, idx, pos, sm_scale=0.07, read_block=page_size, return_lse=True,
                page_size=page_size, q_seq_id=q_seq_id, seq_lens=seq_lens,
                cu_kv_lens=cu_kv_lens, page_indices=page_indices,
            )  # fmt: skip

        yield f"sparse-mla-{name}-h{heads}", paged, args
    wrapper_args = (
        sds((tokens, 128, 512), bf16),
        sds((tokens, 128, 64), bf16),
        sds((tokens, 512), bf16),
        sds((tokens, 64), bf16),
        cache,
        sds((tokens, 32), i32),
        sds((tokens,), i32),
        sds((tokens,), i32),
        tables[0],
        tables[1],
        *tables[1:],
    )

    def wrapper(*args):
        return prefill_write_and_attend_ragged(
            *args, kv_lora_rank=512, page_size=page_size, sm_scale=0.07
        )

    yield "sparse-mla-prefill-wrapper-h128", wrapper, wrapper_args
    kernel_args = (
        sds((256, 128, 576), bf16),
        sds((8192, 576), bf16),
        sds((256, 2048), i32),
        sds((256,), i32),
    )

    def attend(q, store, rows, counts):
        return sparse_mla_rows_attention(q, store, rows, counts, sm_scale=0.07)

    yield "sparse-mla-kernel-h128", attend, kernel_args
    # The kernel over an FP8 latent cache (staged by cp.async, dequantized in place).
    fp8_store = Fp8LatentCache(
        sds((8192, 512), jnp.float8_e4m3fn), sds((8192, 4), jnp.float32), sds((8192, 64), bf16)
    )
    yield (
        "sparse-mla-fp8-kernel-h64",
        attend,
        (sds((256, 64, 576), bf16), fp8_store, *kernel_args[2:]),
    )
    # The backward kernel alone (dq and the cache gradient's atomic adds).
    from attn_mosaic_gpu.sparse_mla_bwd_kernel import sparse_mla_rows_backward

    f32 = jnp.float32

    def backward(q, store, rows, counts, lse, d_out, delta):
        return sparse_mla_rows_backward(q, store, rows, counts, lse, d_out, delta, sm_scale=0.07)

    grad_args = (sds((256, 128), f32), sds((256, 128, 512), f32), sds((256, 128), f32))
    yield "sparse-mla-backward-kernel-h128", backward, (*kernel_args, *grad_args)
    for keys in ROW_SORT_KEYS:
        yield f"row-sort-k{keys}", distinct_sorted_rows, (sds((256, keys), i32),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one shape name of SHAPES, or sparse-mla")
    parser.add_argument("--dump", type=Path, help="write each canonical text into DIR")
    args = parser.parse_args()
    ranker = [] if args.only == "sparse-mla" else cases(args.only)
    sparse = sparse_mla_cases() if args.only in (None, "sparse-mla") else []
    for label, fn, shapes in (*ranker, *sparse):
        texts = {"": canonical(jax.make_jaxpr(fn)(*shapes))}
        if label.startswith(LOWERED_PREFIXES):
            texts[".mosaic"] = lowered_kernels(fn, shapes)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            for suffix, text in texts.items():
                (args.dump / f"{label}{suffix}.txt").write_text(text)
        hashes = (hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts.values())
        print(label, *hashes, flush=True)


if __name__ == "__main__":
    main()
