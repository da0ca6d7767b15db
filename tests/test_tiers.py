"""The test session's setup by the root conftest: the two tiers (the quick one, ``-m "not
slow"``, runs each property test with a quarter of its hypothesis examples, at least 10;
the full one runs them all), and the Pallas interpreters' host callbacks boxed cheaply."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import box_interpret_callbacks_cheaply, tier_examples
from jax.experimental import io_callback


def test_tier_is_set_by_the_root_conftest():
    import os

    assert os.environ["ATTN_TEST_TIER"] in ("quick", "full")


def test_examples_per_tier(monkeypatch):
    monkeypatch.setenv("ATTN_TEST_TIER", "quick")
    assert [tier_examples(n) for n in (6, 25, 60, 150, 400)] == [6, 10, 15, 37, 100]
    monkeypatch.setenv("ATTN_TEST_TIER", "full")
    assert [tier_examples(n) for n in (6, 25, 60, 150, 400)] == [6, 25, 60, 150, 400]


def test_interpreter_callbacks_are_boxed_cheaply():
    """Active under this jax (a failure here means interpret-mode tests run 10-12 %
    slower: update ``helpers.box_interpret_callbacks_cheaply``). A callback of the Mosaic
    TPU interpreter's module gets its arguments exactly, as numpy arrays of its own that
    stay valid after the call; one of the Mosaic GPU interpreter's gets JAX arrays, an
    integer scalar's value boxed once; any other callback gets JAX's own boxing."""
    assert box_interpret_callbacks_cheaply()
    seen = []

    def host(x, n):
        seen.append((x, n))
        return x * int(n)

    def call(x, n):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.jit(lambda x, n: io_callback(host, out, x, n, ordered=True))(x, n)

    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    want = np.asarray(x) * 3
    np.testing.assert_array_equal(call(x, 3), want)
    assert all(isinstance(a, jax.Array) for a in seen.pop())

    host.__module__ = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"
    np.testing.assert_array_equal(call(x, 3), want)
    np.testing.assert_array_equal(call(x + 1, 2), (np.asarray(x) + 1) * 2)
    assert all(type(a) is np.ndarray and a.flags.owndata for a, _ in seen)
    np.testing.assert_array_equal(seen[0][0], np.asarray(x))  # not overwritten by call 2
    assert seen[0][0].dtype == jnp.bfloat16 and int(seen[1][1]) == 2
    seen.clear()

    host.__module__ = "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks"
    np.testing.assert_array_equal(call(x, 3), want)
    np.testing.assert_array_equal(call(x + 1, 3), (np.asarray(x) + 1) * 3)
    assert all(isinstance(a, jax.Array) for pair in seen for a in pair)
    assert seen[0][1] is seen[1][1] and int(seen[0][1]) == 3  # the scalar boxed once
    np.testing.assert_array_equal(seen[0][0], np.asarray(x))
