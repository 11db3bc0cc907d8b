"""`ShiftBuffer`: an array that is edited in place inside loops, under any transform."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from . import _ops


class ShiftBuffer(eqx.Module):
    """An array edited by windows and shifts, in place, under `grad`, `jvp` and `vmap`.

    A `ShiftBuffer` is a pytree (an `eqx.Module`): it can be a `lax.scan` carry, live
    inside a model, and cross `eqx.filter_jit`, `filter_grad` and `filter_vmap`. Its
    operations return new `ShiftBuffer`s; inside a loop, XLA updates the storage in
    place, in the forward pass and in the derivatives.

    Create one with [`eqx_shiftbuf.ShiftBuffer.zeros`][] or
    [`eqx_shiftbuf.ShiftBuffer.from_array`][]; `.array` is its contents.

    The storage layout is private. At present it is the logical array itself: each
    edit reads and writes one window or one line, in its own run-time loop (see
    `eqx_shiftbuf._primitives`), and needs no padding or scratch space.
    """

    _storage: Array
    axis: int = eqx.field(static=True)
    fill: bool | int | float = eqx.field(static=True, default=0)

    @classmethod
    def _from_storage(cls, storage: Any, axis: int, fill: Any) -> "ShiftBuffer":
        return cls(storage, axis, fill)

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
        return cls(arr, ax, fill)

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
        """The contents, an array of shape `self.shape`."""
        return self._storage

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
