"""`WriteOnceBuffer`: what a scan body sees for a carry leaf named in `buffers=`."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike

from . import _ops
from ._buffer import ShiftBuffer


# Roles of a carry's flat leaves in `esb.scan(kind="checkpointed")` (see `_scan`):
NORMAL = 0  # stored at checkpoints, reloaded when steps are rerun
BUFFER = 1  # never stored: a rerun step sees the buffer's final value
CHECKING = 2  # the checked mode's switch: off while steps are rerun

_UNTOUCHED, _READ, _WRITTEN = 0, 1, 2


def _index_tuple(index: Any, ndim: int) -> tuple:
    if not isinstance(index, tuple):
        index = (index,)
    if index and index[-1] is Ellipsis:
        index = index[:-1]
    if not 1 <= len(index) <= ndim:
        raise TypeError(
            f"A write-once buffer of rank {ndim} is indexed by 1 to {ndim} integer "
            f"scalars (leading dimensions); got {index!r}."
        )
    for i in index:
        if isinstance(i, (slice, type(Ellipsis))) or i is None or jnp.ndim(i) != 0:
            raise TypeError(
                "A write-once buffer is indexed by integer scalars, one per leading "
                f"dimension (a trailing `...` is allowed); got {index!r}."
            )
    return index


class WriteOnceBuffer(eqx.Module):
    """A carry leaf declared in `esb.scan(..., buffers=...)`, as the body sees it.

    Each position is meant to be written at most once, and read only after it is
    written (or never written): then the checkpointed reverse pass need not store
    the buffer at checkpoints, and reruns steps against its final value, as
    `equinox.internal.scan` does. Unlike Equinox, writes and reads are the
    in-place primitives of this library, so the gradient with respect to the
    initial contents is exact (zero where written) and a read costs O(window) in the
    reverse pass; `check=True` in `esb.scan` makes a second write to a position, or
    a write to a position whose initial contents were read, an error through
    `equinox.error_if`.

    Why writes keep their exact transpose: Equinox's write transposes to "read the
    window's cotangent" and skips zeroing it, which is what makes its gradient with
    respect to the initial contents wrong (a full-size mask pass at the end would
    fix that). Here a write is `esb.dynamic_update_slice`, whose transpose also
    zeroes the window: one more in-place window write per reversed step, no mask,
    and an exact gradient whatever was written twice without a read in between.

    Reads: `buf[i]` / `buf[i, j]` (leading-dimension integer scalars), or
    `esb.dynamic_slice(buf, ...)`. Writes: `buf.at[i].set(value, pred=True)` or
    `esb.dynamic_update_slice(buf, ...)`; each returns a new buffer, to be returned
    in the carry. Indices are checked at each call (`mode="promise_in_bounds"`
    skips that).
    """

    _array: Array
    _written: Array | None = None
    _checking: Array | None = None

    @property
    def array(self) -> Array:
        """The contents."""
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def dtype(self) -> Any:
        return self._array.dtype

    @property
    def ndim(self) -> int:
        return self._array.ndim

    def __len__(self) -> int:
        return self.shape[0]

    def _roles(self) -> list[int]:
        roles = [BUFFER]
        if self._written is not None:
            roles += [BUFFER, CHECKING]
        return roles

    # The checked mode's mask: per position, UNTOUCHED, READ (its initial contents
    # were read) or WRITTEN. A write must find its window UNTOUCHED: WRITTEN is a
    # second write, READ a read before write (the reverse pass would rerun that read
    # against the final buffer).

    def _mask_window(self, starts: Any, sizes: Any) -> Array:
        assert self._written is not None
        return lax.dynamic_slice(self._written, _int32(starts), sizes)

    def dynamic_slice(self, start_indices: Any, slice_sizes: Any, **kwargs) -> Array:
        """Read a window. See [`eqx_shiftbuf.dynamic_slice`][]."""
        out = _ops.dynamic_slice(self._array, start_indices, slice_sizes, **kwargs)
        if self._written is not None:
            window = self._mask_window(start_indices, slice_sizes)
            window = jnp.where(window == _UNTOUCHED, _READ, window)
            # A read returns only the window, so the mask update is threaded through
            # this object.
            new = lax.dynamic_update_slice(self._written, window, _int32(start_indices))
            object.__setattr__(self, "_written", new)
        return out

    def dynamic_update_slice(
        self, update: ArrayLike, start_indices: Any, pred: Any = True, **kwargs
    ) -> "WriteOnceBuffer":
        """Overwrite a window (where `pred` holds). See
        [`eqx_shiftbuf.dynamic_update_slice`][]."""
        update = jnp.asarray(update, self.dtype)
        if pred is not True:
            # Equinox's `pred=`: write only where `pred` holds. Reading the window
            # first feeds the write of the same window, which stays in place.
            old = _ops.dynamic_slice(self._array, start_indices, update.shape, **kwargs)
            update = jnp.where(pred, update, old)
        written = self._written
        if written is not None:
            assert self._checking is not None
            window = self._mask_window(start_indices, update.shape)
            mark = jnp.broadcast_to(jnp.asarray(pred, bool), update.shape)
            for state, what in (
                (_WRITTEN, "a second write to a buffer position"),
                (_READ, "a write to a position read before it was written"),
            ):
                bad = jnp.any(mark & (window == state)) & self._checking
                update = eqx.error_if(
                    update, bad, f"esb.scan(buffers=..., check=True): {what}."
                )
            window = jnp.where(mark, _WRITTEN, window)
            written = lax.dynamic_update_slice(written, window, _int32(start_indices))
        array = _ops.dynamic_update_slice(self._array, update, start_indices, **kwargs)
        return WriteOnceBuffer(array, written, self._checking)

    def __getitem__(self, index: Any) -> Array:
        index = _index_tuple(index, self.ndim)
        starts = list(index) + [0] * (self.ndim - len(index))
        sizes = [1] * len(index) + list(self.shape[len(index) :])
        return self.dynamic_slice(starts, sizes).reshape(sizes[len(index) :])

    @property
    def at(self) -> "_At":
        return _At(self)

    def _set(self, index: Any, value: ArrayLike, pred: Any) -> "WriteOnceBuffer":
        index = _index_tuple(index, self.ndim)
        window = self.shape[len(index) :]
        value = jnp.broadcast_to(jnp.asarray(value, self.dtype), window)
        starts = list(index) + [0] * (self.ndim - len(index))
        update = value.reshape((1,) * len(index) + tuple(window))
        return self.dynamic_update_slice(update, starts, pred)


def _int32(starts: Any) -> list:
    return [jnp.asarray(s, jnp.int32) for s in starts]


class _At(eqx.Module):
    _b: WriteOnceBuffer

    def __getitem__(self, index: Any) -> "_AtIndex":
        return _AtIndex(self._b, index)


class _AtIndex:
    def __init__(self, b: WriteOnceBuffer, index: Any):
        self._b = b
        self._index = index

    def set(self, value: ArrayLike, *, pred: Any = True) -> WriteOnceBuffer:
        """Write `value` at the index; where `pred` is false, keep the old value."""
        return self._b._set(self._index, value, pred)

    def get(self) -> Array:
        return self._b[self._index]


def wrap(x: Any, check: bool) -> WriteOnceBuffer:
    if isinstance(x, WriteOnceBuffer):
        # An outer scan's buffer handed to an inner scan (the diffrax pattern: an
        # inner loop writing into an outer buffer) stays what it is.
        return x
    if isinstance(x, ShiftBuffer):
        raise TypeError(
            "esb.scan: `buffers=` names write-once arrays; a ShiftBuffer is edited "
            "in place and overwritten, so leave it out of `buffers` (it is then "
            "stored at checkpoints like any carry)."
        )
    arr = jnp.asarray(x)
    if arr.ndim == 0:
        raise ValueError(
            "esb.scan: a leaf named in `buffers=` must be an array with at least one "
            f"dimension; got a scalar of dtype {arr.dtype}."
        )
    if check:
        return WriteOnceBuffer(arr, jnp.zeros(arr.shape, jnp.int8), jnp.asarray(True))
    return WriteOnceBuffer(arr)
