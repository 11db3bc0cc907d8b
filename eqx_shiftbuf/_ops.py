"""The buffer operations on a storage array: validation, then one primitive.

Each operation here takes the storage array, the token of its last access and its
deferred-error record (None where the buffer keeps none), validates its arguments at
trace time (and traced indices at run time, through `equinox.error_if`, or by
recording them), binds one primitive from `_primitives`, and returns the new storage,
record and token. It knows nothing of the buffer types: `ShiftBuffer`
(`_buffer.py`) and `WriteOnceBuffer` (`_writeonce.py`) call these with their leaves,
and the public functions (`_functions.py`) dispatch on the kind of buffer.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jaxtyping import ArrayLike, Int

from . import _primitives as P
from ._xla import (
    check_on_the_side,
    from_carrier,
    invariant,
    on_the_operands_mesh,
    to_carrier,
    varying_axes,
)


Index = Union[int, Int[ArrayLike, ""]]
IndexTuple = Union[Index, Sequence[Index]]


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


def _static_entry(index: Any, pos: int, count: int) -> int | None:
    """Entry `pos` of an index of `count` entries (checked already) as a Python
    int, where the user gave it as one (a Python or NumPy int); else None."""
    entries = list(index) if isinstance(index, (tuple, list)) else [index]
    if len(entries) != count:
        return None
    entry = entries[pos]
    return int(entry) if _is_concrete_int(entry) else None


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
    # Compared in the index's own dtype, a bound past its largest value wraps (an
    # int8 index of a 200-long line: `arr > 199` is `arr > -57`, and a valid index
    # was an error); every value of such an index is then at most the bound.
    if bound < 0:
        bad = arr == arr
    elif bound >= jnp.iinfo(arr.dtype).max:
        bad = arr < 0
    else:
        bad = (arr < 0) | (arr > bound)
    return _Traced(arr, bad, f"{what} is out of range: {valid}")


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


def zero_from(arr: Any) -> jax.Array | None:
    """A float32 zero computed from `arr` (a zero-size slice of it, summed), or
    None when `arr` needs none: the initial error record and token of a buffer made
    under `jax.vmap` or inside a `shard_map`.

    A constant zero there is one record for the whole batch, or one not varying
    over the `shard_map`'s axes, while every edit makes them per element: the
    leaves of a batch would then be sharded unlike its storage (`jax.vmap` refuses
    such inputs on an explicit mesh) and a `lax.scan` carry would change its
    varying axes (`shard_map`'s checks refuse it). Derived from the storage they
    are batched, sharded and varying as it is. XLA folds the sum to a constant.
    """
    if not isinstance(arr, Tracer):
        return None
    batched = type(arr).__name__ == "BatchTracer"  # under `jax.vmap`
    if not batched and not varying_axes(arr):
        return None
    empty = lax.slice_in_dim(arr, 0, 0, axis=arr.ndim - 1)
    if jnp.issubdtype(empty.dtype, jnp.complexfloating):
        empty = jnp.real(empty)
    return jnp.sum(lax.convert_element_type(empty, jnp.float32))


def _first_set(error: jax.Array) -> jax.Array:
    """The record of the first buffer (in flattened batch order) of a batch of
    records that has one (0 if none has), by reductions only: no element is sliced
    out of the batch, whose dimensions may be sharded over devices."""
    n = math.prod(error.shape)
    pos = jnp.arange(n, dtype=jnp.int32).reshape(error.shape)
    first = jnp.min(jnp.where(error != 0, pos, n))
    return jnp.sum(jnp.where(pos == first, error, jnp.zeros((), error.dtype)))


def _code_index(error: Any) -> jax.Array:
    """The index of a (nonzero) record's message among the codes: its code - 1."""
    return jnp.clip(error.astype(jnp.int32) - 1, 0, _MAX_CODE - 1)


@on_the_operands_mesh
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
        error = _first_set(error)
    # Messages are decoded against the shape of one buffer of the batch.
    msgs = _DeferredMessages((), storage.shape[len(batch_shape) :])
    pred, index = error != 0, _code_index(error)
    if storage.size == 0:
        # No element to poison or to stop before: the check runs on the side.
        check_on_the_side(error, pred, index, msgs)
        return storage
    if os.environ.get("EQX_ON_ERROR", "raise") != "raise":
        # "nan" must poison the whole result, "breakpoint" stop before it: the plain
        # form, which passes the storage through the error's conditional.
        return eqx.branched_error_if(storage, pred, index, msgs)
    check_on_the_side(error, pred, index, msgs)
    return storage


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
    threaded into its indices: it runs on the side (`check_on_the_side`).
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
    own = tuple(entries[k].message for k in traced)
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
    # variadic reduction, a kernel of its own every step in a loop, as costly as
    # a small edit (`benchmarks/corpus.py` compares checked and promised steps).
    last = len(bads) - 1
    # With nothing out of range, index 0: under `vmap`, Equinox raises the largest
    # index of the batch, which must be that of an element with an error.
    fallback = recorded_index if recorded_index is not None else jnp.int32(last)
    index = jnp.where(bads[last], fallback, jnp.int32(0))
    for k in reversed(range(last)):
        index = jnp.where(bads[k], jnp.int32(k), index)
    any_bad = functools.reduce(jnp.logical_or, bads)
    if empty:
        # The access touches no element: its results are zero-size, which XLA
        # replaces by constants, so nothing would use indices the check is threaded
        # into, and the check would be dead code. It runs on the side.
        check_on_the_side(any_bad.astype(jnp.int32), any_bad, index, msgs)
        return values, error
    # The check is threaded into this call's indices, so the access waits for it:
    # through one int32 that is 0 whenever the program goes on (`any(bad)` itself),
    # added to each traced index (to every index when none is traced but a recorded
    # error is). Passing the indices themselves through the conditional makes XLA
    # materialise each one as a scalar kernel of its own before it.
    tok = any_bad.astype(jnp.int32)
    tok = eqx.branched_error_if(invariant(tok), any_bad, index, msgs)
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


@on_the_operands_mesh
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


@on_the_operands_mesh
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
    folded: bool = False,
) -> tuple[list[jax.Array], Any]:
    """Start indices of a window of `sizes` that must lie inside `shape`. `folded`:
    the read of the window may be folded away (`foldable`), so the check runs on
    the side, as for a window of no element."""
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
        empty=math.prod(sizes) == 0 or folded,
    )


