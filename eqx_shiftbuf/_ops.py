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
from jax import lax
from jax.core import Tracer
from jaxtyping import Array, ArrayLike, Int

from . import _primitives as P, _tokens


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

# Deferred index errors (see `ShiftBuffer`): an edit records the code of its message,
# an integer >= 1 (0 is "no error"; held in a float32, exact to 2**24), in the
# buffer; a read raises it. Codes index this process-wide, append-only list, so a
# read traced later can still name an edit traced earlier, in another function.
_DEFERRED_MESSAGES: list[str] = []
_DEFERRED_CODES: dict[str, int] = {}
_DEFERRED_NOTE = (
    " (Raised at the first read of the ShiftBuffer after that edit: `.array`, "
    "`dynamic_slice` or `pop`. Edits record a bad index in the buffer rather than "
    "branch, which inside a loop would cost as much as the edit.)"
)
_DEFERRED_UNKNOWN = (
    "An edit of this ShiftBuffer had an index out of range (an edit traced after "
    "this read, so its message is not known here)."
)


def deferred_code(message: str) -> int:
    """The code of a deferred error `message`, registering it on first use."""
    code = _DEFERRED_CODES.get(message)
    if code is None:
        _DEFERRED_MESSAGES.append(message)
        code = _DEFERRED_CODES[message] = len(_DEFERRED_MESSAGES)
    return code


def _may_be_set(error: Any) -> bool:
    """False only for a record known, at trace time, to hold no error."""
    if error is None:
        return False
    if isinstance(error, Tracer):
        return True
    return bool(np.any(np.asarray(error) != 0))


def _deferred_messages() -> tuple[list[str], int]:
    """(messages by code - 1, then the fallback; the largest valid index)."""
    msgs = list(_DEFERRED_MESSAGES) + [_DEFERRED_UNKNOWN]
    return msgs, len(msgs) - 1


def _code_index(error: Any, last: int) -> jax.Array:
    """The message index of a (nonzero) record: its code - 1, within range."""
    return jnp.clip(error.astype(jnp.int32) - 1, 0, last)


def raise_deferred(storage: jax.Array, error: Any) -> jax.Array:
    """`storage`, made to raise first (at run time) the error `error` records, if any.

    The caller must use the returned storage in place of `storage` from then on.
    """
    if not _may_be_set(error):
        return storage
    msgs, last = _deferred_messages()
    pred, index = error != 0, _code_index(error, last)
    if storage.size == 0:
        # No element to make depend on the check, and none to poison: see `_keep`.
        _keep(eqx.branched_error_if(error, pred, index, msgs))
        return storage
    if os.environ.get("EQX_ON_ERROR", "raise") != "raise":
        # "nan" must poison the whole result, "breakpoint" stop before it: the plain
        # form, which passes the storage through the error's conditional.
        return eqx.branched_error_if(storage, pred, index, msgs)
    checked = eqx.branched_error_if(error, pred, index, msgs)
    return _after(storage, checked)


def _ignore(*args: Any) -> None:
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
    jax.debug.callback(_ignore, checked)


@jax.custom_jvp
def _after(storage: jax.Array, checked: jax.Array) -> jax.Array:
    """`storage`, data-dependent on `checked` (a record that is 0 if the program goes
    on), at the cost of rewriting a few elements in place.

    Not `error_if(storage, ...)`: a conditional's result is a new buffer, so that
    copies the whole storage, every step when `.array` is read inside a loop
    (measured: 1 copy per step of the cache body at 1600 rows). Not a
    `lax.optimization_barrier((storage, checked))` either: XLA drops a barrier's
    unused output and with it the (pure) check. Writing back the first elements,
    selected on `checked`, is an in-place write XLA cannot simplify away.
    """
    # The window spans 2 positions of every dimension that has them: XLA:CPU
    # duplicates a write whose update has a lower "true rank" (ignoring unit
    # dimensions) than the buffer, a single element say, into the next read of the
    # buffer, which then reads the older buffer, unordered with this write: a copy
    # (the `mixed` corpus body). The same reason as `_primitives._window2_edit`.
    # The start is a run-time zero, not the constant 0: XLA turns a constant-index
    # read into a static `slice`, and a fusion that writes its operand in place may
    # read that operand only through a `dynamic-slice` at the write's own indices.
    # Otherwise the fusion is not in place and rewrites the whole buffer, every
    # step, with no `copy` instruction to show it (`dynamic_update_slice` body
    # forward: 40 ms against 0.2 ms). Not a zero made from `checked` alone: when
    # no edit records errors (`promise_in_bounds` edits only), XLA proves the
    # record is 0 and folds it. The corner's `max` is data XLA cannot fold, and a
    # reduction is materialised on its own rather than fused into the write.
    # The elements are rewritten as their bits where XLA:CPU would not write them
    # exactly (`_primitives.carrier`): `.array` is a read, and returns every bit.
    dtype = storage.dtype
    storage = P.to_carrier(storage)
    sizes = tuple(min(2, n) for n in storage.shape)
    corner = lax.slice(storage, (0,) * storage.ndim, sizes)
    if jnp.issubdtype(corner.dtype, jnp.complexfloating):
        corner = jnp.real(corner)
    # Zero for every value, NaN included (`opaque_zero`).
    zero = P.opaque_zero(jnp.max(corner)) + P.opaque_zero(checked)
    first = (zero,) * storage.ndim
    win = lax.dynamic_slice(storage, first, sizes)
    win = jnp.where(checked != 0, jnp.zeros_like(win), win)
    return P.from_carrier(lax.dynamic_update_slice(storage, win, first), dtype)


