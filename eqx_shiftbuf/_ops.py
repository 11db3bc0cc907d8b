"""The buffer operations, for plain arrays, `ShiftBuffer`s and Equinox buffers.

Each public function validates its arguments at trace time (and traced indices at run
time, through `equinox.error_if`), then binds one primitive from `_primitives`.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, TYPE_CHECKING, TypeGuard, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from equinox.internal import unvmap_any
from jax import lax
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Int

from . import _primitives as P


if TYPE_CHECKING:
    from ._buffer import ShiftBuffer
    from ._writeonce import WriteOnceBuffer

try:  # Equinox's loop buffers; private, so tolerate their absence.
    from equinox.internal._loop.common import _Buffer as _EqxBuffer
except ImportError:  # pragma: no cover
    _EqxBuffer = ()

Index = Union[int, Int[ArrayLike, ""]]
IndexTuple = Union[Index, Sequence[Index]]
BufferLike = Union[Array, "ShiftBuffer", Any]


# ---------------------------------------------------------------------------
# Validation.


def normalise_axis(axis: Any, ndim: int, argname: str = "axis") -> int:
    """`axis` as a non-negative int, or a `ValueError` that says what was wrong."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"`{argname}` must be a Python int; got {axis!r}.")
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"`{argname}`={axis} is out of range for a buffer with {ndim} dimensions "
            f"(valid: {-ndim} to {ndim - 1})."
        )
    return int(axis) % ndim


def _is_concrete_int(i: Any) -> bool:
    return isinstance(i, (int, np.integer)) and not isinstance(i, bool)


def _valid_values(bound: int, pos: int) -> str:
    """What the valid values of index entry `pos` are, as an error message says it."""
    if bound < 0:  # an insert/delete/pop index along a dimension of length 0
        return f"the buffer has length 0 along dimension {pos}, so no value is valid."
    return f"valid values are 0 to {bound}."


def _check_scalar_index(i: Any, argname: str, pos: int, bound: int) -> Any:
    """One index entry as an int32 scalar, checked against `[0, bound]` (no value
    is valid when `bound` is negative)."""
    what = f"`{argname}`[{pos}]"
    valid = _valid_values(bound, pos)
    if isinstance(i, bool) or isinstance(i, np.bool_):
        raise TypeError(f"{what} must be an integer; got the bool {i!r}.")
    if _is_concrete_int(i):
        if not 0 <= i <= bound:
            raise IndexError(f"{what}={int(i)} is out of range: {valid}")
        return jnp.int32(i)
    if isinstance(i, float):
        raise TypeError(f"{what} must be an integer; got the float {i!r}.")
    try:
        arr = jnp.asarray(i)
    except TypeError as e:
        raise TypeError(f"{what} must be an integer scalar; got {i!r}.") from e
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(
            f"{what} must be an integer scalar; got an array of dtype {arr.dtype}."
        )
    if arr.ndim != 0:
        raise TypeError(
            f"{what} must be a scalar (0-d); got an array of shape {arr.shape}. "
            "Use jax.vmap to apply an operation at many indices."
        )
    # Check the bounds in the index's own dtype, then cast: casting first would wrap
    # an out-of-range int64 into range.
    if not isinstance(arr, Tracer):
        value = int(arr)
        if not 0 <= value <= bound:
            raise IndexError(f"{what}={value} is out of range: {valid}")
        return arr.astype(jnp.int32)
    # A traced index is checked at run time even where no value is valid: the call
    # may sit in a branch that never runs (a Python int there is still an error).
    return _Traced(arr, (arr < 0) | (arr > bound), f"{what} is out of range: {valid}")


class _Traced(NamedTuple):
    """A traced index entry whose range check is still to be raised."""

    value: jax.Array
    bad: jax.Array
    message: str


MODES = (None, "promise_in_bounds")

