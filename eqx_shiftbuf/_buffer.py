"""`ShiftBuffer`: an array that is edited in place inside loops, under any transform."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from . import _ops, _tokens


class ShiftBuffer(eqx.Module):
    """An array edited by windows and shifts, in place, under `grad`, `jvp` and `vmap`.

    A `ShiftBuffer` is a pytree (an `eqx.Module`): it can be a `lax.scan` carry, live
    inside a model, and cross `eqx.filter_jit`, `filter_grad` and `filter_vmap`. Its
    operations return new `ShiftBuffer`s; inside a loop, XLA updates the storage in
    place, in the forward pass and in the derivatives.

    Create one with [`eqx_shiftbuf.ShiftBuffer.zeros`][] or
    [`eqx_shiftbuf.ShiftBuffer.from_array`][]; `.array` is its contents.

    The storage layout is private. At present it is the logical array itself: each
    edit reads and writes one window or one line (see `eqx_shiftbuf._primitives`),
    and needs no padding or scratch space.

    **Index checks.** A traced index out of range in an edit (`insert`, `delete`,
    `dynamic_update_slice`) is not raised at the edit: the buffer records it, and
    the next read of the buffer (`.array`, `dynamic_slice`, `pop`) raises it,
    through `equinox.error_if`, with the message of the first bad edit. A branch per
    edit inside a loop costs as much as the edit itself on XLA:CPU; a recorded
    error costs one scalar `select`. Whatever a bad edit did is never seen: every
    way to see the contents raises first. The record is the scalar leaf `_error`
    of the pytree (0: no error). It is a float32, not an integer, so that
    `jax.grad` and `jax.jvp` accept a `ShiftBuffer` argument as they accept an
    array (its gradient is always 0). It codes the edit, the index entry and, for
    `dynamic_update_slice`, the update's size there; the read rebuilds the message
    from it and the buffer's shape, so the message is the same whichever function
    traced the edit or the read, and in whatever order. (An update too large for
    the code to hold exactly, over about 2**24 / (3 * ndim) along that dimension,
    is named without the bound.)
    """

    _storage: Array
    axis: int = eqx.field(static=True)
    fill: bool | int | float = eqx.field(static=True, default=0)
    # The deferred index error: 0, or the code of the first bad edit (see
    # `_ops.deferred_code`), as a float32 scalar. None: check every call at once
    # (the buffers that `esb.scan` hands to a body for `buffers=`, which have
    # nowhere to keep it).
    _error: Array | None = None

    @classmethod
    def _from_storage(
        cls, storage: Any, axis: int, fill: Any, error: Any = None
    ) -> "ShiftBuffer":
        return cls(storage, axis, fill, error)

    @classmethod
    def from_array(
        cls, array: ArrayLike, *, axis: int = -1, fill: bool | int | float = 0
    ) -> "ShiftBuffer":
        """A buffer holding `array`, shifted along `axis`.

        **Arguments:**

        - `array`: the initial contents, at least 1-D.
        - `axis`: the shift axis of `insert`/`delete`/`pop`. Dimensions before it
          select a line; dimensions after it are the shape of one element (a feature
          vector, say).
        - `fill`: what `delete`/`pop` shift in at the end of a line.

        **Returns:**

        The `ShiftBuffer`.
        """
        arr = jnp.asarray(array)
        if arr.ndim == 0:
            raise ValueError("`array` must have at least one dimension; got a scalar.")
        ax = _ops.normalise_axis(axis, arr.ndim)
        fill = _ops._check_fill(fill, arr.dtype)
        return cls(arr, ax, fill, jnp.zeros((), jnp.float32))

    @classmethod
    def zeros(
        cls,
        shape: Sequence[int],
        dtype: Any = jnp.float32,
        *,
        axis: int = -1,
        fill: bool | int | float = 0,
    ) -> "ShiftBuffer":
        """A buffer of zeros of logical shape `shape`.

        **Arguments:**

        - `shape`: the logical shape, at least 1-D.
        - `dtype`: any JAX dtype; integer and bool buffers work but are not
          differentiable.
        - `axis`, `fill`: as for [`eqx_shiftbuf.ShiftBuffer.from_array`][].

        **Returns:**

        The `ShiftBuffer`.
        """
        return cls.from_array(jnp.zeros(tuple(shape), dtype), axis=axis, fill=fill)

    # -- the logical view

    @property
    def array(self) -> Array:
        """The contents, an array of shape `self.shape`.

        Raises (through `equinox.error_if`) if an earlier edit had a traced index out
        of range.
        """
        storage = _ops.raise_deferred(self._storage, self._error)
        if storage is not self._storage and _tokens.same_trace(storage, self._storage):
            # The checked storage replaces the old one in this buffer too, as a read
            # does (`_ops.dynamic_slice`): the check writes it in place, so a later
            # edit of the old value would copy it.
            object.__setattr__(self, "_storage", storage)
        return storage

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._storage.shape)

    @property
    def dtype(self) -> Any:
        return self._storage.dtype

    @property
    def ndim(self) -> int:
        return self._storage.ndim

    @property
    def capacity(self) -> int:
        """The length of a line along the shift axis."""
        return self._storage.shape[self.axis]

    # -- operations

    def dynamic_slice(
        self,
        start_indices: Sequence[_ops.Index],
        slice_sizes: Sequence[int],
        *,
        mode: str | None = None,
    ) -> Array:
        """Read a window: `lax.dynamic_slice(self.array, start_indices, slice_sizes)`.

        See [`eqx_shiftbuf.dynamic_slice`][].
        """
        return _ops.dynamic_slice(self, start_indices, slice_sizes, mode=mode)

    def dynamic_update_slice(
        self,
        update: ArrayLike,
        start_indices: Sequence[_ops.Index],
        *,
        mode: str | None = None,
    ) -> "ShiftBuffer":
        """Overwrite a window. See [`eqx_shiftbuf.dynamic_update_slice`][]."""
        return _ops.dynamic_update_slice(self, update, start_indices, mode=mode)

    def insert(
        self, index: _ops.IndexTuple, value: ArrayLike, *, mode: str | None = None
    ) -> "ShiftBuffer":
        """Insert `value` at `index`, shifting right. See [`eqx_shiftbuf.insert`][]."""
        return _ops.insert(self, index, value, mode=mode)

    def delete(
        self, index: _ops.IndexTuple, *, mode: str | None = None
    ) -> "ShiftBuffer":
        """Remove the element at `index`, shifting left. See [`eqx_shiftbuf.delete`][]."""
        return _ops.delete(self, index, mode=mode)

    def pop(
        self, index: _ops.IndexTuple, *, mode: str | None = None
    ) -> tuple["ShiftBuffer", Array]:
        """Remove and return the element at `index`. See [`eqx_shiftbuf.pop`][]."""
        return _ops.pop(self, index, mode=mode)
