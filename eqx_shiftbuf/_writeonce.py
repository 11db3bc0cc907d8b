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
CHECKING = 2  # the checked mode's count and phase: zero (off) while steps are rerun
TAPED = 3  # a buffer only edited: never stored, its reads replayed in reruns (`_tape`)

# Phases of the checked mode (`_Writes.phase`). `esb.scan(check=True)` runs its
# steps in RECORD, then once more in REPLAY (see `WriteOnceBuffer`); the reverse
# pass reruns them in OFF (its CHECKING leaves are zeros).
OFF, RECORD, REPLAY = 0, 1, 2
_NEVER = -1  # `_Writes.when` of an element no write wrote


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


class _Writes(eqx.Module):
    """The checked mode's record of a `WriteOnceBuffer`'s writes.

    - `when`: an int32 per element, the `count` of the write that wrote it, or
      `_NEVER`. RECORD writes it.
    - `final`: the whole run's `when`, which REPLAY checks reads against. Only
      read, so never copied: were it `when` itself, a read of it early in a step
      and its write later (which REPLAY still makes, keeping the window as it is)
      would not be ordered by data, and XLA would copy it every step.
    - `count`: how many writes (calls, whatever their `pred`) the buffer has had in
      this run of the steps. REPLAY makes the same writes in the same order as the
      run it replays (up to the first read it raises on), so at each point its
      `count` is the run's: an element with `final >= count` is written after that
      point.
    - `phase`: OFF, RECORD or REPLAY.
    """

    when: Array
    final: Array
    count: Array
    phase: Array


class WriteOnceBuffer(eqx.Module):
    """A carry leaf declared in `esb.scan(..., buffers=...)`, as the body sees it.

    Each position is meant to be written at most once, and read only after it is
    written (or never written): then the checkpointed reverse pass need not store
    the buffer at checkpoints, and reruns steps against its final value, as
    `equinox.internal.scan` does. Unlike Equinox, writes and reads are the
    in-place primitives of this library, so the gradient with respect to the
    initial contents is exact (zero where written) and a read costs O(window) in the
    reverse pass.

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

    **Checked mode** (`esb.scan(..., check=True)`). Two errors are raised, through
    `equinox.error_if`, when the program runs:

    - *A second write*: a write to an element that an earlier write already wrote
      (elements where `pred` is false are not written). Raised during the scan.
    - *A read before write*: a read of an element that a later write writes, later
      in the same step or in a later step. A rerun step of the reverse pass reads
      the final buffer, so it would see the written value instead of the one read,
      and the gradient would be silently wrong. Raised after the scan, before any
      of its results can be used.

    Reading an element that no write writes is allowed. Reads and writes count
    wherever they are in the step: inside `lax.cond` or `lax.switch`, a nested
    `lax.scan`, `lax.fori_loop` or `esb.scan`, `jax.checkpoint`, under `jax.vmap`.
    The steps the reverse pass reruns check nothing.

    How: each write returns a new buffer, so the writes thread a record: the number
    of writes so far, and for each element the number of the write that wrote it.
    A read returns only its value, so it cannot record itself. Instead, after the
    scan, `esb.scan` runs the steps once more (without gradient) from the initial
    carry, with each buffer at its final contents and with the final record:
    what the reverse pass reruns steps against. The same writes come in the same
    order, so each read knows how many writes came before it, and raises if the
    record says an element of its window is written by a later one. A read whose
    value is never used is removed by XLA, and so is its check (it cannot change
    the gradient). Under `jax.vmap`, a `lax.cond` whose predicate is batched runs
    both branches, so an access in the branch not taken can raise (as any
    `equinox.error_if` there).

    The cost, only with `check=True`: two int32 arrays of the buffer's shape (the
    record, and the final record the rerun reads), a check per write and per read,
    and the second run of the steps. The buffer and the record stay in place.
    """

    _array: Array
    _writes: _Writes | None = None  # the checked mode's record; None: unchecked

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
        if self._writes is None:
            return [BUFFER]
        # _array, when, final, count, phase
        return [BUFFER, BUFFER, BUFFER, CHECKING, CHECKING]

    def _replaying(self) -> "WriteOnceBuffer":
        """This (final) buffer at the start of the checked mode's replay."""
        w = self._writes
        assert w is not None
        replay = _Writes(w.when, w.when, jnp.int32(0), jnp.int32(REPLAY))
        return WriteOnceBuffer(self._array, replay)

    def read(
        self,
        start_indices: Any = None,
        slice_sizes: Any = None,
        *,
        mode: str | None = None,
    ) -> tuple["WriteOnceBuffer", Array]:
        """Read a window (or, with no arguments, the contents): `(self, window)`.
        See [`eqx_shiftbuf.read`][]."""
        _ops.check_window_args(start_indices, slice_sizes)
        if start_indices is None:
            return self, self.array
        return self, self.dynamic_slice(start_indices, slice_sizes, mode=mode)

    def dynamic_slice(
        self, start_indices: Any, slice_sizes: Any, *, mode: str | None = None
    ) -> Array:
        """Read a window. See [`eqx_shiftbuf.dynamic_slice`][]."""
        b = _ops.array_leaves(self._array)
        out = _ops.read_window(b, start_indices, slice_sizes, mode)[1]
        w = self._writes
        if w is None:
            return out
        when = lax.dynamic_slice(w.final, _int32(start_indices), slice_sizes)
        bad = jnp.any(when >= w.count) & (w.phase == REPLAY)
        return eqx.error_if(
            out,
            bad,
            "esb.scan(buffers=..., check=True): a position read before it was "
            "written (by a later write in the same step, or a later step). The "
            "reverse pass would rerun the read against the final buffer.",
        )

    def dynamic_update_slice(
        self,
        update: ArrayLike,
        start_indices: Any,
        pred: Any = True,
        *,
        mode: str | None = None,
    ) -> "WriteOnceBuffer":
        """Overwrite a window (where `pred` holds). See
        [`eqx_shiftbuf.dynamic_update_slice`][]."""
        update = jnp.asarray(update, self.dtype)
        if pred is not True:
            # Equinox's `pred=`: write only where `pred` holds. Reading the window
            # first feeds the write of the same window, which stays in place.
            # A plain read: not one the checked mode records.
            b = _ops.array_leaves(self._array)
            old = _ops.read_window(b, start_indices, update.shape, mode)[1]
            update = jnp.where(pred, update, old)
        w = self._writes
        if w is not None:
            starts = _int32(start_indices)
            window = lax.dynamic_slice(w.when, starts, update.shape)
            mark = jnp.broadcast_to(jnp.asarray(pred, bool), update.shape)
            recording = w.phase == RECORD
            bad = jnp.any(mark & (window != _NEVER)) & recording
            window = jnp.where(mark & recording, w.count, window)
            # Raised on the record's new window, which then depends on the old one
            # (not only on `count`), so XLA writes the record in place.
            window = eqx.error_if(
                window,
                bad,
                "esb.scan(buffers=..., check=True): a second write to a buffer "
                "position.",
            )
            when = lax.dynamic_update_slice(w.when, window, starts)
            w = _Writes(when, w.final, w.count + 1, w.phase)
        b = _ops.array_leaves(self._array)
        array = _ops.update_window(b, update, start_indices, mode).storage
        return WriteOnceBuffer(array, w)

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
        when = jnp.full(arr.shape, _NEVER, jnp.int32)
        record = _Writes(when, when, jnp.int32(0), jnp.int32(RECORD))
        return WriteOnceBuffer(arr, record)
    return WriteOnceBuffer(arr)