# Deferred index errors (see `ShiftBuffer`). An edit records a code, an integer >= 1
# (0 is "no error"), in the buffer; a read raises it. The code holds all that the
# message needs beyond what the reading buffer knows statically (its shape):
#
#     code = 1 + op + 3 * (pos + ndim * extra)
#
# `op` is the edit (`_DEFERRED_OPS`), `pos` the index entry out of range, `ndim` the
# buffer's, and `extra` 0 except for `dynamic_update_slice`: 1 + the update's size
# along `pos`, which gives the bound `shape[pos] - size`. The read rebuilds the
# message from the code when it raises (`_DeferredMessages`), so a read names any
# edit, whenever either was traced, and nothing outlives a trace. The record is a
# float32, exact for integers up to 2**24: an update too large for that records
# extra = 0 instead, and its message leaves the bound out.
_DEFERRED_OPS = ("insert", "delete", "dynamic_update_slice")
_DEFERRED_ARGNAMES = ("index", "index", "start_indices")
_MAX_CODE = 2**24
_DEFERRED_NOTE = (
    " (Raised at the first read of the ShiftBuffer after that edit: `.array`, "
    "`dynamic_slice` or `pop`. Edits record a bad index in the buffer rather than "
    "branch, which inside a loop would cost as much as the edit.)"
)


def deferred_code(op: str, pos: int, ndim: int, size: int | None = None) -> int:
    """The code that an edit `op` records for its index entry `pos` out of range.

    `size`: the update's size along `pos`, for `dynamic_update_slice`.
    """
    kind = _DEFERRED_OPS.index(op)
    extra = 0 if size is None else 1 + size
    code = 1 + kind + 3 * (pos + ndim * extra)
    if code > _MAX_CODE:  # not exact in a float32: record the edit without its size
        code = 1 + kind + 3 * pos
    return code


def _deferred_message(code: int, shape: tuple[int, ...]) -> str:
    """The message of a recorded `code`, read from a buffer of logical `shape`."""
    rest, kind = divmod(code - 1, 3)
    extra, pos = divmod(rest, len(shape))
    op = _DEFERRED_OPS[kind]
    what = f"esb.{op}: `{_DEFERRED_ARGNAMES[kind]}`[{pos}] is out of range"
    if op != "dynamic_update_slice" and extra == 0:
        message = f"{what}: valid values are 0 to {shape[pos] - 1}."
    elif op == "dynamic_update_slice" and extra == 0:
        message = f"{what}: the update would not fit inside the buffer."
    elif op == "dynamic_update_slice" and extra - 1 <= shape[pos]:
        message = f"{what}: valid values are 0 to {shape[pos] - (extra - 1)}."
    else:  # no edit of a buffer of this shape records this code
        message = "An edit of this ShiftBuffer had an index out of range."
    return message + _DEFERRED_NOTE


class _DeferredMessages(Sequence[str]):
    """The messages of a read's check, for `equinox.branched_error_if`: first the
    read's own (`own`), then one for each deferred-error code, 1 to `_MAX_CODE`,
    built only when raised. Hashable, as `equinox.filter_jit` needs of a static
    argument."""

    def __init__(self, own: Sequence[str], shape: tuple[int, ...]):
        self.own = tuple(own)
        self.shape = tuple(int(n) for n in shape)

    def __len__(self) -> int:
        return len(self.own) + _MAX_CODE

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index < len(self.own):
            return self.own[index]
        return _deferred_message(index - len(self.own) + 1, self.shape)

    def __hash__(self) -> int:
        return hash((self.own, self.shape))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _DeferredMessages):
            return NotImplemented
        return (self.own, self.shape) == (other.own, other.shape)

    def __repr__(self) -> str:
        return f"_DeferredMessages(own={self.own!r}, shape={self.shape!r})"


def _may_be_set(error: Any) -> bool:
    """False only for a record known, at trace time, to hold no error."""
    if error is None:
        return False
    if isinstance(error, Tracer):
        return True
    return bool(np.any(np.asarray(error) != 0))


def _code_index(error: Any) -> jax.Array:
    """The index of a (nonzero) record's message among the codes: its code - 1."""
    return jnp.clip(error.astype(jnp.int32) - 1, 0, _MAX_CODE - 1)


def raise_deferred(
    storage: jax.Array, error: Any, batch_shape: tuple[int, ...] = ()
) -> jax.Array:
    """`storage`, made to raise first (at run time) the error `error` records, if any.

    The caller must use the returned storage in place of `storage` from then on.
    For a batch of buffers (`batch_shape`, the shape of `error`), the error of the
    first buffer in the batch that has one is raised.
    """
    if not _may_be_set(error):
        return storage
    if batch_shape:
        flat = jnp.reshape(error, (-1,))
        error = flat[jnp.argmax(flat != 0)]
    # Messages are decoded against the shape of one buffer of the batch.
    msgs = _DeferredMessages((), storage.shape[len(batch_shape) :])
    pred, index = error != 0, _code_index(error)
    if storage.size == 0:
        # No element to poison or to stop before: the check runs on the side.
        _check_on_the_side(error, pred, index, msgs)
        return storage
    if os.environ.get("EQX_ON_ERROR", "raise") != "raise":
        # "nan" must poison the whole result, "breakpoint" stop before it: the plain
        # form, which passes the storage through the error's conditional.
        return eqx.branched_error_if(storage, pred, index, msgs)
    _check_on_the_side(error, pred, index, msgs)
    return storage