@_after.defjvp
def _after_jvp(primals, tangents):
    # The tangent is the storage's own: the write is an identity wherever the
    # program goes on, so nothing is added to the tangent (or transposed) program.
    storage, checked = primals
    return _after(storage, checked), tangents[0]


def _raise_traced(
    entries: list[Any],
    mode: str | None,
    *,
    op: str,
    error: Any = None,
    defer: bool = False,
    empty: bool = False,
) -> tuple[list[jax.Array], Any]:
    """Cast the entries to int32 and check the traced ones: `(indices, error)`.

    `error` is the deferred-error record of the `ShiftBuffer` being accessed (None
    for other buffers). With `defer` (an edit of a `ShiftBuffer`), an index out of
    range is recorded in the returned `error`, at the cost of a scalar `select`.
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
                message = f"esb.{op}: {entries[k].message}{_DEFERRED_NOTE}"
                new = jnp.asarray(deferred_code(message), error.dtype)
                code = jnp.where(entries[k].bad, new, code)
            # No tangent: the record is data about indices, not a value.
            error = lax.stop_gradient(jnp.where(error != 0, error, code))
        return values, error
    bads = [entries[k].bad for k in traced]
    msgs = [entries[k].message for k in traced]
    own = len(msgs)
    if _may_be_set(error):
        # The recorded error is checked last, its messages after this call's own.
        recorded, last = _deferred_messages()
        bads.append(error != 0)
        msgs += recorded
        recorded_index = own + _code_index(error, last)
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
    index = recorded_index if recorded_index is not None else jnp.int32(last)
    for k in reversed(range(last)):
        index = jnp.where(bads[k], jnp.int32(k), index)
    any_bad = functools.reduce(jnp.logical_or, bads)
    # Under vmap, `branched_error_if` raises the largest index over the batch
    # (`equinox`'s `unvmap_max`): an element with nothing out of range must not
    # outbid one that has, with the message of an entry (or a recorded error) that
    # is fine.
    index = jnp.where(any_bad, index, jnp.int32(0))
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


def _storage_and_axis(x: Any, axis: Any, fill: Any) -> tuple[Any, int, Any]:
    """(storage array, non-negative axis, fill) for any kind of buffer."""
    SB = ShiftBufferType()
    if isinstance(x, SB):
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


def _base_token(storage: Any, arrays: Sequence[Any]) -> jax.Array:
    """An opaque run-time zero for a loop's trip count (see `_primitives`).

    Taken from the first traced index or value; with none (every index a constant),
    from one element of the storage, so that XLA still cannot unroll the loop.
    """
    for a in arrays:
        if isinstance(a, Tracer):
            return P.opaque_zero(a)
    return P.opaque_zero(lax.stop_gradient(storage.reshape(-1)[:1]))


def _error_of(x: Any) -> Any:
    """A `ShiftBuffer`'s deferred-error record; None for any other buffer."""
    return x._error if isinstance(x, ShiftBufferType()) else None


def _rebuild(x: Any, storage: Any, error: Any = None) -> Any:
    SB = ShiftBufferType()
    if isinstance(x, SB):
        return SB._from_storage(storage, x.axis, x.fill, error)
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
    if _is_write_once(x):
        return x.dynamic_slice(start_indices, slice_sizes, mode=mode)
    storage, _, _ = _storage_and_axis(x, None, None)
    sizes = check_sizes(slice_sizes, storage.shape)
    starts, _ = check_starts(
        start_indices,
        storage.shape,
        sizes,
        "start_indices",
        mode,
        op="dynamic_slice",
        error=_error_of(x),
    )
    if _EqxBuffer and isinstance(x, _EqxBuffer):
        return lax.dynamic_slice(storage, starts, sizes)
    tok = _base_token(storage, starts)
    new_storage, window, _ = P.bind_read(storage, tok, starts, sizes)
    if isinstance(x, ShiftBufferType()) and _tokens.same_trace(new_storage, storage):
        # Thread the read through the buffer object itself, so that whatever the
        # caller does next with `x` (write it, or return it from a scan step) uses the
        # storage the read returned: see `_primitives`, "Why reads return the storage".
        object.__setattr__(x, "_storage", new_storage)
    return window


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
    storage, _, _ = _storage_and_axis(x, None, None)
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
    tok = _base_token(storage, starts + [upd])
    new_storage, _ = P.bind_swap(storage, tok, upd, starts, read=False)
    return _rebuild(x, new_storage, error)


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
    storage, ax, _ = _storage_and_axis(x, axis, None)
    idx, error = check_index(
        index, storage.shape, ax, mode, op="insert", error=_error_of(x), defer=True
    )
    vshape = storage.shape[ax + 1 :]
    val = check_value(value, vshape, storage.dtype, "value", f"x.shape[{ax}+1:]")
    tok = _base_token(storage, idx + [val])
    return _rebuild(x, P.bind_insert(storage, tok, val, idx, ax), error)


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
    new_storage, removed, error = _pop(x, index, axis, fill, mode, read=True)
    return _rebuild(x, new_storage, error), removed


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
    new_storage, _, error = _pop(x, index, axis, fill, mode, read=False)
    return _rebuild(x, new_storage, error)


def _pop(x, index, axis, fill, mode, read: bool):
    """The shared body of `pop` and `delete`: `(new storage, removed, error)`.

    A `delete` of a `ShiftBuffer` defers its index check; a `pop` reads, so it
    raises at once, together with any error an earlier edit recorded.
    """
    _refuse_eqx_shift(x, "pop/delete")
    storage, ax, fill = _storage_and_axis(x, axis, fill)
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
    tok = _base_token(storage, idx)
    new_storage, removed = P.bind_pop(storage, tok, idx, ax, fill, read=read)
    return new_storage, removed, error


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
