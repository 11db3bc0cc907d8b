"""The demo's two programs agree, and only the library's is in place under `grad`."""

import jax
import numpy as np

import eqx_shiftbuf as esb
from eqx_shiftbuf import demo


def test_demo_versions_agree_and_library_is_in_place():
    args = demo.make_args(n_rows=64, n_cols=256, n_steps=20)
    plain, lib = demo.VERSIONS["plain lax"], demo.VERSIONS["eqx_shiftbuf"]
    np.testing.assert_allclose(jax.jit(lib)(*args), jax.jit(plain)(*args), rtol=1e-6)
    g_lib, g_plain = jax.jit(jax.grad(lib))(*args), jax.jit(jax.grad(plain))(*args)
    np.testing.assert_allclose(g_lib, g_plain, rtol=1e-5)
    min_bytes = 64 * 256 * 4
    assert esb.find_loop_copies(jax.grad(lib), *args, min_bytes=min_bytes) == []
    assert len(esb.find_loop_copies(jax.grad(plain), *args, min_bytes=min_bytes)) >= 1