def _nothing(*_: Any) -> None:
    pass


def _keep(checked: jax.Array) -> None:
    """Make sure the check that computed `checked` runs, though no result uses it.

    An access that touches no element (a zero-size window, or any access of a
    zero-size buffer) has zero-size results only, and XLA replaces every zero-size
    value by a constant: the indices that carry the check then have no use, and
    the check (an `equinox.error_if`, a pure callback) is removed as dead code. A
    `jax.debug.callback` is an effect, never removed, so the check it takes as an
    operand runs. It costs a host callback per call, for accesses that do nothing.
    """
    jax.debug.callback(_nothing, checked)


def _check_on_the_side(error, pred, index, msgs) -> None:
    """Raise the error `error` records, through `equinox.branched_error_if`, with
    nothing depending on the check: the contents are returned as they are.

    A check whose result is not used is dead code to JAX and XLA (Equinox's check
    is a pure callback in a conditional). So the check runs inside a conditional
    that also makes an effectful (never dead) callback, taken only when `pred`
    holds: in "raise" mode the check raises first, the program stops and returns
    nothing, so no value of the bad buffer is ever seen. The contents need no data
    dependence on the check, so neither a copy nor a write of the storage: a
    conditional's result is a new buffer (`error_if(storage, ...)` copies the whole
    buffer every step when `.array` is read inside a loop: 1 copy per step of the
    cache body at 1600 rows), and writing a corner of the storage to make it depend
    on the check is an in-place write that the next edit of the buffer, or
    returning it from the step, then copies.
    """

    def check():
        jax.debug.callback(_nothing, eqx.branched_error_if(error, pred, index, msgs))

    lax.cond(unvmap_any(pred), check, lambda: None)


