"""Ranker attention benchmark on a Hopper GPU (docs/design.md#benchmarks): a thin wrapper.

The suite lives in ``attn_mosaic_gpu.bench`` (also ``attn bench``). Usage:
``python benchmarks/ranker_gpu.py --out DIR`` writes ``ranker_gpu.json``,
``ranker_gpu.md`` and ``ranker_gpu.png`` into DIR.
"""

from attn_mosaic_gpu.bench import device_ms, main

__all__ = ["device_ms", "main"]

if __name__ == "__main__":
    main()
