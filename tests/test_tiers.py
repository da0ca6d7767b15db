"""The test session's setup by the root conftest: the two tiers (the quick one, ``-m "not
slow"``, runs each property test with a quarter of its hypothesis examples, at least 10;
the full one runs them all), and interpret mode's host callbacks taking numpy arguments."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import interpret_callbacks_take_numpy, tier_examples
from jax.experimental import io_callback


def test_tier_is_set_by_the_root_conftest():
    import os

    assert os.environ["ATTN_TEST_TIER"] in ("quick", "full")


def test_examples_per_tier(monkeypatch):
    monkeypatch.setenv("ATTN_TEST_TIER", "quick")
    assert [tier_examples(n) for n in (6, 25, 60, 150, 400)] == [6, 10, 15, 37, 100]
    monkeypatch.setenv("ATTN_TEST_TIER", "full")
    assert [tier_examples(n) for n in (6, 25, 60, 150, 400)] == [6, 25, 60, 150, 400]


def test_tpu_interpreter_callbacks_take_numpy_copies():
    """Active under this jax (a failure here means TPU interpret-mode tests run about
    1.7x slower: update ``helpers.interpret_callbacks_take_numpy``). A callback of the
    Mosaic TPU interpreter's module gets its arguments exactly, as numpy arrays of its
    own that stay valid after the call; any other callback gets JAX arrays, as before."""
    assert interpret_callbacks_take_numpy()
    seen = []

    def host(x, n):
        seen.append((x, n))
        return x * int(n)

    def call(fn, x, n):
        out = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.jit(lambda x, n: io_callback(fn, out, x, n, ordered=True))(x, n)

    x = jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)
    np.testing.assert_array_equal(call(host, x, 3), np.asarray(x) * 3)
    assert all(isinstance(a, jax.Array) for a in seen.pop())
    host.__module__ = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"
    np.testing.assert_array_equal(call(host, x, 3), np.asarray(x) * 3)
    np.testing.assert_array_equal(call(host, x + 1, 2), (np.asarray(x) + 1) * 2)
    assert all(type(a) is np.ndarray and a.flags.owndata for a, _ in seen)
    np.testing.assert_array_equal(seen[0][0], np.asarray(x))  # not overwritten by call 2
    assert seen[0][0].dtype == jnp.bfloat16 and int(seen[1][1]) == 2