def _raise_traced(
    entries: list[Any],
    mode: str | None,
    *,
    op: str,
    shape: tuple[int, ...],
    sizes: Sequence[int] | None = None,
    error: Any = None,
    defer: bool = False,
    empty: bool = False,
) -> tuple[list[jax.Array], Any]:
    """Cast the entries to int32 and check the traced ones: `(indices, error)`.

    `shape` is the buffer's, `sizes` the window's (for `dynamic_update_slice`).
    `error` is the deferred-error record of the `ShiftBuffer` being accessed (None
    for other buffers). With `defer` (an edit of a `ShiftBuffer`), an index out of
    range is recorded in the returned `error` (see `deferred_code`), at the cost of a
    scalar `select`.
    Otherwise one `equinox.branched_error_if` checks this call's indices and the
    record together: each is a conditional on the compiled step's critical path (on
    XLA:CPU about as much as a whole small edit), so there is at most one per call,
    and the branch index still picks the message of the first entry out of range.
    `empty`: the access touches no element, so nothing would use the check
    (`_keep`).
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be None or 'promise_in_bounds'; got {mode!r}.")
    traced = [k for k, e in enumerate(entries) if isinstance(e, _Traced)]
    values = [
        e.value.astype(jnp.int32) if k in traced else e for k, e in enumerate(entries)
    ]
    if mode == "promise_in_bounds":
        return values, error
    if defer and error is not None:
        if traced:
            code = jnp.zeros((), error.dtype)
            for k in reversed(traced):
                size = None if sizes is None else sizes[k]
                new = jnp.asarray(deferred_code(op, k, len(shape), size), error.dtype)
                code = jnp.where(entries[k].bad, new, code)
            # No tangent: the record is data about indices, not a value.
            error = lax.stop_gradient(jnp.where(error != 0, error, code))
        return values, error
    bads = [entries[k].bad for k in traced]
    own = [entries[k].message for k in traced]
    msgs: Sequence[str] = own
    if _may_be_set(error):
        # The recorded error is checked last, its messages after this call's own.
        msgs = _DeferredMessages(own, shape)
        bads.append(error != 0)
        recorded_index = len(own) + _code_index(error)
    else:
        recorded_index = None
    if not bads:
        return values, error
    # The message of the first entry out of range (the recorded error's when only
    # it is set), chosen with scalar `where`s and `or`s that fuse into one small
    # kernel. Not `argmax`/`any` over the stacked flags: XLA:CPU runs `argmax` as a
    # variadic reduction costing about 0.4 us, every step in a loop (a checked
    # pop's forward step took 2.6x its unchecked one; 1.2x without it).
    last = len(bads) - 1
    # With nothing out of range, index 0: under `vmap`, Equinox raises the largest
    # index of the batch, which must be that of an element with an error.
    fallback = recorded_index if recorded_index is not None else jnp.int32(last)
    index = jnp.where(bads[last], fallback, jnp.int32(0))
    for k in reversed(range(last)):
        index = jnp.where(bads[k], jnp.int32(k), index)
    any_bad = functools.reduce(jnp.logical_or, bads)
    # The check is threaded into this call's indices, so the access waits for it:
    # through one int32 that is 0 whenever the program goes on (`any(bad)` itself),
    # added to each traced index (to every index when none is traced but a recorded
    # error is). Passing the indices themselves through the conditional makes XLA
    # materialise each one as a scalar kernel of its own before it.
    tok = eqx.branched_error_if(any_bad.astype(jnp.int32), any_bad, index, msgs)
    if empty:
        _keep(tok)
    for k in traced or range(len(values)):
        values[k] = values[k] + tok.astype(jnp.asarray(values[k]).dtype)
    return values, error


def _index_entries(index: Any, argname: str, count: int, what: str) -> list[Any]:
    if isinstance(index, (tuple, list)):
        entries = list(index)
    elif count == 1:
        entries = [index]
    else:
        raise TypeError(
            f"`{argname}` must be a tuple of {count} integer scalars ({what}); "
            f"got {index!r}."
        )
    if len(entries) != count:
        raise ValueError(
            f"`{argname}` must have {count} entries ({what}); got {len(entries)}."
        )
    return entries


def check_index(
    index: Any,
    shape: tuple[int, ...],
    axis: int,
    mode: str | None = None,
    argname: str = "index",
    *,
    op: str,
    error: Any = None,
    defer: bool = False,
) -> tuple[list[jax.Array], Any]:
    """An insert/delete/pop index: one entry per dimension up to and including `axis`.

    Returns the indices and the buffer's deferred-error record (see `_raise_traced`).
    """
    entries = _index_entries(
        index, argname, axis + 1, f"one per dimension up to and including axis {axis}"
    )
    return _raise_traced(
        [
            _check_scalar_index(i, argname, k, shape[k] - 1)
            for k, i in enumerate(entries)
        ],
        mode,
        op=op,
        shape=shape,
        error=error,
        defer=defer,
        empty=math.prod(shape) == 0,
    )


def check_starts(
    starts: Any,
    shape: tuple[int, ...],
    sizes: Sequence[int],
    argname: str,
    mode: str | None = None,
    *,
    op: str,
    error: Any = None,
    defer: bool = False,
) -> tuple[list[jax.Array], Any]:
    """Start indices of a window of `sizes` that must lie inside `shape`."""
    entries = _index_entries(starts, argname, len(shape), "one per buffer dimension")
    return _raise_traced(
        [
            _check_scalar_index(i, argname, k, shape[k] - sizes[k])
            for k, i in enumerate(entries)
        ],
        mode,
        op=op,
        shape=shape,
        sizes=sizes,
        error=error,
        defer=defer,
        empty=math.prod(sizes) == 0,
    )


def check_sizes(sizes: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(sizes, (tuple, list)):
        raise TypeError(f"`slice_sizes` must be a tuple of ints; got {sizes!r}.")
    if len(sizes) != len(shape):
        raise ValueError(
            f"`slice_sizes` must have one entry per buffer dimension ({len(shape)}); "
            f"got {len(sizes)}."
        )
    out = []
    for k, (s, n) in enumerate(zip(sizes, shape)):
        if not _is_concrete_int(s):
            raise TypeError(f"`slice_sizes`[{k}] must be a Python int; got {s!r}.")
        if not 0 <= s <= n:
            raise ValueError(
                f"`slice_sizes`[{k}]={s} does not fit the buffer: valid sizes are 0 to "
                f"{n} (buffer shape {shape})."
            )
        out.append(int(s))
    return tuple(out)


def check_value(
    value: Any, shape: tuple[int, ...], dtype: Any, argname: str, what: str
) -> jax.Array:
    """`value` as an array of exactly `shape` and the buffer's `dtype`."""
    if isinstance(value, ShiftBufferType()):
        raise TypeError(f"`{argname}` must be an array; got a ShiftBuffer.")
    arr = jnp.asarray(value)
    if arr.shape != tuple(shape):
        raise ValueError(
            f"`{argname}` must have shape {tuple(shape)} ({what}); got shape "
            f"{arr.shape}."
        )
    if jnp.issubdtype(arr.dtype, jnp.inexact) and not jnp.issubdtype(
        dtype, jnp.inexact
    ):
        raise TypeError(
            f"`{argname}` has floating dtype {arr.dtype} but the buffer has dtype "
            f"{jnp.dtype(dtype)}: an integer buffer holds integers only (it is not "
            "differentiable)."
        )
    return arr.astype(dtype)


