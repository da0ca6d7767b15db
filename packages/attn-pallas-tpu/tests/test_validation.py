"""Input validation of the TPU sparse-MLA kernels: errors name the argument and the rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn_pallas_tpu import sparse_mla_attention, sparse_mla_attention_qblock

SD = jax.ShapeDtypeStruct
F32, I32 = jnp.float32, jnp.int32
FNS = [sparse_mla_attention, sparse_mla_attention_qblock]


def _flat(**over):
    args = dict(
        q=SD((1, 4, 2, 192), F32),
        kv=SD((1, 64, 192), F32),
        indices=SD((1, 4, 3), I32),
        positions=SD((1, 4), I32),
    )
    args.update(over)
    return args


def _call(fn, args, **kw):
    kw = {"sm_scale": 0.1, "kv_lora_rank": 128, "read_block": 16, **kw}
    return jax.eval_shape(lambda a: fn(**a, **kw), args)


@pytest.mark.parametrize("fn", FNS)
def test_flat_shapes_ok(fn):
    out = _call(fn, _flat())
    assert out.shape == (1, 4, 2, 128) and out.dtype == F32


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize(
    ("over", "kw", "err", "match"),
    [
        ({"q": SD((1, 4, 2, 192), jnp.int32)}, {}, TypeError, "q: got dtype int32"),
        ({"kv": SD((1, 64, 192), jnp.float16)}, {}, TypeError, "kv: got dtype float16"),
        ({}, {"read_block": 24}, NotImplementedError, "read_block: got 24"),
        ({}, {"sm_scale": None}, ValueError, "sm_scale"),
        ({"indices": SD((1, 4, 3), F32)}, {}, TypeError, "indices"),
        ({"positions": SD((1, 5), I32)}, {}, ValueError, "positions"),
        ({"kv": SD((1, 64, 128), F32)}, {}, ValueError, "kv: got shape"),
        ({}, {"page_size": 16}, ValueError, "page_size"),
        ({}, {"interpret": "yes"}, TypeError, "interpret"),
    ],
)
def test_flat_errors(fn, over, kw, err, match):
    with pytest.raises(err, match=match):
        _call(fn, _flat(**over), **kw)


def test_qblock_specific_errors():
    with pytest.raises(ValueError, match="query_block"):
        _call(sparse_mla_attention_qblock, _flat(), query_block=12)
    with pytest.raises(ValueError, match="u_max"):
        _call(sparse_mla_attention_qblock, _flat(), query_block=8, u_max=0)
    with pytest.raises(ValueError, match="head_block"):
        _call(sparse_mla_attention_qblock, _flat(), query_block=8, head_block=3)


def _ragged(page_size=16, dtype=jnp.bfloat16, feat=256):
    pk = 2 if dtype == jnp.bfloat16 else 1
    return dict(
        q=SD((1, 6, 2, 192), dtype),
        kv=SD((10, page_size // pk, pk, feat), dtype),
        indices=SD((1, 6, 3), I32),
        positions=SD((1, 6), I32),
        q_seq_id=SD((6,), I32),
        seq_lens=SD((2,), I32),
        cu_kv_lens=SD((3,), I32),
        page_indices=SD((8,), I32),
    )


@pytest.mark.parametrize("fn", FNS)
def test_ragged_rules(fn):
    out = _call(fn, _ragged(), page_size=16)
    assert out.shape == (1, 6, 2, 128)
    with pytest.raises(ValueError, match="read_block"):
        _call(fn, _ragged(), page_size=16, read_block=32)
    with pytest.raises(ValueError, match="page_size: got 24"):
        _call(fn, _ragged(page_size=24), page_size=24, read_block=24)
    with pytest.raises(ValueError, match="Dk_pad"):
        _call(fn, _ragged(feat=192), page_size=16)
    with pytest.raises(ValueError, match="page_size: missing"):
        _call(fn, _ragged())
    args = _ragged()
    args["q"] = SD((2, 6, 2, 192), jnp.bfloat16)
    args["indices"] = SD((2, 6, 3), I32)
    args["positions"] = SD((2, 6), I32)
    with pytest.raises(ValueError, match="B = 2"):
        _call(fn, args, page_size=16)
    args = _ragged()
    del args["seq_lens"]
    with pytest.raises(ValueError, match="seq_lens"):
        _call(fn, args, page_size=16)


def test_non_array_input():
    with pytest.raises(TypeError, match="q"):
        sparse_mla_attention(np.zeros(3).tolist(), None, None, None, sm_scale=0.1)


def test_supports_tells_dispatch_what_falls_back():
    """fp16 / read_block % 16 are not TPU-kernel inputs: a reason, so implementation=None
    falls back to the reference; supported inputs give None."""
    from attn_pallas_tpu import supports

    q, kv = SD((1, 4, 2, 192), jnp.bfloat16), SD((1, 64, 192), jnp.bfloat16)
    assert supports("sparse_mla_attention", q, kv, read_block=16) is None
    assert supports("sparse_mla_attention_qblock", q, kv) is None
    assert "float16" in supports("sparse_mla_attention", q, SD((1, 64, 192), jnp.float16))
    assert "read_block" in supports("sparse_mla_attention_qblock", q, kv, read_block=24)
    cache = SD((8, 8, 2, 256), jnp.bfloat16)
    args = (SD((4, 2, 128), jnp.float16), None, None, None, cache)
    assert "ql" in supports("prefill_write_and_attend_ragged", *args, page_size=16)
    assert "page_size" in supports(
        "prefill_write_and_attend_ragged_qblock", q, None, None, None, cache, page_size=24
    )
    assert supports("paged_write_back", cache) is None


def _fp8_flat(tokens: int = 64):
    from attn_common import Fp8LatentCache

    cache = Fp8LatentCache(
        SD((1, tokens, 512), jnp.float8_e4m3fn),
        SD((1, tokens, 4), F32),
        SD((1, tokens, 64), jnp.bfloat16),
    )
    return _flat(q=SD((1, 4, 2, 576), jnp.bfloat16), kv=cache)


@pytest.mark.parametrize("fn", FNS)
def test_compiled_fp8_needs_whole_8bit_tiles(fn):
    """Compiled (not interpreted), an FP8 cache needs read_block % 32 == 0: units of 16
    FP8 rows (half an 8-bit tile) gave wrong results on a TPU v5e. Interpret mode, which
    has no tiles, takes 16; 32 and 64 pass the check."""
    args = _fp8_flat()
    with pytest.raises(NotImplementedError, match=r"read_block: got 16 .*multiple of 32"):
        _call(fn, args, kv_lora_rank=512)
    out = _call(fn, args, kv_lora_rank=512, interpret=True)
    assert out.shape == (1, 4, 2, 512)
    for read_block in (32, 64):
        _call(fn, args, kv_lora_rank=512, read_block=read_block)


def test_supports_sends_compiled_fp8_half_tiles_to_the_reference():
    from attn_pallas_tpu import supports

    args = _fp8_flat()
    q, kv = args["q"], args["kv"]
    for op in ("sparse_mla_attention", "sparse_mla_attention_qblock"):
        assert "multiple of 32" in supports(op, q, kv, read_block=16)
        assert supports(op, q, kv, read_block=16, interpret=True) is None
        assert supports(op, q, kv, read_block=32) is None
    assert "multiple of 32" in supports(
        "prefill_write_and_attend_ragged", q, None, None, None, kv, page_size=16
    )
