"""Grid and warpgroup axis names shared by every kernel of this package.

``lax.axis_index(name)`` inside a kernel is lowered against the mesh axes of an enclosing
``jax.shard_map`` before the kernel's own grid and warpgroup axes. With plain names such
as ``"batch"`` a kernel called under ``shard_map`` over a mesh axis named ``"batch"``
reads the device's shard index instead of its program id and computes the wrong rows
(seen on two H200s). The package prefix keeps kernel axes apart from user mesh axes, so
every axis a kernel names (grid, warpgroups, ``axis_index``, ``collective_axes``) is one
of ``KERNEL_AXES`` (the package's ``tests/test_kernel_axes_cpu.py`` checks the source and the traced
kernels, and lowers them under such meshes). Mosaic GPU's interpreter resolves the
kernel's axes first, so interpret mode does not show a clash.
"""

BATCH = "attn_mgpu_batch"
HEADS = "attn_mgpu_heads"
Q_TILES = "attn_mgpu_q_tiles"
KV_TILES = "attn_mgpu_kv_tiles"
WARPGROUP = "attn_mgpu_warpgroup"
PROGRAMS = "attn_mgpu_programs"  # one axis of programs (persistent kernels, sparse MLA)
QUERIES = "attn_mgpu_queries"  # the row-sort kernel: one program per query

KERNEL_AXES = (BATCH, HEADS, Q_TILES, KV_TILES, WARPGROUP, PROGRAMS, QUERIES)