def ShiftBufferType():
    from ._buffer import ShiftBuffer

    return ShiftBuffer


# ---------------------------------------------------------------------------
# Dispatch on the kind of buffer.


def _is_write_once(x: Any) -> TypeGuard[WriteOnceBuffer]:
    from ._writeonce import WriteOnceBuffer

    return isinstance(x, WriteOnceBuffer)


def _unwrap_eqx(buf: Any) -> jax.Array:
    # `_Buffer.__getitem__` is a plain read of the underlying (possibly nested) array.
    return buf[...]


def check_unbatched(x: ShiftBuffer, name: str) -> None:
    """Refuse a batch of buffers (see `ShiftBuffer.batch_shape`) outside `vmap`."""
    if x.batch_shape:
        raise TypeError(
            f"esb.{name}: this ShiftBuffer is a batch of buffers (batch shape "
            f"{x.batch_shape}, as `jax.vmap` or `eqx.filter_vmap` returns it), and "
            f"esb.{name} edits or reads one buffer at indices for one buffer. Apply "
            f"it under `jax.vmap` (or `eqx.filter_vmap`) over the batch, e.g. "
            f"`jax.vmap(lambda b, i: ...)(buffers, indices)`. `.array` and `.shape` "
            "work on the whole batch."
        )


def _storage_and_axis(x: Any, axis: Any, fill: Any, name: str) -> tuple[Any, int, Any]:
    """(storage array, non-negative axis, fill) for any kind of buffer."""
    SB = ShiftBufferType()
    if isinstance(x, SB):
        check_unbatched(x, name)
        if axis is not None and normalise_axis(axis, x.ndim) != x.axis:
            raise ValueError(
                f"`axis`={axis} differs from the ShiftBuffer's own axis {x.axis}; "
                "leave `axis` out for a ShiftBuffer."
            )
        return x._storage, x.axis, x.fill if fill is None else fill
    if _EqxBuffer and isinstance(x, _EqxBuffer):
        arr = _unwrap_eqx(x)
    else:
        arr = x
        if not isinstance(arr, (jax.Array, np.ndarray, Tracer)):
            raise TypeError(
                "The buffer must be a JAX array, a ShiftBuffer, or an "
                f"equinox.internal buffer; got {type(x).__name__}."
            )
        arr = jnp.asarray(arr)
    if arr.ndim == 0:
        raise ValueError("The buffer must have at least one dimension; got a scalar.")
    axis = -1 if axis is None else axis
    return arr, normalise_axis(axis, arr.ndim), 0 if fill is None else fill


def _token_of(x: Any) -> jax.Array:
    """The token of the last access of `x` (see `_primitives`, "Binding helpers").

    A `ShiftBuffer` keeps it as its `_token` leaf, which its operations thread; any
    other buffer has none, so an access of a plain array is ordered after earlier
    reads of it only through the values it uses.
    """
    if isinstance(x, ShiftBufferType()):
        return x._token
    return P.new_token()


def _error_of(x: Any) -> Any:
    """A `ShiftBuffer`'s deferred-error record; None for any other buffer."""
    return x._error if isinstance(x, ShiftBufferType()) else None


def _rebuild(x: Any, storage: Any, error: Any, token: Any) -> Any:
    """A buffer of the kind of `x` holding `storage`, with `x`'s static fields."""
    if isinstance(x, ShiftBufferType()):
        return x._replace(storage, error, token)
    return storage


