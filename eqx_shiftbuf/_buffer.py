"""`ShiftBuffer`: an array that is edited in place inside loops, under any transform."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike

from . import _ops
from ._primitives import new_token


class ShiftBuffer(eqx.Module):
    """An array edited by windows and shifts, in place, under `grad`, `jvp` and `vmap`.

    A `ShiftBuffer` is a pytree (an `eqx.Module`): it can be a `lax.scan` carry, live
    inside a model, and cross `eqx.filter_jit`, `filter_grad` and `filter_vmap`. Its
    operations return new `ShiftBuffer`s; inside a loop, XLA updates the storage in
    place, in the forward pass and in the derivatives.

    Create one with `ShiftBuffer(array, axis=-1, fill=0)`,
    [`eqx_shiftbuf.ShiftBuffer.zeros`][] or
    [`eqx_shiftbuf.ShiftBuffer.from_array`][] (all three build the same pytree);
    `.array` is its contents.

    **Reading inside a loop.** Nothing mutates a buffer: like an
    `equinox.nn.State`, an operation returns the buffer to carry on with. A read
    comes in two forms. `buf.dynamic_slice(...)` and `buf.array` return only the
    values; `buf, window = buf.read(start_indices, slice_sizes)` and
    `buf, contents = buf.read()` also return the buffer, whose token (a scalar
    leaf, `_token`) makes the next edit wait for the read. Inside a loop use
    `read`: after `dynamic_slice`, an edit that does not use the values read, or
    returning the buffer from the step, copies the whole buffer every step.

    **In a model.** A `ShiftBuffer` field of a model is an inexact-array leaf:
    `eqx.filter_grad` differentiates it and an optax step changes its contents.
    Keep buffers out of the parameters: in an `eqx.nn.State` (the initial value of
    an `eqx.nn.StateIndex`), made inside the call, or partitioned out, e.g.
    `eqx.partition(model, lambda x: eqx.is_inexact_array(x) and not
    isinstance(x, ShiftBuffer), is_leaf=lambda x: isinstance(x, ShiftBuffer))`.
    See the documentation's "Buffers in models".

    **Gradients with respect to a buffer.** `jax.grad(loss)(buf)` is a pytree of
    `buf`'s structure, its storage's gradient laid out as `buf`'s storage is: add
    it to `buf` leaf by leaf. For the gradient with respect to the contents, use
    `buf.gradient_array(grad)`, not `grad.array`, which is rotated where an edit
    moved a ring's head; and build a tangent of `buf` with `buf.tangent_of(t)`.

    **A batch of buffers** (`jax.vmap(ShiftBuffer.from_array)(arrays)`,
    `eqx.filter_vmap`, or what a vmapped edit returns) is the same pytree with a
    leading batch axis on every leaf: `.batch_shape` is that shape, `.array` and
    `.shape` include it, and edits and window reads apply under `jax.vmap`.

    The storage layout is private. A buffer of one line (every dimension before
    `axis` of length 1: a 1-D buffer, a delay line or stack `(K, D)` shifted along
    axis 0, a `(1, n)` row) is stored as a ring: its line, rotated by a head kept
    beside it. Any other buffer is stored as the logical array. Each edit reads
    and writes one window or one line (see `eqx_shiftbuf._primitives`), and needs
    no padding or scratch space.

    **Costs.** A window access costs O(window); a shift (`insert`, `delete`,
    `pop`) costs O(line), except at either end of a ring: `insert(0, x)`,
    `pop(0)`, `delete(0)`, and the same at `capacity - 1`, with that position a
    Python or NumPy int, move the head and one element, O(element), so a delay
    line or a stack costs the same per step whatever its capacity. At another
    Python-int position `p`, the elements between `p` and the nearer end move,
    O(min(p, capacity - p)), where that is cheaper than the whole line (up to
    about a sixth of a 1-D line, half a line of frames). With a traced index, or
    farther in, the line shifts, rotated. (Reading the whole ring,
    `.array` or `read()`, rotates it: O(line), as the read itself. In a loop, a
    ring that only window writes edit, such as a cache written at a moving
    position, keeps its head at 0, and the compiled loop reads it without
    rotating.)

    **Choosing an edit at run time.** Do not choose between edits of the buffer
    with `lax.cond` (or `jnp.where` between two edited buffers): XLA copies a
    conditional's buffer operand every step (jax#38145), and under `vmap` a `cond`
    becomes both branches and a `select` of two whole buffers (a stack's push or
    pop chosen by `lax.cond`: 3 copies per step forward, 6 under `grad`). Apply
    every edit every step and choose with `jnp.where` on indices and values
    instead: keep a spare line, send the edit not chosen there, and select the
    output, e.g. for a push or a pop on stack `r` of a buffer with a spare stack
    `s` (0 copies in every mode):

    ```python
    buf = buf.insert((jnp.where(push, r, s), 0), value)
    buf, top = buf.pop((jnp.where(push, s, r), 0))
    out = jnp.where(push, 0.0, top)
    ```

    **Index checks.** A traced index out of range in an edit (`insert`, `delete`,
    `dynamic_update_slice`) is not raised at the edit: the buffer records it, and
    the next read of the buffer (`.array`, `dynamic_slice`, `pop`) raises it,
    through `equinox.error_if`, with the message of the first bad edit. A branch per
    edit inside a loop costs as much as the edit itself on XLA:CPU; a recorded
    error costs one scalar `select`. Whatever a bad edit did is never seen: every
    way to see the contents raises first. The record is the scalar leaf `_error`
    of the pytree (0: no error). It and the token are float32, not integers, so
    that `jax.grad` and `jax.jvp` accept a `ShiftBuffer` argument as they accept an
    array (their gradients are always 0). It codes the edit, the index entry and, for
    `dynamic_update_slice`, the update's size there; the read rebuilds the message
    from it and the buffer's shape, so the message is the same whichever function
    traced the edit or the read, and in whatever order. (An update too large for
    the code to hold exactly, over about 2**24 / (3 * ndim) along that dimension,
    is named without the bound.)
    """

    _storage: Array
    axis: int = eqx.field(static=True)
    fill: bool | int | float = eqx.field(static=True)
    # The deferred index error: 0, or the code of the first bad edit's message (see
    # `_ops.deferred_code`), as a float32 scalar (one per buffer in a batch).
    _error: Array | np.ndarray
    # The token of the last access (see `_primitives`, "Binding helpers"): a float32
    # run-time zero that the next access waits for (one per buffer in a batch).
    _token: Array
    # Where logical position 0 of the line is stored, for a buffer stored as a ring
    # (one line: see `_ops.is_ring`), as a float32 scalar like the token (one per
    # buffer in a batch); 0 otherwise, and until an edit moves it.
    _head: Array | np.ndarray

    def __init__(self, array: ArrayLike, axis: int = -1, fill: bool | int | float = 0):
        """**Arguments:**

        - `array`: the initial contents, at least 1-D.
        - `axis`: the shift axis of `insert`/`delete`/`pop`. Dimensions before it
          select a line; dimensions after it are the shape of one element (a feature
          vector, say).
        - `fill`: what `delete`/`pop` shift in at the end of a line.
        """
        arr = jnp.asarray(array)
        if arr.ndim == 0:
            raise ValueError("`array` must have at least one dimension; got a scalar.")
        self._storage = arr
        self.axis = _ops.normalise_axis(axis, arr.ndim)
        self.fill = _ops.check_fill(fill, arr.dtype)
        # Under `jax.vmap` or inside a `shard_map`, the record and token are made
        # from the storage (`_ops.zero_from`), so that they are batched, sharded
        # and varying as it is. Otherwise the record is a NumPy zero, not
        # `jnp.zeros`: inside `jit` that would be a tracer, and a read could not
        # tell that no edit ever recorded an error. `lax.scan` returns a carry
        # that its body passes through unchanged as the very object it was given,
        # so after edits that record nothing (`promise_in_bounds`) the record is
        # still this constant, and `.array` adds no check (a conditional and the
        # record's scalar work in the compiled program).
        zero = _ops.zero_from(arr)
        self._error = zero if zero is not None else np.zeros((), np.float32)
        self._token = zero if zero is not None else new_token()
        # A NumPy zero, as the record: an operation sees at trace time that the
        # line is not rotated, and reads and writes it as it is.
        self._head = zero if zero is not None else np.zeros((), np.float32)

    def _replace(
        self, storage: Any, error: Any, token: Any, head: Any = None
    ) -> "ShiftBuffer":
        """This buffer with new leaves (same axis and fill; the same head if `head`
        is None): what an operation returns. Built by unflattening, so `__init__`'s
        conversions do not run."""
        head = self._head if head is None else head
        leaves = [storage, error, token, head]
        return jtu.tree_unflatten(jtu.tree_structure(self), leaves)

    def _ring(self) -> _ops.Ring | None:
        """How the storage holds the line, if it is a ring (`_ops.is_ring`)."""
        logical_shape = self._storage.shape[len(self.batch_shape) :]
        if not _ops.is_ring(logical_shape, self.axis):
            return None
        return _ops.Ring(self._head, self.axis)

    @classmethod
    def from_array(
        cls, array: ArrayLike, *, axis: int = -1, fill: bool | int | float = 0
    ) -> "ShiftBuffer":
        """A buffer holding `array`, shifted along `axis`: `ShiftBuffer(array, axis,
        fill)`.

        **Arguments:**

        - `array`: the initial contents, at least 1-D.
        - `axis`: the shift axis of `insert`/`delete`/`pop`. Dimensions before it
          select a line; dimensions after it are the shape of one element (a feature
          vector, say).
        - `fill`: what `delete`/`pop` shift in at the end of a line.

        **Returns:**

        The `ShiftBuffer`.
        """
        return cls(array, axis, fill)

    @classmethod
    def zeros(
        cls,
        shape: int | Sequence[int],
        dtype: Any = jnp.float32,
        *,
        axis: int = -1,
        fill: bool | int | float = 0,
    ) -> "ShiftBuffer":
        """A buffer of zeros of logical shape `shape`.

        **Arguments:**

        - `shape`: the logical shape, at least 1-D (an int `n` is `(n,)`, as for
          `jnp.zeros`).
        - `dtype`: any JAX dtype; integer and bool buffers work but are not
          differentiable.
        - `axis`, `fill`: as for [`eqx_shiftbuf.ShiftBuffer.from_array`][].

        **Returns:**

        The `ShiftBuffer`.
        """
        one = isinstance(shape, (int, np.integer)) and not isinstance(shape, bool)
        try:
            given = cast(Any, shape)
            dims = (int(given),) if one else tuple(int(n) for n in given)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`shape` must be an int or a sequence of ints; got {shape!r}."
            ) from e
        return cls(jnp.zeros(dims, dtype), axis, fill)

    # -- the logical view

    @property
    def array(self) -> Array:
        """The contents, an array of shape `self.shape`.

        Raises (through `equinox.error_if`) if an earlier edit had a traced index out
        of range. Inside a loop, read `.array` after the step's edits (in place, in
        every mode), or use `buf, contents = buf.read()`: the buffer it returns
        makes an edit after the read wait for it, which `buf.array` cannot. Of a
        buffer of one line (a ring), `.array` rotates the line, O(line): read a
        window with `read` where only a window is needed.
        """
        # `read()`'s contents, read through `read_p`, not the storage itself: under
        # `grad` JAX adds the contents' cotangent to the buffer's, and that add,
        # fused into the transpose of the step's edit, read the cotangent at
        # shifted positions and was written out of place (1 copy per step under
        # `grad` and `vmap(grad)` for `buf.array[:8]` after an insert). The read's
        # transpose accumulates it in place (`accum_p`, `_xla.fold_cotangent_sum`).
        return self.read()[1]

    def gradient_array(self, grad: "ShiftBuffer") -> Array:
        """The gradient with respect to this buffer's contents, `.array`, from its
        gradient with respect to the buffer itself.

        `jax.grad` (or `eqx.filter_grad`, `jax.vjp`) with respect to a
        `ShiftBuffer` returns a pytree of the same structure: the gradient of
        each leaf, the storage's laid out as this buffer's storage is, so that
        `jax.tree.map(lambda x, g: x - lr * g, buf, grad)` updates the contents
        it should. A buffer of one line is stored as a ring, rotated by its head;
        the gradient's head leaf is that head's gradient, 0, so where an edit
        moved this buffer's head (`insert(0, x)` of a delay line), `grad.array`
        is the gradient rotated. This unrotates it.

        **Arguments:**

        - `grad`: the gradient of a function with respect to this buffer, or a
          cotangent of it (a pytree of this buffer's structure and storage shape).

        **Returns:**

        An array of `self.shape`: the gradient with respect to `self.array`.
        """
        storage = jnp.asarray(grad._storage)
        if storage.shape != self._storage.shape:
            raise ValueError(
                f"`grad` must be a gradient of this buffer, with storage of shape "
                f"{self._storage.shape}; got shape {storage.shape}."
            )
        if self._ring() is None:
            return storage
        axis = self.axis

        def unrotated(s, head):
            return _ops.logical(s, _ops.Ring(head, axis))

        for _ in self.batch_shape:  # one head per buffer of a batch
            unrotated = jax.vmap(unrotated)
        return unrotated(storage, self._head)

    def tangent_of(self, array: ArrayLike) -> "ShiftBuffer":
        """A tangent of this buffer whose contents are `array`: the tangent to pass
        to `jax.jvp` for a `ShiftBuffer` primal, or the cotangent to pass to a
        `jax.vjp` function for a `ShiftBuffer` output. The inverse of
        [`eqx_shiftbuf.ShiftBuffer.gradient_array`][].

        A tangent must be laid out as the primal's storage is:
        `ShiftBuffer.from_array(array)` is not, for a ring whose head an edit moved.

        **Arguments:**

        - `array`: the tangent of the contents, of `self.shape`.

        **Returns:**

        A `ShiftBuffer` of this buffer's structure: `array` laid out as this
        buffer's storage, and zero tangents for its other leaves.
        """
        arr = jnp.asarray(array)
        if arr.shape != self._storage.shape:
            raise ValueError(
                f"`array` must have this buffer's shape {self._storage.shape}; got "
                f"shape {arr.shape}."
            )
        storage = arr
        if self._ring() is not None:
            axis, n = self.axis, self.capacity

            def rotated(x, head):
                shift = n - head.astype(jnp.int32)
                return _ops._rotate(x, jnp.where(shift == n, 0, shift), axis)

            for _ in self.batch_shape:  # one head per buffer of a batch
                rotated = jax.vmap(rotated)
            storage = rotated(arr, jnp.asarray(self._head))
        zero = lambda x: jnp.zeros(jnp.shape(x), jnp.float32)
        return self._replace(
            storage, zero(self._error), zero(self._token), zero(self._head)
        )

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """`()` for one buffer; the leading batch shape of a batch of buffers (what
        `jax.vmap(ShiftBuffer.from_array)(arrays)` or `eqx.filter_vmap` returns).

        `.array` and `.shape` of a batch include the batch dimensions; edits and
        window reads apply to one buffer, under `jax.vmap`.
        """
        return tuple(jnp.shape(self._error))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of `.array` (with the batch dimensions, for a batch)."""
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
        return self._storage.shape[len(self.batch_shape) + self.axis]

    # -- operations

    def _leaves(self, name: str) -> _ops.Leaves:
        """The array leaves an operation named `name` takes; refuses a batch."""
        if self.batch_shape:
            raise TypeError(
                f"esb.{name}: this ShiftBuffer is a batch of buffers (batch shape "
                f"{self.batch_shape}, as `jax.vmap` or `eqx.filter_vmap` returns it), "
                f"and esb.{name} edits or reads one buffer at indices for one buffer. "
                f"Apply it under `jax.vmap` (or `eqx.filter_vmap`) over the batch, "
                f"e.g. `jax.vmap(lambda b, i: ...)(buffers, indices)`. `.array` and "
                "`.shape` work on the whole batch."
            )
        return _ops.Leaves(self._storage, self._error, self._token, self._ring())

    def _with(self, b: _ops.Leaves) -> "ShiftBuffer":
        head = None if b.ring is None else b.ring.head
        return self._replace(b.storage, b.error, b.token, head)

    def read(
        self,
        start_indices: Sequence[_ops.Index] | None = None,
        slice_sizes: Sequence[int] | None = None,
        *,
        mode: str | None = None,
    ) -> tuple["ShiftBuffer", Array]:
        """Read a window (or, with no arguments, the whole contents) and return the
        buffer to carry on with: `(buffer, window)`. See [`eqx_shiftbuf.read`][]."""
        _ops.check_window_args(start_indices, slice_sizes)
        if start_indices is None:
            if mode not in _ops.MODES:
                raise ValueError(
                    f"`mode` must be None or 'promise_in_bounds'; got {mode!r}."
                )
            # With `promise_in_bounds`, as for a window read, no recorded error is
            # raised: inside a loop the record is a traced carry, and its check a
            # conditional at every step.
            if mode is None:
                storage = _ops.raise_deferred(
                    self._storage, self._error, self.batch_shape
                )
            else:
                storage = self._storage
            if self.batch_shape or self.ndim == 0:
                contents = _ops.logical(storage, self._ring(), self.batch_shape)
                return self._replace(storage, self._error, self._token), contents
            # The whole buffer, through `read_p` (its recorded error was raised
            # just above): the next edit waits for the read through the token, and
            # under `grad` the contents' cotangent is accumulated into the
            # buffer's by `accum_p`, in place, not by an add that XLA fuses into
            # the next read and then writes out of place (1 copy per step).
            b = _ops.Leaves(storage, self._error, self._token, self._ring())
            zeros = (0,) * self.ndim
            b, contents = _ops.read_window(b, zeros, self.shape, "promise_in_bounds")
            return self._with(b), contents
        b, window = _ops.read_window(
            self._leaves("read"), start_indices, slice_sizes, mode
        )
        return self._with(b), window

    def dynamic_slice(
        self,
        start_indices: Sequence[_ops.Index],
        slice_sizes: Sequence[int],
        *,
        mode: str | None = None,
    ) -> Array:
        """Read a window: `lax.dynamic_slice(self.array, start_indices, slice_sizes)`.
        Inside a loop, prefer `read`. See [`eqx_shiftbuf.dynamic_slice`][].
        """
        b = self._leaves("dynamic_slice")
        return _ops.read_window(b, start_indices, slice_sizes, mode)[1]

    def dynamic_update_slice(
        self,
        update: ArrayLike,
        start_indices: Sequence[_ops.Index],
        *,
        mode: str | None = None,
    ) -> "ShiftBuffer":
        """Overwrite a window. See [`eqx_shiftbuf.dynamic_update_slice`][]."""
        b = self._leaves("dynamic_update_slice")
        return self._with(_ops.update_window(b, update, start_indices, mode))

    def insert(
        self, index: _ops.IndexTuple, value: ArrayLike, *, mode: str | None = None
    ) -> "ShiftBuffer":
        """Insert `value` at `index`, shifting right. See [`eqx_shiftbuf.insert`][]."""
        b = _ops.insert_at(self._leaves("insert"), index, value, self.axis, mode)
        return self._with(b)

    def delete(
        self,
        index: _ops.IndexTuple,
        *,
        fill: bool | int | float | None = None,
        mode: str | None = None,
    ) -> "ShiftBuffer":
        """Remove the element at `index`, shifting left; `fill` (default: the
        buffer's) enters at the end. See [`eqx_shiftbuf.delete`][]."""
        fill = self.fill if fill is None else fill
        b = self._leaves("delete")
        return self._with(_ops.pop_at(b, index, self.axis, fill, mode, read=False)[0])

    def pop(
        self,
        index: _ops.IndexTuple,
        *,
        fill: bool | int | float | None = None,
        mode: str | None = None,
    ) -> tuple["ShiftBuffer", Array]:
        """Remove and return the element at `index`; `fill` (default: the buffer's)
        enters at the end. See [`eqx_shiftbuf.pop`][]."""
        fill = self.fill if fill is None else fill
        b, removed = _ops.pop_at(
            self._leaves("pop"), index, self.axis, fill, mode, read=True
        )
        return self._with(b), removed
