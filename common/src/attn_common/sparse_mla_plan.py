"""Moved to ``attn_pallas_tpu.plan``, in the pallas-tpu backend (deprecated here; removed in 0.3.0).

Every name is looked up there through the backend's entry point, with a
DeprecationWarning (``attn_common._moved``).
"""


def __getattr__(name: str):
    from attn_common import _moved

    return _moved.resolve_module("sparse_mla_plan", name)