def _refuse_eqx_shift(x: Any, name: str) -> None:
    # Equinox's buffers are write-once: its checkpointed loops replay each step's
    # backward pass against the *final* buffer and pass the cotangent through a write
    # without zeroing it (equinox/internal/_loop/common.py, `maybe_set_p`). A shift
    # reads the line it then overwrites, so its gradient there would be silently
    # wrong (a popped value is replayed from the shifted line). Refuse it outright:
    # whether the step will be differentiated is not known when it is traced.
    if _EqxBuffer and isinstance(x, _EqxBuffer):
        raise TypeError(
            f"esb.{name} cannot edit an equinox.internal loop buffer: those are "
            "write-once, and a shift rewrites the line it reads, which Equinox "
            "differentiates wrongly. Keep the array in the carry as an "
            "eqx_shiftbuf.ShiftBuffer (not in `buffers=`). esb.dynamic_slice and "
            "esb.dynamic_update_slice do accept Equinox buffers."
        )


def _eqx_window_index(starts: Sequence[jax.Array], sizes: Sequence[int]) -> tuple:
    n = len(sizes)
    out = []
    for k, (s, size) in enumerate(zip(starts, sizes)):
        shape = [1] * n
        shape[k] = size
        out.append((s + jnp.arange(size, dtype=s.dtype)).reshape(shape))
    return tuple(out)


# ---------------------------------------------------------------------------
# Public functions.


def dynamic_slice(
    x: BufferLike,
    start_indices: Sequence[Index],
    slice_sizes: Sequence[int],
    *,
    mode: str | None = None,
) -> Array:
    """Read a window of a buffer: `lax.dynamic_slice(x, start_indices, slice_sizes)`.

    Unlike `lax.dynamic_slice`, a window that does not fit is an error, never a
    silent clamp, and reading a `ShiftBuffer` inside a loop stays in place under
    autodiff: the read is ordered before the buffer's next write.

    **Arguments:**

    - `x`: a JAX array, a [`eqx_shiftbuf.ShiftBuffer`][], or the buffer object that
      `equinox.internal.scan(..., buffers=...)` passes to its body.
    - `start_indices`: one integer scalar per dimension of `x`.
    - `slice_sizes`: one Python int per dimension of `x`.
    - `mode`: `None` (the default) checks traced indices when the program runs,
      through `equinox.error_if`. `"promise_in_bounds"` skips that check, as the
      mode of that name does for `jax.numpy`'s `.at[...]`: you promise that every
      index is in range, and a traced index out of range then gives an unspecified
      result. Python-int indices are always checked. A read's check is one
      conditional per call (on XLA:CPU about as much as a small edit); it also
      raises an error that an earlier edit of the `ShiftBuffer` recorded. An edit
      of a `ShiftBuffer` (`insert`, `delete`, `dynamic_update_slice`) records a bad
      index in the buffer instead, for the next read to raise: no conditional (see
      [`eqx_shiftbuf.ShiftBuffer`][]). On other buffers every call checks at once.
      A `"promise_in_bounds"` call makes no check at all: it neither records nor
      raises a recorded error.

    **Returns:**

    The window, an array of shape `slice_sizes`.
    """
    return read(x, start_indices, slice_sizes, mode=mode)[1]


def read(
    x: BufferLike,
    start_indices: Sequence[Index] | None = None,
    slice_sizes: Sequence[int] | None = None,
    *,
    mode: str | None = None,
) -> tuple[Any, Array]:
    """Read a window of a buffer, and return the buffer to use from then on.

    `esb.read(x, start_indices, slice_sizes)` is `(x2, window)` with `window ==
    esb.dynamic_slice(x, start_indices, slice_sizes)`; with neither given it reads
    the whole contents (`x.array` for a `ShiftBuffer`, raising a recorded index
    error as `.array` does). `x2` holds the same values as `x`. This is the form to
    use inside a loop, as an `equinox.nn.State` is used: carry on with `x2`, not
    `x`.

    Why: XLA updates a loop-carried buffer in place only when every read of it is
    ordered before the next write by data dependence. `x2` (a `ShiftBuffer`)
    carries a token that the next edit of `x2` waits for, and its storage is the
    read's output, so that under `jax.grad` the read's cotangent is added into the
    buffer's cotangent in place. `esb.dynamic_slice` returns only the window: a
    later edit of `x` that does not use the window's values, or a step that returns
    `x` after reading it, then copies the buffer (or, under `jax.grad`, adds a
    buffer-sized cotangent) every step. On a plain array, `x2` is the read's output
    array but carries no token: carry a `ShiftBuffer` to order reads and writes.

    **Arguments:** as for [`eqx_shiftbuf.dynamic_slice`][]; `start_indices` and
    `slice_sizes` are given together or not at all.

    **Returns:**

    `(x2, window)`: the buffer, of the same kind as `x`, and the window (or the
    whole contents).
    """
    if (start_indices is None) != (slice_sizes is None):
        raise TypeError(
            "esb.read: give both `start_indices` and `slice_sizes` (a window), or "
            "neither (the whole contents)."
        )
    if start_indices is None:
        return _read_all(x)
    if _is_write_once(x):
        return x, x.dynamic_slice(start_indices, slice_sizes, mode=mode)
    storage, _, _ = _storage_and_axis(x, None, None, "dynamic_slice")
    sizes = check_sizes(slice_sizes, storage.shape)
    starts, error = check_starts(
        start_indices,
        storage.shape,
        sizes,
        "start_indices",
        mode,
        op="dynamic_slice",
        error=_error_of(x),
    )
    if _EqxBuffer and isinstance(x, _EqxBuffer):
        return x, lax.dynamic_slice(storage, starts, sizes)
    new_storage, window, tok = P.bind_read(storage, _token_of(x), starts, sizes)
    return _rebuild(x, new_storage, error, tok), window


