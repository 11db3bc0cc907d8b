"""The public buffer functions: each dispatches on the kind of buffer it is given.

A `ShiftBuffer` and a `WriteOnceBuffer` own their semantics (their methods); an
Equinox loop buffer is read and written through its own indexing; a plain array is
edited through the operations of `_ops`, with no token or error record to keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jaxtyping import Array, ArrayLike

from . import _ops
from ._buffer import ShiftBuffer
from ._ops import Index, IndexTuple
from ._writeonce import WriteOnceBuffer


try:  # Equinox's loop buffers; private, so tolerate their absence.
    from equinox.internal._loop.common import _Buffer as _EqxBuffer
except ImportError:  # pragma: no cover
    _EqxBuffer = ()

BufferLike = Union[Array, ShiftBuffer, WriteOnceBuffer, Any]


def _is_eqx(x: Any) -> bool:
    return bool(_EqxBuffer) and isinstance(x, _EqxBuffer)


def _plain(x: Any, name: str) -> jax.Array:
    """A plain array buffer (or an Equinox loop buffer's array) as a JAX array."""
    if _is_eqx(x):
        # `_Buffer.__getitem__` is a plain read of the underlying (possibly nested)
        # array.
        arr = x[...]
    else:
        if not isinstance(x, (jax.Array, np.ndarray, Tracer)):
            raise TypeError(
                f"esb.{name}: the buffer must be a JAX array, a ShiftBuffer, a "
                "WriteOnceBuffer or an equinox.internal loop buffer; got "
                f"{type(x).__name__}."
            )
        arr = jnp.asarray(x)
    if arr.ndim == 0:
        raise ValueError(
            f"esb.{name}: the buffer must have at least one dimension; got a scalar."
        )
    return arr


def _own_axis(x: ShiftBuffer, axis: Any) -> None:
    if axis is not None and _ops.normalise_axis(axis, x.ndim) != x.axis:
        raise ValueError(
            f"`axis`={axis} differs from the ShiftBuffer's own axis {x.axis}; "
            "leave `axis` out for a ShiftBuffer."
        )


def _axis(arr: jax.Array, axis: Any) -> int:
    return _ops.normalise_axis(-1 if axis is None else axis, arr.ndim)


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


def _refuse_write_once_shift(x: Any, name: str) -> None:
    if isinstance(x, WriteOnceBuffer):
        raise TypeError(
            f"esb.{name} cannot edit a WriteOnceBuffer: `esb.scan`'s `buffers=` "
            "are write-once (each element written at most once), and a shift "
            "rewrites what it reads. Carry a ShiftBuffer instead."
        )


def _eqx_window_index(starts: Sequence[jax.Array], sizes: Sequence[int]) -> tuple:
    n = len(sizes)
    out = []
    for k, (s, size) in enumerate(zip(starts, sizes)):
        shape = [1] * n
        shape[k] = size
        out.append((s + jnp.arange(size, dtype=s.dtype)).reshape(shape))
    return tuple(out)


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
    error as `.array` does, unless `mode="promise_in_bounds"`, which promises
    that no edit had an index out of range, as it does for a window). `x2` holds the same values as `x`. This is the form to
    use inside a loop, as an `equinox.nn.State` is used: carry on with `x2`, not
    `x`.

    Why: XLA updates a loop-carried buffer in place only when every read of it is
    ordered before the next write by data dependence. `x2` (a `ShiftBuffer`)
    carries a token that the next edit of `x2` waits for, and its storage is the
    read's output, so that under `jax.grad` the read's cotangent is added into the
    buffer's cotangent in place. `esb.dynamic_slice` returns only the window: a
    later edit of `x` in the same function still waits for the read (an edit's
    lowering waits for the reads of the storage it writes), but one inside a nested
    `jax.jit` or `lax.cond` branch does not, and copies the buffer every step; a
    step that returns `x` after reading it adds, under `jax.grad`, a buffer-sized
    cotangent every step unless an access of `x` follows the read. On a plain
    array, `x2` is the read's output array but carries no token: carry a
    `ShiftBuffer` to order reads and writes.

    **Arguments:** as for [`eqx_shiftbuf.dynamic_slice`][]; `start_indices` and
    `slice_sizes` are given together or not at all.

    **Returns:**

    `(x2, window)`: the buffer, of the same kind as `x`, and the window (or the
    whole contents).
    """
    if isinstance(x, (ShiftBuffer, WriteOnceBuffer)):
        return x.read(start_indices, slice_sizes, mode=mode)
    _ops.check_window_args(start_indices, slice_sizes)
    arr = _plain(x, "read")
    if start_indices is None:
        return (x if _is_eqx(x) else arr), arr
    if _is_eqx(x):
        sizes = _ops.check_sizes(slice_sizes, arr.shape)
        starts, _ = _ops.check_starts(
            start_indices, arr.shape, sizes, "start_indices", mode, op="dynamic_slice"
        )
        return x, lax.dynamic_slice(arr, starts, sizes)
    b, window = _ops.read_window(
        _ops.array_leaves(arr), start_indices, slice_sizes, mode
    )
    return b.storage, window


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
    if isinstance(x, (ShiftBuffer, WriteOnceBuffer)):
        return x.dynamic_update_slice(update, start_indices, mode=mode)
    arr = _plain(x, "dynamic_update_slice")
    if _is_eqx(x):
        upd, starts, _ = _ops.checked_update(
            arr.shape, arr.dtype, update, start_indices, mode, None
        )
        return x.at[_eqx_window_index(starts, upd.shape)].set(upd)
    return _ops.update_window(
        _ops.array_leaves(arr), update, start_indices, mode
    ).storage


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

    A shift costs O(line): it reads and rewrites its line. The exception is an
    edit at either end of a `ShiftBuffer` of one line (a 1-D buffer, a `(1, n)`
    buffer, a delay line or stack `ShiftBuffer.zeros((K, D), axis=0)`), with the
    position along `axis` a Python or NumPy int: the buffer is stored as a ring,
    and `insert(0, frame)`, `pop(0)`, `delete(0)` and the same at `K - 1` move
    one element, O(element) whatever `K` (0 copies in every mode; `tests/natural.py`,
    rows `delay_taps`, `front_stack`, `queue`); at another Python-int position,
    only the elements between it and the nearer end move, where that is cheaper
    than the whole line (up to about a sixth of a 1-D line, half a line of
    frames). A traced index there, or an edit farther in, shifts the line,
    rotated. A plain array has no ring: every shift is O(line).

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
    if isinstance(x, ShiftBuffer):
        _own_axis(x, axis)
        return x.insert(index, value, mode=mode)
    _refuse_eqx_shift(x, "insert")
    _refuse_write_once_shift(x, "insert")
    arr = _plain(x, "insert")
    return _ops.insert_at(
        _ops.array_leaves(arr), index, value, _axis(arr, axis), mode
    ).storage


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


def _pop(x, index, axis, fill, mode, read: bool) -> tuple[Any, Any]:
    name = "pop" if read else "delete"
    if isinstance(x, ShiftBuffer):
        _own_axis(x, axis)
        if read:
            return x.pop(index, fill=fill, mode=mode)
        return x.delete(index, fill=fill, mode=mode), None
    _refuse_eqx_shift(x, name)
    _refuse_write_once_shift(x, name)
    arr = _plain(x, name)
    fill = 0 if fill is None else fill
    b, removed = _ops.pop_at(
        _ops.array_leaves(arr), index, _axis(arr, axis), fill, mode, read
    )
    return b.storage, removed
