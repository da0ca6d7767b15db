"""A/B of one field of the Hopper ranker forward's ``KernelConfig`` at the suite shapes (H200).

For each case: the tuned config (what ``config=None`` runs) with ``--knob`` set to each
of ``--values`` in turn, all compiled first, then timed round after round in the same
order (``--rounds``, so a drift of the device shows as a drift, not as a difference),
CUPTI device time, median of ``--iterations`` per round. Out and LSE are compared
bitwise with the first value's::

    python benchmarks/ranker_fwd_knob.py --knob compute_registers --values 0 240 \\
        --cases phoenix ragged long small-d64

Some tilings need several fields at once (192-key blocks fit the shared memory only
without persistent programs, for example): ``--config field=value,field=value``
(repeatable) times those against the tuned config instead; configs the kernel refuses
are reported and skipped. ``--no-lse`` times the forward without its LSE output::

    python benchmarks/ranker_fwd_knob.py --cases phoenix --no-lse \\
        --config programs=0 --config programs=0,block_kv=192
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import KernelConfig, ranker_case, ranker_flops
from attn_mosaic_gpu.bench import device_ms
from attn_mosaic_gpu.ranker import resolve_tuning
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd

KNOBS = [f.name for f in dataclasses.fields(KernelConfig)]


def parse(text: str) -> dict[str, int]:
    """``field=value,field=value`` -> ``{field: value}``."""
    return {name.strip(): int(value) for name, value in (i.split("=") for i in text.split(","))}


def run_case(name, variants, rounds, iterations, lse=True):
    """``variants``: label -> the fields to change in the tuned config (the first label is
    the one the others are compared with)."""
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    tuned = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0]
    fns, first, first_label = {}, None, None
    for label, changes in variants.items():
        config = tuned.replace(**changes)
        fn = jax.jit(
            lambda q, k, v, c=config: ranker_attention_fwd(
                q, k, v, bounds, cap=case.cap, config=c, return_lse=lse
            )
        )
        try:
            result = fn(q, k, v)
        except ValueError as err:  # a config the kernel refuses: say so, time the rest
            print(f"{name:9s} {label}: {config}: refused: {err}", flush=True)
            continue
        outs = [np.asarray(x) for x in (result if lse else (result,))]
        first, first_label = (outs, label) if first is None else (first, first_label)
        same = all(np.array_equal(a, b) for a, b in zip(outs, first, strict=True))
        diff = max(
            float(np.max(np.abs(a.astype(np.float32) - b.astype(np.float32))))
            for a, b in zip(outs, first, strict=True)
        )
        print(f"{name:9s} {label}: {config}, outputs bitwise equal to {first_label}'s: "
              f"{same} (max |diff| {diff:.3g})", flush=True)  # fmt: skip
        fns[label] = fn
    for r in range(rounds):
        for label, fn in fns.items():
            ms, _ = device_ms(fn, q, k, v, iterations=iterations)
            print(f"{name:9s} round {r} {label}: {ms:.3f} ms "
                  f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--knob", choices=KNOBS)
    parser.add_argument("--values", nargs="+", type=int)
    parser.add_argument("--config", action="append", default=[], help="field=value,...")
    parser.add_argument("--no-lse", action="store_true", help="forward only, no LSE output")
    parser.add_argument("--cases", nargs="+", default=["phoenix", "ragged", "long", "small-d64"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    if (args.knob is None) == (not args.config) or (args.knob is None) != (args.values is None):
        parser.error("give --knob with --values, or --config (one or more)")
    if args.knob:
        variants = {f"{args.knob}={v}": {args.knob: v} for v in args.values}
    else:
        variants = {"tuned": {}} | {c: parse(c) for c in args.config}
    for name in args.cases:
        run_case(name, variants, args.rounds, args.iterations, lse=not args.no_lse)


if __name__ == "__main__":
    main()
