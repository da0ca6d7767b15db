"""Grid and warpgroup axis names shared by every kernel of this package.

``lax.axis_index(name)`` inside a kernel resolves ``name`` against all enclosing named
axes, including the mesh axes of a surrounding ``jax.shard_map``. With plain names such
as ``"batch"`` a kernel called under ``shard_map`` over a mesh axis named ``"batch"``
reads the device's shard index instead of its program id and computes the wrong rows
(seen on two H200s). The package prefix keeps kernel axes apart from user mesh axes.
"""

BATCH = "attn_mgpu_batch"
HEADS = "attn_mgpu_heads"
Q_TILES = "attn_mgpu_q_tiles"
KV_TILES = "attn_mgpu_kv_tiles"
WARPGROUP = "attn_mgpu_warpgroup"
PROGRAMS = "attn_mgpu_programs"  # persistent kernels: one axis of programs

KERNEL_AXES = (BATCH, HEADS, Q_TILES, KV_TILES, WARPGROUP, PROGRAMS)