def _read_all(x: Any) -> tuple[Any, Array]:
    if _is_write_once(x):
        return x, x.array
    if isinstance(x, ShiftBufferType()):
        storage = raise_deferred(x._storage, x._error, x.batch_shape)
        return x._replace(storage, x._error, x._token), storage
    storage, _, _ = _storage_and_axis(x, None, None, "read")
    return storage, storage


def dynamic_update_slice(
    x: BufferLike,
    update: ArrayLike,
    start_indices: Sequence[Index],
    *,
    mode: str | None = None,
) -> Any:
    """Overwrite a window: `lax.dynamic_update_slice(x, update, start_indices)`.

    **Arguments:**

    - `x`: a JAX array, a [`eqx_shiftbuf.ShiftBuffer`][], or an Equinox loop buffer.
    - `update`: the new contents of the window; same rank and dtype as `x`, and no
      larger along any dimension.
    - `start_indices`: one integer scalar per dimension of `x`.
    - `mode`: as for [`eqx_shiftbuf.dynamic_slice`][]: `"promise_in_bounds"` skips
      the run-time index check.

    **Returns:**

    The updated buffer, of the same kind as `x`.
    """
    if _is_write_once(x):
        return x.dynamic_update_slice(update, start_indices, mode=mode)
    storage, _, _ = _storage_and_axis(x, None, None, "dynamic_update_slice")
    upd = jnp.asarray(update)
    if upd.ndim != storage.ndim:
        raise ValueError(
            f"`update` must have the buffer's rank {storage.ndim}; got shape "
            f"{upd.shape} for a buffer of shape {storage.shape}."
        )
    for k, (u, n) in enumerate(zip(upd.shape, storage.shape)):
        if u > n:
            raise ValueError(
                f"`update` of shape {upd.shape} is larger than the buffer of shape "
                f"{storage.shape} along dimension {k}."
            )
    upd = check_value(upd, upd.shape, storage.dtype, "update", "the window")
    starts, error = check_starts(
        start_indices,
        storage.shape,
        upd.shape,
        "start_indices",
        mode,
        op="dynamic_update_slice",
        error=_error_of(x),
        defer=True,
    )
    if _EqxBuffer and isinstance(x, _EqxBuffer):
        return x.at[_eqx_window_index(starts, upd.shape)].set(upd)
    new_storage, _, tok = P.bind_swap(storage, _token_of(x), upd, starts, read=False)
    return _rebuild(x, new_storage, error, tok)


