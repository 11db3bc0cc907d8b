"""Special values of every dtype, for the tests that reads are exact, bit for bit.

A read is a masked `max` over a window and a neighbouring one (see
`eqx_shiftbuf._primitives`): these are the values such a read could get wrong.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest


# Every dtype that JAX can hold in an array on this backend, where this JAX has it.
# Not `int1`, `uint1` and the `float6` dtypes: `jnp` names them, but XLA:CPU rejects
# them, so `lax.dynamic_slice` cannot read them either.
_DTYPE_NAMES = [
    "bool_",
    *("int2", "int4", "int8", "int16", "int32", "int64"),
    *("uint2", "uint4", "uint8", "uint16", "uint32", "uint64"),
    "float4_e2m1fn",
    *("float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn"),
    *("float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
    *("bfloat16", "float16", "float32", "float64"),
    *("complex64", "complex128"),
]
DTYPES = [
    pytest.param(jnp.dtype(getattr(jnp, name)), id=name.rstrip("_"))
    for name in _DTYPE_NAMES
    if hasattr(jnp, name)
]
INEXACT_DTYPES = [p for p in DTYPES if jnp.issubdtype(p.values[0], jnp.inexact)]


def width(dtype) -> int:
    """The number of bits of a value of `dtype` (4 for `int4`, which takes a byte)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.complexfloating):
        return 8 * dtype.itemsize
    if jnp.issubdtype(dtype, jnp.integer):
        return ml_dtypes.iinfo(dtype).bits
    return ml_dtypes.finfo(dtype).bits


def bits(a) -> np.ndarray:
    """The bit patterns of the elements of `a`, as unsigned integers (a complex
    number as two: its real and imaginary parts)."""
    a = np.asarray(a).reshape(np.shape(a) or (1,))  # a 0-d array cannot be viewed
    raw = a.view(f"u{min(a.dtype.itemsize, 8)}")
    n = width(a.dtype)
    return raw & ((1 << n) - 1) if n < 8 * raw.dtype.itemsize else raw


def has_nan(dtype) -> bool:
    """Whether `dtype` has a NaN (`float4_e2m1fn` turns NaN into -0.0)."""
    if not jnp.issubdtype(dtype, jnp.inexact):
        return False
    return bool(np.isnan(np.asarray(np.nan).astype(dtype).astype(np.complex128)))


@functools.cache
def lax_writes_keep_nans(dtype) -> bool:
    """Whether a jitted `lax.dynamic_update_slice` keeps the bits of the NaNs of
    `dtype` it rewrites. XLA:CPU computes bfloat16 and the float8 dtypes in float32,
    and converting back quiets signalling NaNs and drops payloads: a value an edit
    wrote can only be compared as "a NaN" there, as with plain `lax` edits."""
    v = bit_patterns(dtype)
    write = jax.jit(lambda x, i: jax.lax.dynamic_update_slice(x, x[:1], (i,)))
    return bool((bits(write(jnp.asarray(v), jnp.int32(0))) == bits(v)).all())


def _float_specials(dtype, uint) -> np.ndarray:
    """Zeros, ones, infinities, extremes, subnormals, and NaNs with payloads, of a
    32- or 64-bit float dtype: the values of a wide dtype worth reading."""
    f = np.finfo(dtype)
    mant = f.nmant
    exp_all = ((1 << (f.bits - mant - 1)) - 1) << mant  # every exponent bit set
    sign = 1 << (f.bits - 1)
    quiet = 1 << (mant - 1)
    values = np.asarray(
        [0.0, 1.0, np.inf, f.max, f.tiny, f.smallest_subnormal], dtype
    ).view(uint)
    largest_subnormal = np.asarray([(1 << mant) - 1], uint)
    nans = np.asarray(
        [
            exp_all | quiet,  # the default NaN
            exp_all | quiet | 1,  # a quiet NaN with a payload
            exp_all | 1,  # a signalling NaN
            exp_all | ((1 << mant) - 1),  # the largest payload
        ],
        uint,
    )
    positive = np.concatenate([values, largest_subnormal, nans])
    return np.concatenate([positive, positive | uint(sign)]).view(dtype)


def bit_patterns(dtype) -> np.ndarray:
    """A 1-D array of values of `dtype` that a read must return unchanged: every
    bit pattern of a dtype up to 16 bits wide; the special values of a wider one."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray([False, True])
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = np.dtype(f"f{dtype.itemsize // 2}")
        specials = bit_patterns(part)
        pairs = np.asarray(list(itertools.product(specials, specials)), part)
        return pairs.reshape(-1).view(dtype)
    n = width(dtype)
    if n <= 16:
        patterns = np.arange(1 << n, dtype=np.uint16 if n == 16 else np.uint8)
        return patterns.view(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        # The extremes, and either side of 0 and of the top bit's flip.
        lo, hi = int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)
        values = [lo, lo + 1, -1, 0, 1, hi // 2, hi // 2 + 1, hi - 1, hi]
        return np.asarray(
            list(dict.fromkeys(v for v in values if lo <= v <= hi)), dtype
        )
    return _float_specials(dtype, np.dtype(f"u{dtype.itemsize}").type)


# -- one value in a small array, for the tests that read it through each path

# Values a masked read could get wrong: the sign of zero, infinities, NaN, the most
# negative integer, subnormals (a floating-point reduction flushes them), and values
# of dtypes without -inf (where masking with -inf gave NaN).
SPECIAL = [
    pytest.param(jnp.float32, -0.0, id="f32--0.0"),
    pytest.param(jnp.float32, -np.inf, id="f32--inf"),
    pytest.param(jnp.float32, np.inf, id="f32-inf"),
    pytest.param(jnp.float32, np.nan, id="f32-nan"),
    pytest.param(jnp.float32, 1e-45, id="f32-subnormal"),
    pytest.param(jnp.bfloat16, -0.0, id="bf16--0.0"),
    pytest.param(jnp.bfloat16, 9.18e-41, id="bf16-subnormal"),
    pytest.param(jnp.float16, -6e-8, id="f16-subnormal"),
    pytest.param(jnp.float64, -np.inf, id="f64--inf"),
    pytest.param(jnp.float8_e4m3fn, 1.0, id="f8e4m3fn-1.0"),
    pytest.param(jnp.float8_e4m3fnuz, -2.0, id="f8e4m3fnuz--2.0"),
    pytest.param(jnp.float8_e5m2, -np.inf, id="f8e5m2--inf"),
    pytest.param(jnp.int32, np.iinfo(np.int32).min, id="i32-min"),
    pytest.param(jnp.int4, -8, id="i4-min"),
    pytest.param(jnp.uint8, 0, id="u8-0"),
    pytest.param(jnp.bool_, False, id="bool-False"),
    pytest.param(jnp.complex64, complex(-0.0, np.nan), id="c64--0.0+nanj"),
]


# Where the element is: inside the line, and in the last row and column (where the
# pair of elements the reduction reads starts one before it).
WHERE = [pytest.param((1, 2), id="inside"), pytest.param((2, 4), id="last")]


def special_array(dtype, value, others, cells) -> np.ndarray:
    """A 3x5 array holding `value` at `cells` and, around it, the same value or
    (`others == "nan"`, dtypes with a NaN only) NaN."""
    if others == "nan" and not has_nan(dtype):
        pytest.skip("NaN neighbours are for dtypes with a NaN")
    fill = value if others == "same" else np.nan
    a = np.full((3, 5), fill, dtype=jnp.dtype(dtype))
    a[cells] = np.asarray(value, jnp.dtype(dtype))
    return a