def foldable(storage: Any) -> bool:
    """Whether XLA may replace a window of `storage` by a constant or a broadcast,
    dropping its start, and with it a check threaded into the start: `storage` is
    a constant of the program (an array closed over), or, in the program being
    traced, a broadcast of a scalar (`ShiftBuffer.zeros`, `jnp.full`, read before
    any edit). A `dynamic_slice` of either does not depend on its start, and an
    out-of-range start read zeros with no error. Read off the trace itself
    (`_primitives.broadcast_operand`), so no state is kept."""
    if not isinstance(storage, Tracer):
        return True
    operand = P.broadcast_operand(storage)
    return operand is not None and jnp.ndim(getattr(operand, "aval", operand)) == 0


def check_window_args(start_indices: Any, slice_sizes: Any) -> None:
    """A read takes both a window's start and its sizes, or neither (the whole
    contents)."""
    if (start_indices is None) != (slice_sizes is None):
        raise TypeError(
            "esb.read: give both `start_indices` and `slice_sizes` (a window), or "
            "neither (the whole contents)."
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
    if isinstance(value, eqx.Module):
        raise TypeError(f"`{argname}` must be an array; got a {type(value).__name__}.")
    arr = jnp.asarray(value)
    if arr.shape != tuple(shape):
        raise ValueError(
            f"`{argname}` must have shape {tuple(shape)} ({what}); got shape "
            f"{arr.shape}."
        )
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(arr.dtype, jnp.inexact) and not jnp.issubdtype(
        dtype, jnp.inexact
    ):
        kind = (
            "a bool buffer holds bools"
            if dtype == jnp.bool_
            else "an integer buffer holds integers"
        )
        raise TypeError(
            f"`{argname}` has floating dtype {arr.dtype} but the buffer has dtype "
            f"{dtype}: {kind} only (it is not differentiable)."
        )
    if jnp.issubdtype(arr.dtype, jnp.complexfloating) and not jnp.issubdtype(
        dtype, jnp.complexfloating
    ):
        # (`jnp`'s `.at[].set` warns that this will be an error; `lax` refuses it.)
        raise TypeError(
            f"`{argname}` has complex dtype {arr.dtype} but the buffer has dtype "
            f"{dtype}: writing it would drop the imaginary part. Take `.real` "
            "explicitly if that is meant."
        )
    if jnp.issubdtype(dtype, jnp.integer) and not isinstance(arr, Tracer):
        # A concrete integer that the buffer's dtype cannot hold would wrap (300
        # into int8 is 44, -1 into uint8 is 255).
        bad = _outside(arr, dtype)
        if bad is not None:
            info = jnp.iinfo(dtype)
            raise OverflowError(
                f"`{argname}` holds {bad}, which the buffer's dtype {dtype} cannot "
                f"hold (its values are {info.min} to {info.max})."
            )
    return arr.astype(dtype)


def _outside(values: Any, dtype: Any) -> Any:
    """The least (else the greatest) of the concrete `values` that the integer
    `dtype` cannot hold, or None if it holds them all."""
    info, v = jnp.iinfo(dtype), np.asarray(values)
    if v.size and v.min() < info.min:
        return v.min()
    if v.size and v.max() > info.max:
        return v.max()
    return None


# ---------------------------------------------------------------------------
# The operations, on a storage array.


class Ring(NamedTuple):
    """How a ring's one line is stored: logical position `j` along `axis` is at
    index `(head + j) % capacity` of the storage.

    A push or pop at either end of the line then moves the head and one element,
    not the line. `head` is a float32 scalar (one per buffer in a batch), like the
    token and error record; a NumPy zero until an edit moves it.
    """

    head: Any
    axis: int


class Leaves(NamedTuple):
    """A buffer's array leaves: what every operation takes and returns."""

    storage: jax.Array
    error: Any  # the deferred-error record, or None
    token: jax.Array
    ring: Ring | None = None  # None: the storage is the logical array


# The largest line a ring is used for: its head is a float32 (see `Ring`), exact
# up to 2**24.
_MAX_RING = 2**24


def is_ring(shape: tuple[int, ...], axis: int) -> bool:
    """Whether a `ShiftBuffer` of `shape` shifted along `axis` is stored as a
    ring: it has one line (every dimension before `axis` is 1 long), of at least
    two elements, and is not empty. (A line of a buffer with several lines is
    shifted by its own `insert`/`pop`, and would need a head of its own.)"""
    return (
        math.prod(shape[:axis]) == 1
        and 2 <= shape[axis] <= _MAX_RING
        and math.prod(shape) > 0
    )


def _ring_head(ring: Ring | None) -> jax.Array | None:
    """The head of `ring` as int32, or None where there is no ring or its head is
    known at trace time to be 0 (a NumPy zero: no edit moved it)."""
    if ring is None:
        return None
    head = ring.head
    if isinstance(head, np.ndarray) and not head.any():
        return None
    return jnp.asarray(head).astype(jnp.int32)


def _wrap(p: jax.Array, n: int) -> jax.Array:
    """`p % n` for `p` in `[0, 2n)`: a compare and a select, not an integer
    division."""
    return jnp.where(p >= n, p - n, p)


def _rotate(
    x: jax.Array, shift: jax.Array, axis: int, ordered: bool = False
) -> jax.Array:
    """`out[j] = x[(j + shift) % n]` along `axis`, for `shift` in `[0, n]`: a
    ring's contents in or out of its storage (`rotate_p`'s `contents`).
    `ordered`: a read that the next edit waits for (`rotate_p`'s `ordered`)."""
    shift = jnp.asarray(shift, jnp.int32)
    extra = {"ordered": True} if ordered else {}
    return P.rotate_p.bind(x, shift, axis=axis, contents=True, **extra)


def _moved(b: Leaves, storage: Any, error: Any, token: Any, head: Any) -> Leaves:
    """`b`'s successor; `head` (int32) is the ring's new head, None: unchanged."""
    ring = b.ring
    if ring is not None and head is not None:
        ring = Ring(head.astype(jnp.float32), ring.axis)
    return Leaves(storage, error, token, ring)


@on_the_operands_mesh
def logical(storage: jax.Array, ring: Ring | None, batch_shape=()) -> jax.Array:
    """The logical contents of `storage` (of a batch of buffers with
    `batch_shape`): the ring unrotated."""
    head = _ring_head(ring)
    if head is None or ring is None:
        return storage
    return _rotate(storage, head, len(batch_shape) + ring.axis)


def _ring_read(
    b: Leaves,
    starts: list,
    sizes: tuple[int, ...],
    head: jax.Array,
    static: int | None = None,
):
    """`(storage, window, token)`: the logical window of a ring at `starts`, whose
    entry along the ring's axis is the Python int `static` where the user gave one.

    At a static position, the read takes the head and the position as an offset
    (`read_p`'s `wrap`), so that the reads of a delay line's taps save one
    residual a step under `jax.grad` of a `lax.scan`, the head, not one start
    each. A window one element long along the ring's axis is one read; a whole
    line is read whole and rotated; otherwise the window may wrap round the end
    of the storage, and is one gather whose rows wrap (`read_p`'s `ring`), whose
    transpose is one scatter-add. (Read as the two windows of the same size at
    either end that hold it, it took two reads, and under `vmap(grad)` their
    two transposed accumulations copied the batch once a step.)
    """
    assert b.ring is not None
    ax = b.ring.axis
    n, cap = sizes[ax], b.storage.shape[ax]
    at = lambda q: starts[:ax] + [q] + starts[ax + 1 :]
    if n == 1 and static is not None:
        wrap = (ax, static, cap)
        return P.bind_read(b.storage, b.token, at(b.ring.head), sizes, wrap=wrap)
    p = _wrap(starts[ax] + head, cap)
    if n == 1:
        return P.bind_read(b.storage, b.token, at(p), sizes)
    if n == cap:
        storage, window, tok = P.bind_read(b.storage, b.token, at(p * 0), sizes)
        # (The next edit waits for the rotation: `_primitives.after_p`.)
        window = _rotate(window, head, ax, ordered=True)
        tok = P.after_p.bind(tok, window, jnp.asarray(head, jnp.int32))
        return storage, window, tok
    if static is not None:  # the head saved, not the start (as for one row)
        wrap = (ax, static, cap)
        at_head = at(b.ring.head)
        return P.bind_read(b.storage, b.token, at_head, sizes, wrap=wrap, ring=ax)
    return P.bind_read(b.storage, b.token, at(p), sizes, ring=ax)


def _ring_update(b: Leaves, upd: jax.Array, starts: list, head: jax.Array):
    """`(storage, token)` after writing `upd` at the logical `starts` of a ring.

    As `_ring_read`: one write, a rotated whole line, or, for a window that may
    wrap round the end of the storage, one write whose rows wrap (`swap_p`'s
    `ring`, a scatter): written as read-modify-writes of the two windows at either
    end that hold it, a block written into a ring took 1.8-2x plain `lax`'s
    forward (`block_write` in `tests/natural.py`).
    """
    assert b.ring is not None
    ax = b.ring.axis
    n, cap = upd.shape[ax], b.storage.shape[ax]
    p = _wrap(starts[ax] + head, cap)
    at = lambda q: starts[:ax] + [q] + starts[ax + 1 :]
    if n == 1:
        storage, _, tok = P.bind_swap(b.storage, b.token, upd, at(p), read=False)
        return storage, tok
    if n == cap:
        upd = _rotate(upd, cap - head, ax)
        storage, _, tok = P.bind_swap(b.storage, b.token, upd, at(p * 0), read=False)
        return storage, tok
    storage, _, tok = P.bind_swap(b.storage, b.token, upd, at(p), read=False, ring=ax)
    return storage, tok


def _static_end(index: Any, axis: int, cap: int) -> str | None:
    """'front' or 'back' if the entry along a ring's axis of `index` (as the user
    gave it, already checked) is known at trace time to be 0 or `cap - 1`; else
    None (a traced index, or a middle one). Read off the user's entry: inside a
    trace, even `jnp.int32(0)` is a tracer."""
    col = list(index)[axis] if isinstance(index, (tuple, list)) else index
    if isinstance(col, Tracer):
        return None
    c = int(np.asarray(col))
    return "front" if c == 0 else "back" if c == cap - 1 else None


# A shift at a Python-int position `p` of a ring moves only the elements between
# `p` and the nearer end: towards the back, `[p, K)` shifts within its window;
# towards the front, the head moves and `[0, p)` shifts the other way. Each side
# is a read and a write of that window (a gather and a scatter where it may wrap
# round the storage), O(min(p, K - p)), where a shift of the whole line is a
# `select` over the buffer and its materialised roll, two kernels over all of it
# (4.7x plain `lax`'s static concatenations, forward, on a (1024, 32) ring;
# `benchmarks/experiments/window_shifts.py`).
def _window_shift_side(b: Leaves, index: Any, axis: int) -> tuple[int, str] | None:
    """`(p, side)` where a shift of the ring `b` at the user's `index` moves a
    window (`side` 'back' or 'front', the nearer end): `index`'s entry along the
    line is a Python or NumPy int `p` not at an end, and that window is short
    enough to be the cheaper (`_ROW_COST`). Else None."""
    if b.ring is None:
        return None
    cap = b.storage.shape[axis]
    p = _static_entry(index, axis, axis + 1)
    if p is None or not 0 < p < cap - 1:
        return None
    back, front = cap - p, p + 1
    row = math.prod(b.storage.shape[axis + 1 :])
    if min(back, front) * (row + _ROW_COST) > cap * row:
        return None
    return p, "back" if back <= front else "front"


# What moving one element of a line through a window (a gather and a scatter) costs
# beyond its values, in values moved by a whole-line shift (a `select` and a
# materialised roll): a window of `m` elements of `row` values each is moved
# where `m * (row + _ROW_COST) <= K * row`. Measured on XLA:CPU with an insert and
# a pop a step (`benchmarks/experiments/window_shifts.py`): the two cost the same
# at about a sixth of a (4096,) line, at about half a (1024, 4) one, and a
# window of half a (1024, 32) delay line took a fifth of the whole line's time.
_ROW_COST = 5


def _line_starts(idx: list, axis: int, at: int, ndim: int) -> list:
    """The starts of a window of the ring's line from logical position `at`."""
    return list(idx[:axis]) + [jnp.int32(at)] + [jnp.int32(0)] * (ndim - axis - 1)


def _line_window(b: Leaves, idx: list, axis: int, at: int, n: int, head):
    """`(leaves, window)`: the `n` elements of the ring's line from logical `at`."""
    shape = b.storage.shape
    sizes = (1,) * axis + (n,) + tuple(shape[axis + 1 :])
    starts = _line_starts(idx, axis, at, len(shape))
    storage, window, tok = _ring_read(b, starts, sizes, head, at)
    return b._replace(storage=storage, token=tok), window


def _write_line_window(b: Leaves, idx: list, axis: int, at: int, new, head) -> Leaves:
    """The leaves after writing `new` into the ring's line from logical `at`."""
    starts = _line_starts(idx, axis, at, new.ndim)
    storage, tok = _ring_update(b, new, starts, head)
    return b._replace(storage=storage, token=tok)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _joined(parts: list, axis: int):
    """`parts` concatenated along `axis`, as bits (`_xla.carrier`): XLA:CPU moves
    the bfloat16 and float8 values of a concatenation through float32.

    Its derivative is the concatenation of the tangents (`_joined_jvp`): through
    the bits, an integer type, JAX's autodiff saw a constant, and a shift of a
    bfloat16 or float8 ring at a Python-int position beside an end (moved as a
    window, `_windowed_insert`) gave every element it moved, and the inserted
    value, a zero gradient (`tests/test_gradients.py`)."""
    dtype = parts[0].dtype
    return from_carrier(jnp.concatenate([to_carrier(x) for x in parts], axis), dtype)


@_joined.defjvp
def _joined_jvp(axis: int, primals: tuple, tangents: tuple):
    (parts,), (dparts,) = primals, tangents
    return _joined(parts, axis), jnp.concatenate(list(dparts), axis)


def _windowed_insert(b: Leaves, idx: list, axis: int, val, h, p: int, side: str):
    """`(leaves, new head or None)`: `insert_at` at the static position `p` of a
    ring whose head is `h` (`_window_shift_side`)."""
    cap = b.storage.shape[axis]
    row = val.reshape((1,) * (axis + 1) + val.shape)
    if side == "back":  # [p, K - 1) moves to [p + 1, K)
        b, w = _line_window(b, idx, axis, p, cap - 1 - p, h)
        return _write_line_window(b, idx, axis, p, _joined([row, w], axis), h), None
    # The head moves back one, over the last element; [0, p) moves one towards it.
    b, w = _line_window(b, idx, axis, 0, p, h)
    new_head = _wrap(h + (cap - 1), cap)
    b = _write_line_window(b, idx, axis, 0, _joined([w, row], axis), new_head)
    return b, new_head


def _windowed_pop(b: Leaves, idx: list, axis: int, fill, h, p: int, side: str):
    """`(leaves, removed, new head or None)`: `pop_at` at the static position `p`
    of a ring whose head is `h` (`_window_shift_side`)."""
    cap = b.storage.shape[axis]
    if side == "back":  # [p + 1, K) moves to [p, K - 1); `fill` at the end
        at, n, k, new_head = p, cap - p, 0, None
    else:  # [0, p) moves one towards the back, over the element removed; the head
        # moves on, and `fill` goes where the first element was, now the end
        at, n, k, new_head = 0, p + 1, p, _wrap(h + 1, cap)
    b, w = _line_window(b, idx, axis, at, n, h)
    elem = w.shape[axis + 1 :]
    removed = lax.index_in_dim(w, k, axis, keepdims=False).reshape(elem)
    row = jnp.full((1,) * (axis + 1) + elem, fill, w.dtype)
    rest = [
        lax.slice_in_dim(w, 0, k, axis=axis),
        lax.slice_in_dim(w, k + 1, n, axis=axis),
    ]
    new = _joined(rest + [row] if side == "back" else [row] + rest, axis)
    return _write_line_window(b, idx, axis, at, new, h), removed, new_head


def _only_element(idx: list, axis: int, shape: tuple[int, ...]):
    """`(starts, sizes)` of the element at `idx` of a line one element long.

    A shift of such a line is a write of that element (an insert) or a read and a
    write of it (a pop): one window, in place. As a shift (the line read, then
    written) a `(1, 256)` delay line's `pop((0,))` then `insert((0,), x)` copied
    the buffer every step (1 forward, 3 under `jvp`; plain `lax` 0 and 1)."""
    starts = list(idx[: axis + 1]) + [jnp.zeros_like(idx[axis])] * (
        len(shape) - axis - 1
    )
    return starts, (1,) * (axis + 1) + tuple(shape[axis + 1 :])


def _element_window(b: Leaves, idx: list, col: jax.Array):
    """`(starts, sizes)` of the element of `b`'s line at physical position `col`."""
    assert b.ring is not None
    ax = b.ring.axis
    shape = b.storage.shape
    starts = list(idx[:ax]) + [col] + [jnp.zeros_like(col)] * (len(shape) - ax - 1)
    return starts, (1,) * (ax + 1) + tuple(shape[ax + 1 :])


def array_leaves(arr: jax.Array) -> Leaves:
    """A plain array's leaves: no record (every call checks at once), and a token
    that orders nothing (a plain array carries none from one call to the next)."""
    return Leaves(arr, None, P.new_token())


@on_the_operands_mesh
def read_window(
    b: Leaves, start_indices: Any, slice_sizes: Any, mode: str | None
) -> tuple[Leaves, jax.Array]:
    """`(leaves, window)`: the window `storage[start : start + sizes]`, read by
    `read_p` after the index check (which also raises a recorded error)."""
    sizes = check_sizes(slice_sizes, b.storage.shape)
    starts, error = check_starts(
        start_indices,
        b.storage.shape,
        sizes,
        "start_indices",
        mode,
        op="dynamic_slice",
        error=b.error,
        folded=foldable(b.storage),
    )
    head = _ring_head(b.ring)
    if head is not None and b.ring is not None and math.prod(sizes) > 0:
        static = _static_entry(start_indices, b.ring.axis, len(sizes))
        storage, window, tok = _ring_read(b, starts, sizes, head, static)
    else:
        storage, window, tok = P.bind_read(b.storage, b.token, starts, sizes)
    return b._replace(storage=storage, error=error, token=tok), window


@on_the_operands_mesh
def checked_update(
    shape: tuple[int, ...],
    dtype: Any,
    update: Any,
    start_indices: Any,
    mode: str | None,
    error: Any,
) -> tuple[jax.Array, list[jax.Array], Any]:
    """`(update, starts, error)`: a `dynamic_update_slice`'s arguments, checked."""
    upd = jnp.asarray(update)
    if upd.ndim != len(shape):
        raise ValueError(
            f"`update` must have the buffer's rank {len(shape)}; got shape "
            f"{upd.shape} for a buffer of shape {shape}."
        )
    for k, (u, n) in enumerate(zip(upd.shape, shape)):
        if u > n:
            raise ValueError(
                f"`update` of shape {upd.shape} is larger than the buffer of shape "
                f"{shape} along dimension {k}."
            )
    upd = check_value(upd, upd.shape, dtype, "update", "the window")
    starts, error = check_starts(
        start_indices,
        shape,
        upd.shape,
        "start_indices",
        mode,
        op="dynamic_update_slice",
        error=error,
        defer=True,
    )
    return upd, starts, error


@on_the_operands_mesh
def update_window(
    b: Leaves, update: Any, start_indices: Any, mode: str | None
) -> Leaves:
    """The leaves after `storage[start : start + update.shape] = update`."""
    upd, starts, error = checked_update(
        b.storage.shape, b.storage.dtype, update, start_indices, mode, b.error
    )
    head = _ring_head(b.ring)
    if head is not None and upd.size > 0:
        storage, tok = _ring_update(b, upd, starts, head)
    else:
        storage, _, tok = P.bind_swap(b.storage, b.token, upd, starts, read=False)
    return b._replace(storage=storage, error=error, token=tok)


@on_the_operands_mesh
def insert_at(b: Leaves, index: Any, value: Any, axis: int, mode: str | None) -> Leaves:
    """The leaves after inserting `value` at `index`, shifting right along `axis`."""
    shape = b.storage.shape
    idx, error = check_index(
        index, shape, axis, mode, op="insert", error=b.error, defer=True
    )
    vshape = shape[axis + 1 :]
    val = check_value(
        value, vshape, b.storage.dtype, "value", f"the buffer's shape past axis {axis}"
    )
    cap, head = shape[axis], _ring_head(b.ring)
    if cap == 1:  # the inserted value replaces the line's only element
        starts, sizes = _only_element(idx, axis, shape)
        storage, _, tok = P.bind_swap(
            b.storage, b.token, val.reshape(sizes), starts, read=False
        )
        return b._replace(storage=storage, error=error, token=tok)
    h = jnp.int32(0) if head is None else head
    end = None if b.ring is None else _static_end(index, axis, cap)
    windowed = _window_shift_side(b, index, axis)  # None at an end
    if windowed is not None:
        moved, new_head = _windowed_insert(b, idx, axis, val, h, *windowed)
        return _moved(moved, moved.storage, error, moved.token, new_head)
    if end is None:  # the line shifts (rotated by a ring's head)
        ring_idx = idx if head is None else idx + [head]
        storage, tok = P.bind_insert(b.storage, b.token, val, ring_idx, axis)
        return b._replace(storage=storage, error=error, token=tok)
    # A ring: a push at the front moves the head back one and writes the value
    # there, over the element that falls off the end; one at the back overwrites
    # the last element.
    new_head = _wrap(h + (cap - 1), cap)
    starts, sizes = _element_window(b, idx, new_head)
    upd = val.reshape(sizes)
    storage, _, tok = P.bind_swap(b.storage, b.token, upd, starts, read=False)
    return _moved(b, storage, error, tok, new_head if end == "front" else None)


@on_the_operands_mesh
def pop_at(
    b: Leaves, index: Any, axis: int, fill: Any, mode: str | None, read: bool
) -> tuple[Leaves, jax.Array]:
    """`(leaves, removed)` after removing the element at `index` along `axis`,
    shifting left and filling the end with `fill`.

    A `delete` (`read=False`) defers its index check to the record; a `pop` reads,
    so it raises at once, together with any error an earlier edit recorded.
    """
    fill = check_fill(fill, b.storage.dtype)
    idx, error = check_index(
        index,
        b.storage.shape,
        axis,
        mode,
        op="pop" if read else "delete",
        error=b.error,
        defer=not read,
    )
    shape = b.storage.shape
    cap, head = shape[axis], _ring_head(b.ring)
    if cap == 1:  # the line's only element is read and `fill` written in its place
        starts, sizes = _only_element(idx, axis, shape)
        fills = jnp.full(sizes, fill, b.storage.dtype)
        storage, removed, tok = P.bind_swap(
            b.storage, b.token, fills, starts, read=read
        )
        removed = removed.reshape(shape[axis + 1 :])
        if not read:
            removed = jnp.zeros_like(removed)
        return b._replace(storage=storage, error=error, token=tok), removed
    h = jnp.int32(0) if head is None else head
    end = None if b.ring is None else _static_end(index, axis, cap)
    windowed = _window_shift_side(b, index, axis)  # None at an end
    if windowed is not None:
        moved, removed, new_head = _windowed_pop(b, idx, axis, fill, h, *windowed)
        if not read:
            removed = jnp.zeros(shape[axis + 1 :], b.storage.dtype)
        return _moved(moved, moved.storage, error, moved.token, new_head), removed
    if end is None:
        ring_idx = idx if head is None else idx + [head]
        storage, removed, tok = P.bind_pop(
            b.storage, b.token, ring_idx, axis, fill, read=read
        )
        return b._replace(storage=storage, error=error, token=tok), removed
    # A ring: a pop at the front takes the element at the head, writes `fill`
    # there (now the logical end) and moves the head on; one at the back takes
    # the last element and writes `fill` in its place.
    col = h if end == "front" else _wrap(h + (cap - 1), cap)
    starts, sizes = _element_window(b, idx, col)
    fills = jnp.full(sizes, fill, b.storage.dtype)
    storage, removed, tok = P.bind_swap(b.storage, b.token, fills, starts, read=read)
    removed = (
        removed.reshape(shape[axis + 1 :])
        if read
        else jnp.zeros(shape[axis + 1 :], b.storage.dtype)
    )
    new_head = _wrap(h + 1, cap) if end == "front" else None
    return _moved(b, storage, error, tok, new_head), removed


def check_fill(fill: Any, dtype: Any) -> Any:
    """`fill` as a Python scalar the buffer's `dtype` can hold."""
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
    if (
        jnp.issubdtype(dtype, jnp.integer)
        and not isinstance(fill, bool)
        and _outside(fill, dtype) is not None
    ):
        # (Else it wrapped, or NumPy refused it deep in the lowering.)
        info = jnp.iinfo(dtype)
        raise OverflowError(
            f"`fill`={fill!r} is out of range for the buffer's dtype "
            f"{jnp.dtype(dtype)}: its values are {info.min} to {info.max}."
        )
    return fill