def insert(
    x: BufferLike,
    index: IndexTuple,
    value: ArrayLike,
    *,
    axis: int | None = None,
    mode: str | None = None,
) -> Any:
    """Insert `value` at `index`, shifting the rest of the line along `axis` right.

    Along the line `x[index[:-1]]`, positions `col..n-2` move to `col+1..n-1` (where
    `col = index[-1]` and `n = x.shape[axis]`), the element at `n-1` is dropped, and
    `value` is written at `col`.

    **Arguments:**

    - `x`: a JAX array or a [`eqx_shiftbuf.ShiftBuffer`][]. (Not an Equinox loop
      buffer: those are write-once, and a shift rewrites what it reads.)
    - `index`: a tuple of integer scalars, one per dimension up to and including
      `axis` (a bare scalar when `axis` is 0).
    - `value`: an array of shape `x.shape[axis+1:]` (a scalar when `axis` is the last).
    - `axis`: the shift axis; a `ShiftBuffer` uses its own. Default `-1`.
    - `mode`: as for [`eqx_shiftbuf.dynamic_slice`][]: `"promise_in_bounds"` skips
      the run-time index check.

    **Returns:**

    The buffer after the insert, of the same kind as `x`.
    """
    _refuse_eqx_shift(x, "insert")
    storage, ax, _ = _storage_and_axis(x, axis, None, "insert")
    idx, error = check_index(
        index, storage.shape, ax, mode, op="insert", error=_error_of(x), defer=True
    )
    vshape = storage.shape[ax + 1 :]
    val = check_value(value, vshape, storage.dtype, "value", f"x.shape[{ax}+1:]")
    new_storage, tok = P.bind_insert(storage, _token_of(x), val, idx, ax)
    return _rebuild(x, new_storage, error, tok)


def pop(
    x: BufferLike,
    index: IndexTuple,
    *,
    axis: int | None = None,
    fill: Any = None,
    mode: str | None = None,
) -> tuple[Any, Array]:
    """Remove the element at `index`, shift the rest of the line left, and return it.

    Along the line `x[index[:-1]]`, positions `col+1..n-1` move to `col..n-2` and
    position `n-1` gets `fill`.

    **Arguments:**

    - `x`: a JAX array or a [`eqx_shiftbuf.ShiftBuffer`][]. (Not an Equinox loop
      buffer: those are write-once, and a shift rewrites what it reads.)
    - `index`: a tuple of integer scalars, one per dimension up to and including
      `axis`.
    - `axis`: the shift axis; a `ShiftBuffer` uses its own. Default `-1`.
    - `fill`: the value shifted in at the end of the line. Default: the
      `ShiftBuffer`'s `fill`, or 0.
    - `mode`: as for [`eqx_shiftbuf.dynamic_slice`][]: `"promise_in_bounds"` skips
      the run-time index check.

    **Returns:**

    `(buffer, removed)`: the buffer after the removal, of the same kind as `x`, and
    the removed element, of shape `x.shape[axis+1:]`.
    """
    return _pop(x, index, axis, fill, mode, read=True)


def delete(
    x: BufferLike,
    index: IndexTuple,
    *,
    axis: int | None = None,
    fill: Any = None,
    mode: str | None = None,
) -> Any:
    """Remove the element at `index` and shift the rest of the line left.

    The same as [`eqx_shiftbuf.pop`][] without the removed element.

    **Arguments:** as for [`eqx_shiftbuf.pop`][].

    **Returns:**

    The buffer after the removal, of the same kind as `x`.
    """
    return _pop(x, index, axis, fill, mode, read=False)[0]


def _pop(x, index, axis, fill, mode, read: bool):
    """The shared body of `pop` and `delete`: `(new buffer, removed)`.

    A `delete` of a `ShiftBuffer` defers its index check; a `pop` reads, so it
    raises at once, together with any error an earlier edit recorded.
    """
    _refuse_eqx_shift(x, "pop/delete")
    storage, ax, fill = _storage_and_axis(x, axis, fill, "pop" if read else "delete")
    fill = _check_fill(fill, storage.dtype)
    idx, error = check_index(
        index,
        storage.shape,
        ax,
        mode,
        op="pop" if read else "delete",
        error=_error_of(x),
        defer=not read,
    )
    new_storage, removed, tok = P.bind_pop(
        storage, _token_of(x), idx, ax, fill, read=read
    )
    return _rebuild(x, new_storage, error, tok), removed


def _check_fill(fill: Any, dtype: Any) -> Any:
    if isinstance(fill, (jax.Array, np.ndarray)) or isinstance(fill, Tracer):
        raise TypeError(
            f"`fill` must be a Python scalar (it is part of the operation, not an "
            f"input); got {type(fill).__name__}."
        )
    if not isinstance(fill, (bool, int, float)):
        raise TypeError(f"`fill` must be a Python scalar; got {fill!r}.")
    if isinstance(fill, float) and not jnp.issubdtype(dtype, jnp.inexact):
        if not float(fill).is_integer():
            raise TypeError(
                f"`fill`={fill!r} is not representable in the buffer's dtype "
                f"{jnp.dtype(dtype)}."
            )
        fill = int(fill)
    return fill
