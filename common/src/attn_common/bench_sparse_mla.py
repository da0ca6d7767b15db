"""Moved to ``attn_mosaic_gpu.bench_sparse_mla``, in the mosaic-gpu backend (deprecated here; removed in 0.3.0).

Every name is looked up there through the backend's entry point, with a
DeprecationWarning (``attn_common._moved``).
"""


def __getattr__(name: str):
    from attn_common import _moved

    return _moved.resolve_module("bench_sparse_mla", name)
