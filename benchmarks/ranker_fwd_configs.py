"""Time explicit ``KernelConfig``s of the Hopper ranker forward against the tuned one (H200).

``ranker_fwd_knob.py`` changes one field of the tuned config; some tilings need several
at once (192-key blocks fit the shared memory only without persistent programs, for
example). Each ``--config`` is ``field=value,field=value`` applied to the tuned config;
all are compiled first, each output's largest absolute difference from the tuned
config's is printed (other tilings add in another order, so they may differ in the last
bits; a config the kernel refuses is reported and skipped), then they are timed round
after round in the same order (CUPTI device time, median)::

    python benchmarks/ranker_fwd_configs.py --cases phoenix --no-lse \\
        --config programs=0 --config programs=0,block_kv=192
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attn_common import ranker_case, ranker_flops
from attn_common.bench import device_ms
from attn_mosaic_gpu.ranker import resolve_tuning
from attn_mosaic_gpu.ranker_fwd import ranker_attention_fwd


def parse(text: str) -> dict[str, int]:
    fields = {}
    for item in text.split(","):
        name, value = item.split("=")
        fields[name.strip()] = int(value)
    return fields


def run_case(name: str, changes: list[str], rounds: int, iterations: int, lse: bool) -> None:
    case = ranker_case(name)
    q, k, v, _ = case.inputs()
    bounds = jnp.asarray(case.bounds())
    flops = ranker_flops(np.asarray(bounds), case.q_heads, case.head_dim)
    tuned = resolve_tuning(q, case.cap, None, None, bounds=bounds)[0]
    configs = {"tuned": tuned} | {c: tuned.replace(**parse(c)) for c in changes}
    fns, first = {}, None
    for label, config in configs.items():
        fn = jax.jit(
            lambda q, k, v, c=config: ranker_attention_fwd(
                q, k, v, bounds, cap=case.cap, config=c, return_lse=lse
            )
        )
        try:
            result = fn(q, k, v)
            outs = [np.asarray(x, np.float32) for x in (result if lse else (result,))]
        except Exception as err:  # a config the kernel refuses: say so, time the rest
            print(f"{name:9s} {label}: {config}: {type(err).__name__}: {err}", flush=True)
            continue
        first = outs if first is None else first
        diff = max(float(np.nanmax(np.abs(a - b))) for a, b in zip(outs, first, strict=True))
        print(f"{name:9s} {label}: {config}, max |diff| vs tuned {diff:.3g}", flush=True)
        fns[label] = fn
    for r in range(rounds):
        for label, fn in fns.items():
            ms, _ = device_ms(fn, q, k, v, iterations=iterations)
            print(f"{name:9s} round {r} {label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["phoenix"])
    parser.add_argument("--config", action="append", default=[], help="field=value,...")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--no-lse", action="store_true", help="forward only, no LSE output")
    args = parser.parse_args()
    for name in args.cases:
        run_case(name, args.config, args.rounds, args.iterations, not args.no_lse)


if __name__ == "__main__":
    main()
