"""The buffer primitives.

Five primitives touch a buffer's storage. Each is linear in its array operands, and
they come in transpose pairs, so reverse mode never leaves the family:

| primitive  | does                                             | transpose   |
|------------|--------------------------------------------------|-------------|
| `read_p`   | `window = storage[start:start+size]`             | `accum_p`   |
| `accum_p`  | `storage[start:start+size] += window`            | `read_p`    |
| `swap_p`   | `old = storage[win]; storage[win] = update`      | `swap_p`    |
| `insert_p` | shift a line right from `col`, write the value   | `pop_p`     |
| `pop_p`    | remove `line[col]`, shift left, fill the end     | `insert_p`  |

A ring (`_ops.Ring`: a buffer of one line, stored rotated by a head) passes its
head to `insert_p` and `pop_p` as one more index operand, and they shift the line
rotated. A sixth primitive, `rotate_p`, touches no storage: it rotates a value (a
ring's whole line as read, or an update of a whole line), and its transpose is the
rotation back. A seventh, `after_p`, makes a token that waits for such a rotation
read, for the next edit to wait for it too.

**Which accesses are loops.** XLA updates a loop-carried buffer in place only when
every other reader of the old buffer is ordered before the write *by data
dependence*; it duplicates cheap reads into their consumers, fuses a read with the
write before it into a read of the older buffer, and hoists reads out of loops. A
`while` loop whose trip count is 1 at run time but not provable at compile time (a
static trip count of 1 is simplified away) is a wall none of that crosses, but on
XLA:CPU each one costs about as much as a small edit. The tricks used against these
behaviours are in `_xla.py`, each with the test that pins it. So:

- *Reads* (`read_p`, and the read half of `pop_p` and of `swap_p` when it returns
  the old window) produce one materialised value. `read_p` returns a *token* (a
  float32 zero that XLA cannot prove is zero, computed from that value) that the
  next access adds to one of its indices, so that access depends on the read (see
  "Binding helpers" for how tokens are threaded, through values only). Unbatched,
  the value is a reduction: a masked `max` over the window and its neighbour along
  a dimension it is 1 wide in, or, where it has none, with the window one
  further along a dimension it is narrower than the buffer in
  (`window_by_reduce`; a pop reduces its line and its neighbour,
  `window2_edit`), which XLA materialises once instead of duplicating it into
  its consumers. Otherwise (batched, complex, or a window of the whole buffer)
  the reads run in their own loop, except a read of the whole buffer, or under
  `vmap` of each batch element's whole buffer, which is the storage itself. Under
  `vmap`, a read or overwrite whose indices the batch shares (a Python int, a tap
  at a static offset from a head the batch shares) is one unbatched access of a
  window spanning the batch dimension (`_across_the_batch`), as plain `lax`
  writes it; an accumulation (a read's transpose) stays one per element.
  An unbatched read that would be a reduction, of a common dtype, is lowered
  first as a plain slice (`_xla.deferred_read`) and materialised by the lowering
  of the next access that may follow it (`_xla.materialise_deferred_reads`): a
  read that no access follows (a delay line's taps after its write) stays a slice
  that XLA fuses into its consumers, as in plain `lax` code.
- *Writes* run straight-line, the same operations plain `lax` code would use, with
  the pending token added to an index they really use (`_free_dim`). A window of
  a ring that may wrap round the end of its storage (`swap_p`'s `ring`) is one
  scatter, and the old window it returns one gather.
- *Every unbatched write spans two elements of each dimension of the buffer that
  has two*: a shift reads and writes a *2-line window*, its line and a neighbour
  along each dimension before the line's that has two elements (`window2_edit`),
  and an accumulation or overwrite a window widened to 2 where it is 1 wide
  (`widened_write`), taking only its own elements from the new values (an
  overwrite of a buffer of 2 dimensions excepted: `_swap_impl`). XLA:CPU duplicates a write whose update has fewer non-unit dimensions
  than the buffer (it counts as "effectively unary") into the next read of the
  buffer, turning that read into a read of the older buffer, unordered with
  respect to the write: the write copies (three inserts in one step copied twice,
  as in plain `lax`; an accumulation followed by a pop, twice, in the `mixed`
  body's gradient). A widened write is not duplicated, so a read that follows a
  write in the same step needs no loop for that.
- A tangent or cotangent access takes the tangent or cotangent of the primal
  access's token, not the primal token: it orders a different buffer, and as an
  operand of the tangent access the primal token would be a residual saved every
  step.

Unbatched steps on buffers with at least two lines thus have no loop inside their
forward or backward pass.

**Why reads return the storage.** `read_p` returns the storage it read from, and the
caller uses that output afterwards (`esb.read` returns it in the buffer). In the
linearised program the storage tangent then has a single use, so the transpose
accumulates the window cotangent into the storage cotangent in place (`accum_p`),
instead of adding two full-size cotangents.

**Batching.** Every index operand has the same shape `S` (the "batch" shape, `()`
when unbatched); an operand holding values has shape `S + value_shape`. The loop runs
over the `prod(S)` elements in order, one window operation each, so `vmap` keeps the
batch inside one buffer instead of turning window ops into gather/scatter over the
whole buffer (which copies it: 2 copies forward, 4 under grad, for a vmapped
insert built from `custom_vjp`s). The batching rule moves the
storage's batch axis to the front and adds the batch position as a leading index.
An edit of one short line or window of each batch element (`vmap` of an edit of
each element's own buffer) is the exception: a shift gathers those lines and
scatters them back shifted (`_each_element`; not a ring's), a small batch of
buffers of one line each (rings too) is shifted as one `select` over the batch
(`_shift_each_line`), and a write scatters the windows (`_scattered`; a ring's
rows wrapping), all at once, as plain `lax` under `vmap`. Their JVPs and
transposes are still accesses of this family, so `grad` adds no scatter-add into
zeros. Small windows of a ring are one gather (`GATHER_RING_WINDOWS_UP_TO`);
larger ones that no edit follows, outside a derivative, one plain gather that XLA
fuses into its readers (`_deferrable_ring_batch`); other window reads (not of
each element's whole buffer, which is the storage itself) loop unless an edit
follows them (below).
Gathered with the token
taken from the windows, a read's window was computed twice, for its reader and
for its token (the natural rows `delay_taps` and `ring_taps` under `vmap`: 1.5-2.1x
slower). Gathered through a reduction as an unbatched read is (`window_by_reduce`
under `jax.vmap`, the token from its result), the window is computed once, and
still: XLA:CPU's gather computes and clamps an index for every element it reads,
where a loop trip's `dynamic_slice` clamps one start and copies rows. Measured in
one process against the loop, batch 4-8: the corpus's `slice_matmul_write` and
`mixed` 0.84-0.88x, but `ring_taps` (11 reads of 32 elements a step) 2.2-3.3x, 2x
plain `lax`, with the token or without it, and `read_old` 1.3-1.6x. Gathered with
`jax.vmap(lax.dynamic_slice)`, each window then materialised once and the token
taken from its first element, `ring_taps`' loop step has 23 kernels (96 and 11
loops of 3 with the loops), but its 11 gathers are ready at once, which XLA:CPU's
dataflow executor hands to its thread pool
(`benchmarks/experiments/thunk_threshold.py`): 1.68x plain `lax` (0.74 with the
loops); chained through the token (each gather's start waiting for the previous
read's token), 1.35x, and `delay_taps` 0.40x (0.13 with the loops);
`slice_matmul_write` 1.00x either way (1.26 with the loop), `read_old` 0.10-0.11x
(0.06). `benchmarks/vmap.py`, one run each. Gathered and deferred as an unbatched
read is (`_xla.deferred_read`: one gather of the storage, left plain where no edit
follows, materialised behind an `optimization_barrier` by the next edit), the
loop steps had plain `lax`'s kernels (`slice_matmul_write` 10 against 9,
`ring_taps` 11 against 11, no loop over the batch), but `ring_taps`' eleven
gathers fused into their readers were slower than its loops: in one process,
alternating the two versions three times, `slice_matmul_write` 1.26-1.30x ->
0.96-1.02x plain `lax`, `ring_taps` 0.49-0.78x -> 1.00-1.32x and its
`vmap(grad)` 0.09 -> 0.12x. Whether an edit follows a read is not known when it
is lowered, so a batched window read is lowered as its loop, marked
(`_xla.deferred_loop_read`), and an edit that follows it swaps the loop for one
gather behind an `optimization_barrier` (`_reduced_read`), which it waits for;
XLA drops the loop, now unused. `benchmarks/vmap.py`, one process, alternating
with the code before twice: `slice_matmul_write` 1.26-1.30x -> 1.03-1.04x plain
`lax`, `ring_taps` (no edit after its reads: loops) 0.59-0.74x either way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir import ir
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ._xla import (
    added_in_halves,
    added_in_halves_fused,
    after_marked_reads,
    aval_of,
    carrier,
    DEFERRABLE_DTYPES,
    deferred_loop_read,
    deferred_read,
    deferred_rotation,
    deferred_token,
    edits_of,
    explicit_sharding,
    finished_later,
    fold_cotangent_sum,
    from_carrier,
    in_branch,
    is_zeros,
    Kit,
    loop_not_unrolled,
    lowered_at,
    lowered_once_per_call,
    lowered_without_explicit_shardings,
    marked_edit,
    marked_onto_zeros,
    marked_onto_zeros_result,
    marked_read,
    materialise_deferred_reads,
    materialised,
    moved_as_bits,
    on_explicit_mesh,
    on_several_devices,
    opaque_zero,
    pick_by_max,
    rolled_in_branch,
    rotated_on_zeros,
    rotated_window,
    rotation_in_a_branch,
    rotation_key,
    run_time_indices,
    run_time_values,
    split_over_devices,
    to_carrier,
    tokens_per_element,
    tokens_reduced_locally,
    unpadded_window,
    user_reads_before,
    user_slices_materialised,
    varying_axes_of_aval,
    wait_at_hooks,
    waiting,
    widened_write,
    window2_edit,
    window_by_reduce,
    window_on_zeros,
)


# ---------------------------------------------------------------------------
# Helpers shared by the lowerings.


TOKEN_DTYPE = jnp.float32


def new_token() -> jax.Array:
    """A token that orders nothing: the constant zero."""
    return jnp.zeros((), TOKEN_DTYPE)


def _index_zero(tok) -> jax.Array:
    """`tok` (a float32 run-time zero) as an int32 zero, to add to an index."""
    return tok.astype(jnp.int32)


def read_token(tok, value) -> jax.Array:
    """The token a read returns: `tok` plus a run-time zero made from `value`.

    The next access adds it to an index (or a trip count), so it runs after this
    read and after every access `tok` already waits for.
    """
    return tok + opaque_zero(value).astype(TOKEN_DTYPE)


def _loop(tok, size: int, body: Callable, state):
    """`loop_not_unrolled`, also waiting for `tok`."""
    return loop_not_unrolled(_index_zero(tok), size, body, state)


def _touches_nothing(size: int, shape: Sequence[int]) -> bool:
    """Whether an access of `size` batch elements, each of a window (or, for a
    shift, a buffer) of `shape`, touches no element: then it is the identity on the
    storage, and is written as such. The general lowerings slice a line, or a
    window 2 wide, that a zero-size buffer does not have.
    """
    return size == 0 or math.prod(shape) == 0


def _write(
    tok, size: int, body: Callable, state, idx: Sequence[jax.Array], at: int | None = -1
):
    """Run the write `body(j, state, idx)` for the `size` batch elements.

    Unbatched (`size == 1`), the write runs straight-line, with `tok` added to
    `idx[at]` so that it depends on the access that produced `tok`. `at` must be an
    index that the write really uses (see `_free_dim`).
    """
    if size == 1:
        idx = list(idx)
        if at is not None:
            idx[at] = idx[at] + _index_zero(tok).astype(idx[at].dtype)
        return body(jnp.int32(0), state, idx)
    return _loop(tok, size, lambda j, st: body(j, st, idx), state)


def _free_dim(sizes: Sequence[int], shape: Sequence[int]) -> int | None:
    """The first dimension that a window of `sizes` does not span, if any.

    XLA drops the start index of a dimension that a window spans whole (it is always
    clamped to 0), so a dependence carried by that index would be lost.
    """
    return next((d for d, n in enumerate(sizes) if n < shape[d]), None)


def _element(arrays: Sequence[jax.Array], j) -> list[jax.Array]:
    """The `j`-th element (flattened batch order) of each index array."""
    # Unbatched (0-d) indices are used as they are: no per-iteration slicing.
    return [
        a if a.ndim == 0 else lax.dynamic_index_in_dim(a.reshape(-1), j, keepdims=False)
        for a in arrays
    ]


def _batch_size(idx: Sequence[jax.Array]) -> tuple[tuple[int, ...], int]:
    shape = tuple(idx[0].shape) if idx else ()
    return shape, math.prod(shape)


def _flat(x: jax.Array, bshape: tuple[int, ...]) -> jax.Array:
    return x.reshape((math.prod(bshape),) + x.shape[len(bshape) :])


def _take(x: jax.Array, j) -> jax.Array:
    if x.shape[0] == 1:  # unbatched: no per-iteration slicing
        return x[0]
    return lax.dynamic_index_in_dim(x, j, keepdims=False)


def _put(x: jax.Array, j, v: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(x, v, j, 0)


def _line_start(idx: Sequence[jax.Array], ndim: int) -> list:
    """Start of the line `storage[i_0, ..., i_{axis-1}, :, ...]`."""
    zero = jnp.zeros((), idx[0].dtype) if idx else jnp.int32(0)
    return list(idx[:-1]) + [zero] * (ndim - len(idx) + 1)


def _line_sizes(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return (1,) * axis + tuple(shape[axis:])


# ---------------------------------------------------------------------------
# Window primitives: read_p, accum_p, swap_p.
#
# Operands: (storage, tok, window_or_update?, *starts); `starts` has one entry per
# storage dimension.


def _pair_dim(sizes: Sequence[int], shape: Sequence[int]) -> int | None:
    """The first dimension a window of `sizes` is 1 wide in and the buffer is not."""
    return next((d for d, n in enumerate(sizes) if n == 1 and shape[d] >= 2), None)


def _read_dim(sizes: Sequence[int], shape: Sequence[int]) -> int | None:
    """The dimension to pair a window of `sizes` on for `window_by_reduce`: one it
    is 1 wide in and the buffer is not (`_pair_dim`), else the first it is
    narrower than the buffer in (a window of rows of a delay line), if any."""
    d = _pair_dim(sizes, shape)
    return _free_dim(sizes, shape) if d is None else d


def _reduce_read(storage, size: int, sizes: Sequence[int]) -> int | None:
    """The dimension to read a window of `sizes` through with `window_by_reduce`,
    if it can be: unbatched, a real or bool dtype, and a dimension to pair on
    (`_read_dim`)."""
    if size != 1 or jnp.issubdtype(storage.dtype, jnp.complexfloating):
        return None
    return _read_dim(sizes, storage.shape)


def _can_reduce_read(aval, sizes: Sequence[int]) -> bool:
    """Whether `_reduced_read` reads an unbatched window of `sizes` of a storage of
    type `aval` (`user_slices_materialised`)."""
    return _reduce_read(aval, 1, sizes) is not None


def wrapped_starts(starts, wrap):
    """`starts` with the ring start `wrap = (axis, offset, capacity)` resolved:
    `starts[axis]` is a ring's head (float32 or int, in `[0, capacity)`), and the
    start along `axis` is `(head + offset) % capacity`. Without `wrap`, `starts`."""
    if wrap is None:
        return list(starts)
    axis, offset, cap = wrap
    p = _physical(jnp.int32(offset), starts[axis], cap)
    return [*starts[:axis], p, *starts[axis + 1 :]]


def _read_impl(
    storage,
    tok,
    *starts,
    sizes,
    nbatch=0,
    wrap=None,
    ring=None,
    in_loop=False,
    residual=False,
):
    starts = wrapped_starts(starts, wrap)
    bshape, size = _batch_size(starts)
    if _touches_nothing(size, sizes):
        out = jnp.zeros(bshape + tuple(sizes), storage.dtype)
        return storage, out, tok
    if ring is not None:
        return _ring_read_impl(storage, tok, starts, sizes, ring)
    d = None if in_loop else _reduce_read(storage, size, sizes)
    if d is not None:
        window, bits = window_by_reduce(storage, _element(starts, 0), sizes, d)
        out = window.reshape(bshape + tuple(sizes))
        # The token is made from the reduction's integer result, not from the
        # window: a zero made from the window is a second use of the converted
        # value, which XLA:CPU then materialises beside the buffer (1 copy per
        # step of the kv-cache body under grad).
        return storage, out, read_token(tok, bits)

    whole = size == 1 and tuple(sizes) == tuple(storage.shape)
    if (whole or _each_element_whole(storage, bshape, sizes, nbatch)) and not in_loop:
        # The whole buffer (under `vmap`, each batch element's whole buffer): the
        # window is the storage itself. Read in a loop, it was copied into the
        # loop's state every step (a whole-buffer
        # `dynamic_slice` after an insert: 1 copy forward, 2 in grad, 4 in jvp);
        # as a value, its readers run before the next write wherever XLA can
        # order them so (as for `.array`). The token is returned unchanged: one
        # made from the window (its first element) ordered the next write only
        # after that element's read, not after the window's readers, and cost a
        # kernel of its own, which after a whole-line shift (a delay line) also
        # made XLA compute the shifted element again (a delay line's step with a
        # whole-buffer read was slower than plain `lax` with it), with the same
        # copies in every row of `tests/natural.py` and the corpus without it.
        # Under `vmap`, read in the loop below, every step filled a batch of
        # zeros the size of the storage and copied each element's buffer into
        # it (a batch of kv caches read whole every step: forward 2.5-3.2x plain
        # `lax`).
        out = storage.reshape(bshape + tuple(sizes))
        return storage, out, tok

    free = _free_dim(sizes, storage.shape)
    # The loop moves bits where XLA:CPU would not move the values exactly (see
    # `carrier`), the storage too: XLA would otherwise carry it through the loop
    # converted to float32.
    dtype = storage.dtype
    storage = to_carrier(storage)

    def body(j, state):
        s, out = state
        st = _element(starts, j)
        if size == 1 and free is not None:
            # Index with the loop counter (0 on the only trip) so that XLA cannot hoist
            # the read out of the loop. Hoisted, it would fuse with a preceding
            # straight-line write into a read of the *old* storage, unordered with
            # respect to that write, and the write would copy. The counter goes on a
            # dimension the window does not span (`_free_dim`).
            st = list(st)
            st[free] = st[free] + j.astype(st[free].dtype)
        w = lax.dynamic_slice(s, st, sizes)
        return s, _put(out, j, w)

    out = _loop_zeros(storage, (size,) + tuple(sizes))
    storage, out = _loop(tok, size, body, (storage, out))
    tok = read_token(tok, out)
    out = from_carrier(out.reshape(bshape + tuple(sizes)), dtype)
    return from_carrier(storage, dtype), out, tok


def _one_per_batch_element(storage, bshape, nbatch: int) -> bool:
    """Whether a batched access (`nbatch` > 0) has one index per batch element of
    the storage. The batch rules start every index list with the positions along
    the storage's batch dimensions (`_batch_common`), so each access is then of
    its own element's buffer, and no two touch the same element."""
    return nbatch > 0 and tuple(bshape) == tuple(storage.shape[:nbatch])


def _each_element_whole(storage, bshape, sizes: Sequence[int], nbatch: int) -> bool:
    """Whether a batched read reads, for each batch element, that element's whole
    buffer (`_one_per_batch_element`, 1 wide along the batch dimensions and
    spanning the rest): the windows are then the storage itself."""
    whole = (1,) * nbatch + tuple(storage.shape[nbatch:])
    return _one_per_batch_element(storage, bshape, nbatch) and tuple(sizes) == whole


def _by_element(storage, indices, nbatch: int, tok, at: int):
    """`(storage, indices)` for an access of one window of each batch element
    (`_one_per_batch_element`) written with `jax.vmap`: the storage with its
    `nbatch` batch dimensions flattened into one, and each element's own indices
    (the batch positions dropped), `tok` added to `indices[at]` so that the access
    waits for the one that produced it."""
    b = math.prod(storage.shape[:nbatch])
    s = storage.reshape((b,) + storage.shape[nbatch:])
    ix = [i.reshape(b) for i in indices[nbatch:]]
    ix[at] = ix[at] + _index_zero(tok).astype(ix[at].dtype)
    return s, ix


def _loop_zeros(storage, shape) -> jax.Array:
    """Zeros of `shape` for a read loop's output to start from, made from the
    storage's first element, not a constant: XLA merges equal constants, and two
    loops of one step (a read and its tangent, under `jvp(vmap)`) that start from
    one broadcast each get a copy of it, the size of the windows read, every
    step."""
    zero = jnp.zeros((), storage.dtype)
    if storage.size > 0:
        first = storage.reshape(-1)[:1].reshape(())
        zero = jnp.where(opaque_zero(first) == 0, zero, first)
    return jnp.broadcast_to(zero, shape)


def _batch_aval(storage, shape, dtype, nbatch: int) -> ShapedArray:
    """The type of a window or removed elements of `storage` (an aval): batched,
    sharded and varying over `shard_map` axes as the storage is. Its `nbatch`
    leading dimensions are the storage's batch dimensions."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = storage.sharding
    spec = tuple(sharding.spec)[:nbatch]
    spec = (spec + (None,) * len(shape))[: len(shape)]
    sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    return storage.update(shape=tuple(shape), dtype=dtype, sharding=sharding)


def _read_abstract(
    storage, tok, *starts, sizes, nbatch, wrap=None, ring=None, residual=False
):
    bshape = tuple(starts[0].shape) if starts else ()
    return (
        storage,
        _batch_aval(storage, bshape + tuple(sizes), storage.dtype, nbatch),
        tok,
    )


def _accum_impl(
    storage, tok, window, *starts, ordered, nbatch=0, scalars=True, ring=None
):
    tok_in = tok
    bshape, size = _batch_size(starts)
    if _touches_nothing(size, window.shape[len(bshape) :]):
        return storage, tok
    window = _flat(window, bshape)
    at = _free_dim(window.shape[1:], storage.shape)
    if ring is not None:  # a scatter-add, in place; nothing read first

        def ring_body(j, s, starts):
            return _ring_scatter(s, _element(starts, j), _take(window, j), ring, True)

        return _write(tok, size, ring_body, storage, starts, at), tok_in
    if size == 1 and tuple(window.shape[1:]) == tuple(storage.shape):
        # The whole buffer (the transpose of a whole-buffer read): see
        # `added_in_halves` for why it is not a plain add. `scalars` says whether
        # the halves take the window fused or read it from memory
        # (`added_in_halves_fused`); a window written out anyway (a gather: the
        # rotated cotangent of a batch of rings, each with its own head; an unbatched
        # one is scatter-added, `_rotate_lowering`) is added faster in a
        # single-trip loop: `delay_whole` 0.73-0.75x plain `lax` in the gradient
        # that way, 0.83-0.95x in halves, on an earlier machine.
        w = window[0].astype(storage.dtype)
        if scalars and max(storage.shape, default=0) >= 2:
            return added_in_halves(storage, w, _index_zero(tok)), tok_in
        return _loop(tok, 1, lambda j, s: s + w, storage), tok_in
    olds = None
    sizes = tuple(window.shape[1:])
    # A bfloat16 or float8 storage: the sums are written as bits (`carrier`), and
    # an unbatched accumulation reads its old window first. XLA:CPU computes the
    # sum in float32 whatever, and writes in place through a conversion (to
    # float32 or to bits) only when nothing else in the write's fusion reads the
    # storage.
    dtype = storage.dtype
    narrow = moved_as_bits(dtype)
    # Batched (the windows of one storage at a batch of starts: a read's transpose
    # under `vmap` of an unbatched buffer), each window is read in the loop that
    # writes it, after the writes before it: the windows may overlap, and an old
    # window read before the loop lost the sums written into it earlier (a wrong
    # gradient wherever two batch elements read the same element). The loop
    # orders the reads after the write before it anyway (see `_shift`).
    if size == 1 and (narrow or (ordered and _pair_dim(sizes, storage.shape) is None)):
        # As in `_shift`: read the old window first (`_read_impl`). Where the
        # order matters, only where the write cannot be widened
        # (`widened_write` widens along `_pair_dim`): a window as wide as every
        # dimension of the buffer that has two elements (a window of a 1-D
        # buffer). Read by its own `dynamic_slice`, XLA:CPU fused the straight-line
        # write before it (a transposed `dynamic_update_slice`, writing zeros) into
        # that read, which then read the older buffer: 2 copies per step in the
        # gradient of a `dynamic_update_slice` at a Python-int start of a ring.
        storage, olds, tok = _read_impl(storage, tok, *starts, sizes=sizes)
        olds = _flat(olds, bshape)

    def body(j, s, starts):
        st = _element(starts, j)
        w = _take(window, j)
        if size == 1 and olds is None:  # no loop read first: see `widened_write`
            return widened_write(s, st, w.shape, lambda old: old + w)
        if olds is None:
            old = from_carrier(lax.dynamic_slice(s, st, w.shape), dtype)
        else:
            old = _take(olds, j)
        new = to_carrier((old + w).astype(dtype))  # (itself, unless narrow)
        return lax.dynamic_update_slice(s, new, st)

    storage = to_carrier(storage)
    return from_carrier(_write(tok, size, body, storage, starts, at), dtype), tok_in


def _accum_abstract(storage, tok, window, *starts, ordered, nbatch, ring=None):
    return storage, tok


def _ring_indexed(sizes: Sequence[int], shape: Sequence[int], ring: int) -> tuple:
    """The dimensions a ring window's gather or scatter indexes: `ring`, and those
    the window does not span whole (a spanned one starts at 0). Indexing only
    those lets XLA:CPU fuse the update's computation into the scatter, as it does
    into a `dynamic_update_slice`; with every dimension indexed it did not (one
    more kernel a step)."""
    return tuple(d for d, n in enumerate(sizes) if d == ring or n < shape[d])


def _ring_indices(st, sizes: Sequence[int], shape: Sequence[int], ring: int):
    """The `(n, k)` start indices, along `_ring_indexed`'s `k` dimensions, of the
    one-row slices of a window of `sizes` at `st` whose rows along `ring` wrap round
    the end of the storage (of `shape`): row `i` at `(st[ring] + i) % shape[ring]`,
    for `st[ring]` in range. With starts of shape `(b,)`, one window per batch
    element: `(b, n, k)`."""
    n, cap = sizes[ring], shape[ring]
    dims = _ring_indexed(sizes, shape, ring)
    dtype = jnp.result_type(*[jnp.asarray(st[d]).dtype for d in dims])
    lead = jnp.shape(st[dims[0]])
    col = lambda d: jnp.broadcast_to(jnp.asarray(st[d], dtype)[..., None], lead + (n,))
    rows = col(ring) + lax.iota(dtype, n)
    rows = jnp.where(rows >= cap, rows - cap, rows)
    return jnp.stack([rows if d == ring else col(d) for d in dims], axis=-1)


def _ring_dims(ndim: int, ring: int) -> tuple[int, ...]:
    return tuple(d for d in range(ndim) if d != ring)


def _ring_gather(s, st, sizes: Sequence[int], ring: int):
    """The window of `sizes` at `st` of `s` whose rows along `ring` wrap (a
    gather; its indices in range, checked or promised as every start is). With
    starts of shape `(b,)`, the `b` windows, one gather."""
    lead = 1 if jnp.ndim(st[ring]) else 0
    dims = lax.GatherDimensionNumbers(
        offset_dims=tuple(lead + d for d in _ring_dims(s.ndim, ring)),
        collapsed_slice_dims=(ring,),
        start_index_map=_ring_indexed(sizes, s.shape, ring),
    )
    slice_sizes = tuple(1 if d == ring else n for d, n in enumerate(sizes))
    return lax.gather(
        s,
        _ring_indices(st, sizes, s.shape, ring),
        dims,
        slice_sizes,
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _ring_scatter(s, st, u, ring: int, add: bool = False):
    """`s` with the window `u` written at `st`, its rows along `ring` wrapping: one
    scatter, which XLA writes in place, where a window that may wrap is otherwise
    two read-modify-writes of the windows at either end that hold it (1.8-2x plain
    `lax`'s forward for a block written into a ring). With `add`, `u` is added
    there (a scatter-add)."""
    dims = lax.ScatterDimensionNumbers(
        update_window_dims=_ring_dims(s.ndim, ring),
        inserted_window_dims=(ring,),
        scatter_dims_to_operand_dims=_ring_indexed(u.shape, s.shape, ring),
    )
    return (lax.scatter_add if add else lax.scatter)(
        s,
        _ring_indices(st, u.shape, s.shape, ring),
        u.astype(s.dtype),
        dims,
        indices_are_sorted=False,
        unique_indices=True,
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


def _ring_reduced(storage, st, sizes: Sequence[int], ring: int):
    """`(window, bits)`: the window of a ring at `st` (`_ring_gather`), read
    through a reduction (`pick_by_max`) that XLA materialises once."""
    g = _ring_gather(storage, st, sizes, ring)
    pair = jnp.stack([g, jnp.zeros_like(g)], 0)
    return pick_by_max(pair, opaque_zero(st[ring]), 0)


# The most elements of a window of a ring that batched reads (one window of each
# batch element, at its own start) gather all at once (`_ring_read_impl`), not in
# a loop over the batch. Measured under `vmap` on XLA:CPU (forward, a 200-step scan
# of a push and a read; library / plain `lax`): 1-D rings of 1024 to 4096, windows
# of 4 to 64, batches of 3 and 16: 0.2-1.7x gathered, 0.3-2.2x with the loop (up
# to 2.6x slower). Windows of 4 rows of 32 (the natural row `block_write`, a
# batch of 4 rings of 1024 x 32): 1.76x gathered, 1.69x with the loop, and 4x
# against 1.7x timed back to back, where XLA:CPU splits the gather over threads;
# 1.07-1.16x as a plain gather fused into its reader where no edit follows it
# (`_deferrable_ring_batch`).
GATHER_RING_WINDOWS_UP_TO = 64


def _ring_read_impl(storage, tok, starts, sizes: Sequence[int], ring: int):
    """`(storage, windows, token)`: windows of a ring whose rows along `ring` wrap
    round the end of the storage, each a gather (`_ring_gather`). Unbatched, the
    gather is materialised by a reduction (`pick_by_max`, as `window_by_reduce`)
    and the token taken from it, so that the next write waits for the read and the
    read's consumers read the reduction's result; batched, small windows the
    same, one gather of the batch (`GATHER_RING_WINDOWS_UP_TO`); others, and
    complex ones, in a loop (a wall XLA does not reorder across)."""
    bshape, size = _batch_size(starts)
    dtype = storage.dtype
    storage = to_carrier(storage)  # moved as bits: see `carrier`
    # (A complex window has no bits to reduce over, `pick_by_max`: in a loop.)
    gathered = size == 1 or math.prod(sizes) <= GATHER_RING_WINDOWS_UP_TO
    if gathered and not jnp.issubdtype(dtype, jnp.complexfloating):
        # Batched, small windows are read as one window is: one gather of every
        # window, through a reduction. In a loop over the batch, each trip one
        # window, the trips' set-up cost more: a batch of 3 windows of 4 elements
        # of 1-D rings of 1024 under `vmap` took 1.8-2x plain `lax`'s forward,
        # 0.7x gathered.
        if size == 1:
            st = _element(starts, 0)
        else:
            st = [jnp.broadcast_to(x, bshape).reshape(size) for x in starts]
        out, bits = _ring_reduced(storage, st, sizes, ring)
        tok = read_token(tok, bits)
    else:
        out = _ring_windows_in_loop(storage, starts, sizes, ring, _index_zero(tok))
        tok = read_token(tok, out)
    out = from_carrier(out.reshape(bshape + tuple(sizes)), dtype)
    return from_carrier(storage, dtype), out, tok


def _ring_windows_in_loop(storage, starts, sizes: Sequence[int], ring: int, zero):
    """The windows of a batch of rings (`_ring_gather`), of shape `(batch,) +
    sizes`, read in a loop over the batch (`loop_not_unrolled`, with the run-time
    int32 zero `zero`), one window a trip."""
    _, size = _batch_size(starts)

    def body(j, state):
        s, out = state
        return s, _put(out, j, _ring_gather(s, _element(starts, j), sizes, ring))

    out = _loop_zeros(storage, (size,) + tuple(sizes))  # not a constant
    _, out = loop_not_unrolled(zero, size, body, (storage, out))
    return out


def _swap_impl(
    storage, tok, update, *starts, read, nbatch=0, ring=None, ordered=False, wide=False
):
    tok_in = tok
    bshape, size = _batch_size(starts)
    if _touches_nothing(size, update.shape[len(bshape) :]):
        return storage, jnp.zeros(update.shape, update.dtype), tok
    # Moved as bits (see `carrier`): XLA:CPU rewrites a bfloat16 or float8 window
    # through float32, dropping NaN payloads.
    dtype, storage, update = storage.dtype, to_carrier(storage), to_carrier(update)
    update = _flat(update, bshape)
    sizes = update.shape[1:]
    if read and ring is not None:
        storage, old, tok = _ring_read_impl(storage, tok, starts, sizes, ring)
    elif read:
        # Read the old windows (`_read_impl`), then write, with the write depending
        # on the read's token: the read is then ordered before the write by data
        # dependence. Reading and writing in one loop body leaves the read unordered
        # and XLA copies the buffer (the pop of the `mixed` corpus body).
        # `ordered` (see `bind_swap`): in a loop of its own.
        storage, old, tok = _read_impl(
            storage, tok, *starts, sizes=sizes, in_loop=ordered
        )
    else:  # a plain dynamic_update_slice: the old windows are not wanted
        old = jnp.zeros(bshape + sizes, update.dtype)

    def body(j, s, starts):
        u = _take(update, j)
        if ring is not None:
            return _ring_scatter(s, _element(starts, j), u, ring)
        # A bfloat16 or float8 storage is written as bits: XLA writes it in place
        # through the conversion only when nothing else in the write's fusion
        # reads the storage, which the widened window's neighbour does (a copy of
        # the buffer per step; `tests/test_in_place.py`). Written as the window.
        # So is a buffer of 2 dimensions: widened, the new values are
        # computed in a kernel of their own (`widened_write`), one kernel more a
        # step than plain `lax`'s write (the corpus's `dynamic_update_slice`
        # forward 1.09-1.10x plain `lax`, 0.99x written as the window), and
        # `copy_sweep.py` finds no copy without it on those buffers (an overwrite
        # followed by a read, a slice, `.array` or a pop, every mode). With 3
        # dimensions or more an overwrite then a pop copied under `jvp` (2 a step
        # on `(8, 32, 64)`, `(8, 1, 64)` and `(4, 3, 5, 64)` buffers); a 1-D
        # buffer's one-element writes were not swept, and stay widened. `wide`
        # (a tangent's write, `_swap_jvp`): widened whatever the rank.
        if size == 1 and not moved_as_bits(dtype) and (s.ndim != 2 or wide):
            return widened_write(s, _element(starts, j), u.shape, lambda old: u)
        return lax.dynamic_update_slice(s, u, _element(starts, j))

    if _one_window_per_element(storage, bshape, sizes, nbatch):
        storage = _scattered(storage, tok, update, starts, nbatch, ring)
    else:
        at = _free_dim(sizes, storage.shape)
        storage = _write(tok, size, body, storage, starts, at)
    old = from_carrier(old.reshape(bshape + sizes), dtype)
    return from_carrier(storage, dtype), old, tok_in


def _one_window_per_element(storage, bshape, sizes, nbatch: int) -> bool:
    """Whether a batched write writes one window of at most `GATHER_LINES_UP_TO`
    elements into each batch element's buffer, narrower than that buffer in some
    dimension (`_one_per_batch_element`, `_scattered`)."""
    return (
        _one_per_batch_element(storage, bshape, nbatch)
        and math.prod(sizes) <= GATHER_LINES_UP_TO
        and _free_dim(sizes[nbatch:], storage.shape[nbatch:]) is not None
    )


def _scattered(storage, tok, update, starts, nbatch: int, ring: int | None = None):
    """`storage` with one window of `update` written into each batch element's
    buffer (with `ring`, its rows along that axis wrapping round the end of the
    storage, `_ring_scatter`), all at once: a scatter, as plain `lax` under `vmap`
    (`_each_element`), where the loop over the batch costs about 0.15 us a trip
    on XLA:CPU (the corpus's `dynamic_update_slice` body under `vmap`: 2.5-4.2x
    plain `lax`'s forward)."""
    nb = nbatch
    sizes = update.shape[1 + nb :]
    # The token on a dimension the window does not span (`_free_dim`): XLA drops
    # the start of one it spans.
    at = _free_dim(sizes, storage.shape[nb:])
    assert at is not None  # `_one_window_per_element`
    s, st = _by_element(storage, starts, nb, tok, at)
    u = update.reshape((s.shape[0],) + sizes)
    if s.shape[0] == 1 and (ring is None or sizes[ring - nb] == 1):
        # A batch of one, whose window does not wrap: one `dynamic_update_slice`.
        # XLA turns a scatter of one window into a `dynamic_update_slice` of a
        # `select` between the update and the old window (its bounds check), and
        # with that read of the storage in the write's fusion, a bfloat16 or float8
        # storage written as bits was not written in place through the conversion
        # (a copy per step; see `_swap_impl`'s `body`).
        st1 = [jnp.reshape(i, ()) for i in st]
        st1 = [jnp.zeros_like(st1[0]), *st1]
        return lax.dynamic_update_slice(s, u, st1).reshape(storage.shape)
    if ring is None:
        write = lambda s1, u1, *st1: lax.dynamic_update_slice(s1, u1, st1)
    else:  # rows that wrap round the end of each element's ring (`_ring_scatter`)
        write = lambda s1, u1, *st1: _ring_scatter(s1, list(st1), u1, ring - nb)
    return jax.vmap(write)(s, u, *st).reshape(storage.shape)


def _swap_abstract(
    storage, tok, update, *starts, read, nbatch, ring=None, ordered=False, wide=False
):
    return storage, _batch_aval(storage, update.shape, update.dtype, nbatch), tok


# ---------------------------------------------------------------------------
# Shift primitives: insert_p, pop_p.
#
# Operands: (storage, tok, value?, *index); `index` has `axis + 1` entries, the last
# being the position along the shift axis. Each operation reads the whole line,
# shifts it with `roll` + `where`, and writes it back in one `dynamic_update_slice`
# (a single window read feeding a single window write, which XLA does in place).


def _read_line(s, idx, axis):
    """`(start, line)`: the line `s[idx[:-1]]` with its leading unit axes dropped.

    The shifts work on the line as an array whose axis 0 is the shift axis: rolled
    along a leading axis, XLA fuses `roll` into the `where` that consumes it; along
    a later axis of the `(1, ..., 1, n, ...)` window it materialises the roll as
    slices and a concatenate (two extra kernels per shift on XLA:CPU).
    """
    start = _line_start(idx, s.ndim)
    line = lax.dynamic_slice(s, start, _line_sizes(s.shape, axis))
    return start, line.reshape(s.shape[axis:])


def _write_line(s, start, new, axis):
    new = new.astype(s.dtype).reshape(_line_sizes(s.shape, axis))
    return lax.dynamic_update_slice(s, new, start)


def _positions(line, col, head, ax: int = 0, nbatch: int = 0):
    """The logical position along axis `ax` of each element of `line`: its index,
    or, in a ring whose logical position 0 is at index `head`, its index - `head`
    modulo the length. `nbatch`: as for `_materialised`."""
    pos = lax.broadcasted_iota(col.dtype, line.shape, ax)
    if head is None:
        return pos
    head = _materialised(head.astype(col.dtype), line, nbatch)
    return jnp.where(pos >= head, pos - head, pos - head + line.shape[ax])


def _rolled(line, shift: int, ax: int | None):
    """`jnp.roll(line, shift)` along axis 0, or, where `line` is the whole buffer,
    along its axis `ax`, materialised (`rolled_in_branch`)."""
    if ax is None:
        return jnp.roll(line, shift, 0)
    return rolled_in_branch(line, shift, ax)


def _shift_right(line, col, v, head=None, ax: int | None = None, nbatch: int = 0):
    """`line` with `v` inserted at logical position `col` (axis 0), its last
    element dropped. `jnp.roll` wraps, so in a ring (`head`) the element at the
    head's left, logically last, is the one overwritten. With `ax`, `line` is the
    whole buffer, shifted along its axis `ax` (`_shift`); with `nbatch` too, a
    batch of buffers of one line each, `col`, `v` and `head` one per batch element
    (`_shift_each_line`)."""
    col, v = _materialised(col, line, nbatch), _materialised(v, line, nbatch)
    pos = _positions(line, col, head, ax or 0, nbatch)
    rolled = _rolled(line, 1, ax)
    return jnp.where(pos < col, line, jnp.where(pos == col, v, rolled))


def _shift_left(line, col, fill, head=None, ax: int | None = None, nbatch: int = 0):
    """`line` with the element at logical position `col` (axis 0) removed, `fill`
    added at the (logical) end. `ax`, `nbatch`: as for `_shift_right`."""
    col = _materialised(col, line, nbatch)
    pos = _positions(line, col, head, ax or 0, nbatch)
    fillv = jnp.asarray(fill, line.dtype)
    last = line.shape[ax or 0] - 1
    rolled = _rolled(line, -1, ax)
    return jnp.where(pos < col, line, jnp.where(pos == last, fillv, rolled))


def _windowed(storage, size: int, axis: int) -> bool:
    """Whether a shift edits its line through a window 2 wide in every dimension
    before the shift axis that has two elements (`window2_edit`): unbatched, with
    lines to pair it with, and more lines than the window holds (a window of all
    of them would be the whole buffer, rewritten out of place by every edit)."""
    wide = sum(1 for n in storage.shape[:axis] if n >= 2)
    return size == 1 and wide >= 1 and math.prod(storage.shape[:axis]) > 2**wide


def _shift(storage, tok, idx, axis, new_line, ordered, want_lines=False, values=None):
    """Replace each indexed line `l` by `new_line(j, l, col)`; `j` is the batch element.

    Returns `(storage, lines)`, with the lines as read when `ordered`, else `None`.

    Unbatched, on a buffer whose line is the whole buffer, the buffer is shifted
    in its own shape, straight-line (`_whole_line`; `ordered` is then moot: the
    roll is materialised). Unbatched, on a buffer with at least two lines, each
    line is edited through a 2-line window (`window2_edit`), straight-line.
    Otherwise: `ordered=False` reads, shifts and writes each line straight-line,
    the same operations as plain `lax` code; `ordered=True` first reads the
    lines in their own loop (needed when `storage` comes straight from another
    straight-line write, see the module docstring). Batched, the writes are a
    loop, which XLA does not fuse a write before it into, and `ordered` is moot:
    that read loop filled zeros the size of all the lines every step (a batch of
    1-D buffers under `vmap`, each a line: 2.7x plain `lax`'s forward).
    `want_lines` forces that loop, to return the lines as read.
    `values`: the dtype whose bits `storage` holds, if it is moved as bits
    (`carrier`), for `window2_edit`.
    """
    bshape, size = _batch_size(idx)
    if _whole_line(storage, size, axis) and not want_lines:
        # The line is the whole buffer: shifted in its own shape, along `axis`,
        # with its roll materialised (`rolled_in_branch`), so that the `select`
        # reads the buffer and the roll at the positions it writes, in place. Read
        # as a slice and reshaped, a `(1, n)` line's `select` kernel ended in a
        # reshape, and XLA:CPU wrote it out of place (a copy per step).
        def whole(j, s, idx):
            return new_line(j, s, _element(idx, j)[-1], axis).astype(s.dtype)

        return _write(tok, size, whole, storage, idx), None
    lines = None
    window = _windowed(storage, size, axis)
    if window and not want_lines:
        body = lambda j, s, idx: window2_edit(
            s, _element(idx, j), axis, new_line, values=values
        )[0]
        return _write(tok, size, body, storage, idx), None
    if ordered and (want_lines or size == 1):
        starts = list(idx[:-1]) + [jnp.zeros_like(idx[-1])] * (storage.ndim - axis)
        sizes = _line_sizes(storage.shape, axis)
        storage, lines, tok = _read_impl(storage, tok, *starts, sizes=sizes)
        lines = lines.reshape((size,) + storage.shape[axis:])

    line_sizes = _line_sizes(storage.shape, axis)
    pair = None
    if size == 1 and not jnp.issubdtype(storage.dtype, jnp.complexfloating):
        pair = _pair_dim(line_sizes, storage.shape)

    def body(j, s, idx):
        ix = _element(idx, j)
        if lines is None and pair is not None:
            # One line of two (`_windowed` leaves them out: their 2-line window
            # would be the whole buffer, rewritten out of place by every edit).
            # A line written by a plain slice is duplicated into the next read of
            # it, which then reads the older buffer (see `window2_edit`); read
            # through a reduction (`window_by_reduce`), it is materialised once.
            start = _line_start(ix, s.ndim)
            line, _ = window_by_reduce(s, start, line_sizes, pair)
            line = line.reshape(s.shape[axis:])
        elif lines is None:
            start, line = _read_line(s, ix, axis)
        elif window:
            return window2_edit(s, ix, axis, new_line, _take(lines, j))[0]
        else:
            start, line = _line_start(ix, s.ndim), _take(lines, j)
        return _write_line(s, start, new_line(j, line, ix[-1]), axis)

    return _write(tok, size, body, storage, idx), lines


def _split_head(idx, axis: int) -> tuple[list, jax.Array | None]:
    """`(indices, head)`: a shift of a ring line takes the line's head (the index
    where its logical position 0 is stored) as one more operand after the
    `axis + 1` indices, so that the JVP, transpose and batching rules, which pass
    indices through, carry it too."""
    idx = list(idx)
    if len(idx) == axis + 2:
        return idx[:-1], idx[-1]
    return idx, None


def _heads(head, bshape):
    """A function of the batch element `j`: its head, or None (not a ring)."""
    if head is None:
        return lambda j: None
    flat = _flat(head, bshape)
    return lambda j: _take(flat, j)


def _physical(col, head, n: int):
    """Where logical position `col` of a ring line of length `n` is stored."""
    if head is None:
        return col
    p = col + head.astype(col.dtype)
    return jnp.where(p >= n, p - n, p)


# The least number of elements of a line whose shift reads its scalars and value
# through a reduction (`_materialised`).
MATERIALISE_FROM = 2048


def _materialised(x, line, nbatch: int = 0):
    """`x`, for the shift of `line`: read through a reduction, which XLA computes
    once, on its own, if `line` has at least `MATERIALISE_FROM` elements (past its
    `nbatch` leading batch dimensions: per batch element).

    A shift is one `select` over its line; XLA:CPU fuses into it whatever computes
    its scalars and its inserted value, and recomputes them for every element of
    the line (an `optimization_barrier` on the value did not stop it: the `sin`
    stayed in the select's fusion). A traced insert of `sin(...)` into a (256,
    64) ring took 0.45 ms a step, where the select itself takes 0.01 ms. A
    reduction is not fused into its consumers, but it is a kernel of its own,
    about 1 us on XLA:CPU: on shorter lines (the 2-line window of a buffer of 500
    columns, a stack of 64 x 8) it cost more than it saved (the corpus's insert
    bodies, up to 2x slower forward).

    Pinned by `tests/test_in_place.py::test_a_long_line_shift_computes_its_value_once`.
    """
    x = jnp.asarray(x)
    if (
        math.prod(line.shape[nbatch:]) < MATERIALISE_FROM
        or x.size == 0
        or jnp.issubdtype(x.dtype, jnp.complexfloating)  # (no unsigned type as wide)
    ):
        return x
    return materialised(x, opaque_zero(x))


def _insert_impl(storage, tok, value, *idx, axis, ordered, nbatch=0):
    idx, head = _split_head(idx, axis)
    bshape, size = _batch_size(idx)
    if _touches_nothing(size, storage.shape):
        return storage, tok
    # A shift is a `select` of every element of its line: moved as bits (see
    # `carrier`), or XLA:CPU drops the NaN payloads of bfloat16 and float8 lines.
    dtype, storage, value = storage.dtype, to_carrier(storage), to_carrier(value)
    value, heads = _flat(value, bshape), _heads(head, bshape)
    new_line = lambda j, line, col, ax=None: _shift_right(
        line, col, _take(value, j), heads(j), ax
    )
    narrow = dtype if moved_as_bits(dtype) else None
    if head is None and _one_per_element(storage, bshape, nbatch, axis):
        each = lambda v, line, col: _shift_right(line, col, v)
        storage = _each_element(storage, tok, idx, axis, each, nbatch, value)[0]
        return from_carrier(storage, dtype), tok
    if _each_a_line(storage, bshape, nbatch, axis, dtype):
        v = value.reshape(bshape + (1,) * (axis + 1 - nbatch) + value.shape[1:])
        shifted = lambda line, col, h: _shift_right(line, col, v, h, axis, nbatch)
        storage = _shift_each_line(storage, tok, idx, head, nbatch, shifted)
        return from_carrier(storage, dtype), tok
    storage = _shift(storage, tok, idx, axis, new_line, ordered, values=narrow)[0]
    return from_carrier(storage, dtype), tok


# The most elements of a line whose batched shifts are one gather and scatter
# (`_each_element`), not a loop over the batch. Measured under `vmap` on XLA:CPU
# (forward, library / plain `lax`): lines of 64 elements (the corpus's insert,
# delete and pop bodies) 3.7-5x with the loop, 1.0x gathered; lines of 500 to
# 4096 (the natural rows `pyint`, `stack`, `two_lines`) 0.09-0.4x with the loop,
# 0.2-1.05x gathered, since a gathered line is materialised twice. Batched
# writes of windows (`_scattered`) take the same bound; the corpus's windows are
# 16 elements (`dynamic_update_slice` under `vmap`: 2.5-4.2x with the loop, about
# 1x scattered). Not free where a step also reads the whole buffer: the natural
# rows `whole_*` (an insert into lines of 64, then a read of all 512 of them)
# take 1.1-1.3x as long gathered as with the loop, still 0.74-0.93x plain `lax`
# (both versions compiled in one process, alternated).
GATHER_LINES_UP_TO = 256


def _one_per_element(storage, bshape, nbatch: int, axis: int) -> bool:
    """Whether a batched shift along `axis` edits one short line (at most
    `GATHER_LINES_UP_TO` elements) of each batch element's buffer: its `nbatch`
    leading indices are its batch positions (`_one_per_batch_element`), so no two
    edits touch the same line (`_each_element`)."""
    return (
        _one_per_batch_element(storage, bshape, nbatch)
        and storage.size > 0
        and math.prod(storage.shape[axis:]) <= GATHER_LINES_UP_TO
    )


def _each_element(storage, tok, idx, axis, new_line, nbatch, values=None):
    """`(storage, removed)`: the shift `new_line(value, line, col)` of one line of
    each batch element's buffer (`_one_per_element`), all at once: one gather of
    the lines and one scatter of the shifted ones, as plain `lax` under `vmap`,
    which XLA does in place. `values`: one per batch element, mapped over with the
    lines (or None). `removed`: each line's element at its index.

    The values are mapped over, not taken by each element's position in the batch
    (`values[j]` for `j` in `arange`): that was a gather, which XLA:CPU computed
    as a kernel of its own before the scatter, where plain `lax` fuses the value's
    computation into the scattered window. One kernel more a step took the natural
    row `whole_read` under `vmap` to 9 kernels a loop step against plain `lax`'s
    8, past the 8 that XLA:CPU runs in line
    (`benchmarks/experiments/thunk_threshold.py`).

    The loop over the batch that `_shift` runs otherwise costs XLA:CPU about
    0.15 us a trip: the corpus's insert, delete and pop bodies under `vmap` (8
    sequences of edits of a (100, 64) buffer) took 2.5-5x plain `lax`'s forward.
    A ring's line is left to that loop: gathered, its shift copied the buffer
    under `jvp(vmap)` (`ring_mix`)."""
    nb = nbatch
    s, ix = _by_element(storage, idx, nb, tok, 0)  # (the line's first index)
    ax = axis - nb

    def one(v1, s1, *ix1):
        start, line = _read_line(s1, list(ix1), ax)
        removed = lax.dynamic_index_in_dim(line, ix1[-1], 0, keepdims=False)
        out = _write_line(s1, start, new_line(v1, line, ix1[-1]), ax)
        return out, removed

    out, removed = jax.vmap(
        one, in_axes=(None if values is None else 0,) + (0,) * (1 + len(ix))
    )(values, s, *ix)
    removed = removed.reshape(idx[0].shape + storage.shape[axis + 1 :])
    return out.reshape(storage.shape), removed


# The most elements of a batch of buffers of one line each whose batched shifts
# are one `select` over the batch (`_shift_each_line`), not a loop over it. Measured
# under `vmap` on XLA:CPU (forward, a 200-step scan of a traced insert, pop, or
# insert and delete into batches of 3 and 16 1-D buffers of 256 to 16384 elements;
# library / plain `lax`): up to 4096 elements in all, 0.83-1.07x with the select,
# 1.19-2.83x with the loop (its trips' set-up); from 12288, the loop 0.3-1.09x (each
# trip's line stays in cache) where the select, three passes over the whole batch,
# was up to 2x. Between, 8192 (16 x 512) is on the select's side of the line.
SELECT_LINES_UP_TO = 8192


def _each_a_line(storage, bshape, nbatch: int, axis: int, dtype) -> bool:
    """Whether a batched shift along `axis` edits, for each batch element, that
    element's only line (`_one_per_batch_element`, and no dimension of more than
    one element between the batch dimensions and `axis`: a batch of 1-D buffers,
    delay lines, stacks or `(1, n)` buffers, rings or not, under `vmap`), the
    batch of them at most `SELECT_LINES_UP_TO` elements, of a dtype moved as it
    is (`dtype`, the buffer's). Moved as bits (`moved_as_bits`: bfloat16, the
    float8s), the select of a batch of bfloat16 rings under `vmap(grad)`, after a
    read and before the accumulation of its cotangent, was copied every step
    (the loop over the batch was not)."""
    return (
        not moved_as_bits(dtype)
        and _one_per_batch_element(storage, bshape, nbatch)
        and 0 < storage.size <= SELECT_LINES_UP_TO
        and math.prod(storage.shape[nbatch:axis]) == 1
    )


def _per_element(x, storage, nbatch: int):
    """`x`, one scalar per batch element (shape `storage.shape[:nbatch]`), shaped to
    broadcast against the storage."""
    return x.reshape(x.shape[:nbatch] + (1,) * (storage.ndim - nbatch))


def _shift_each_line(storage, tok, idx, head, nbatch: int, shifted: Callable):
    """The batch of shifts `shifted(storage, col, head)` of each batch element's
    only line (`_each_a_line`), as one: `col` and `head` (or None) broadcast
    against the storage, one per batch element.

    The same `select` over the buffer and its materialised roll as one line's
    shift unbatched (`_shift`'s whole line), over the batch at once: the roll is
    by one element along the line for every element, whatever its position and
    head. A loop over the batch, each trip slicing its line and writing it back,
    costs about 0.15 us a trip and two kernels: a batch of 3 traced inserts into
    1-D rings of 1024 elements under `vmap` took 1.6-1.7x plain `lax`'s
    `jnp.where(..., jnp.roll(...))` (which does not copy there), 1.0x as one
    select (`SELECT_LINES_UP_TO`). The token is added to every position, so the
    shift waits for the access before it."""
    col = idx[-1] + _index_zero(tok).astype(idx[-1].dtype)
    col = _per_element(col, storage, nbatch)
    h = None if head is None else _per_element(head, storage, nbatch)
    return shifted(storage, col, h).astype(storage.dtype)


def _insert_abstract(storage, tok, value, *idx, axis, ordered, nbatch):
    return storage, tok


def _whole_line(storage, size: int, axis: int) -> bool:
    """Whether an unbatched shift's line is the whole buffer (a 1-D buffer, a
    `(1, n)` buffer, a delay line or stack shifted along axis 0)."""
    return size == 1 and math.prod(storage.shape[:axis]) == 1


def _one_line(storage, size: int, axis: int) -> bool:
    """Whether an unbatched shift writes the whole buffer: its line is the whole
    buffer (a 1-D buffer, a delay line shifted along axis 0, a `(1, n)` buffer),
    or its 2-line window is (`(2, n)`)."""
    return size == 1 and math.prod(storage.shape[:axis]) <= 2


def _reduce_readable(storage, size: int, axis: int) -> bool:
    """Whether a pop can read its line through a reduction (`window2_edit`'s
    `reduce_line`): a shift through a 2-line window, of a real or bool dtype."""
    return _windowed(storage, size, axis) and not jnp.issubdtype(
        storage.dtype, jnp.complexfloating
    )


def _line_pair(storage, size: int, axis: int) -> int | None:
    """The dimension along which an unbatched shift of one line of two (a
    `(2, n)` buffer) reads its line through a reduction (`window_by_reduce`), if
    it can: a real or bool dtype, and lines of at least 2 elements."""
    if size != 1 or axis < 1 or _windowed(storage, size, axis):
        return None
    if jnp.issubdtype(storage.dtype, jnp.complexfloating) or storage.shape[axis] < 2:
        return None
    return _pair_dim(_line_sizes(storage.shape, axis), storage.shape)


def _pop_impl(storage, tok, *idx, axis, fill, read, ordered, nbatch=0):
    # Moved as bits, as an insert (`_insert_impl`); `fill` too.
    dtype, storage = storage.dtype, to_carrier(storage)
    fill = np.asarray(fill, dtype).view(carrier(dtype))[()]
    narrow = dtype if moved_as_bits(dtype) else None
    plain, head = _split_head(idx, axis)
    bshape = tuple(plain[0].shape)
    if head is None and _one_per_element(storage, bshape, nbatch, axis):
        each = lambda v, line, col: _shift_left(line, col, fill)
        storage, removed = _each_element(storage, tok, plain, axis, each, nbatch)
        if not read:  # a delete: the removed elements are not wanted
            removed = jnp.zeros_like(removed)
        return from_carrier(storage, dtype), from_carrier(removed, dtype), tok
    if _each_a_line(storage, bshape, nbatch, axis, dtype):
        storage, removed = _pop_each_line(
            storage, tok, plain, head, axis, fill, read, nbatch
        )
        return from_carrier(storage, dtype), from_carrier(removed, dtype), tok
    storage, removed = _pop_edit(storage, tok, idx, axis, fill, read, ordered, narrow)
    return from_carrier(storage, dtype), from_carrier(removed, dtype), tok


def _pop_each_line(storage, tok, idx, head, axis: int, fill, read: bool, nbatch: int):
    """`(storage, removed)`: the pops of each batch element's only line
    (`_each_a_line`), as one shift (`_shift_each_line`). The removed elements are
    read first, one gather behind an `optimization_barrier` (`_reduced_read`'s
    batch) so that XLA reads them once, before the shift, which waits for them
    through the token: as a single line's pop reads its removed element before
    shifting."""
    bshape, vshape = tuple(idx[0].shape), storage.shape[axis + 1 :]
    if read:
        col = _physical(idx[-1], head, storage.shape[axis])
        zeros = [jnp.zeros_like(col)] * (storage.ndim - axis - 1)
        sizes = (1,) * (axis + 1) + vshape
        starts = [*idx[:-1], col, *zeros]
        removed, bits = _reduced_read(storage, *starts, sizes=sizes, nbatch=nbatch)
        tok = read_token(tok, bits)
        removed = removed.reshape(bshape + vshape)
    else:  # a delete: the removed elements are not wanted
        removed = jnp.zeros(bshape + vshape, storage.dtype)

    def shifted(line, col, h):
        return _shift_left(line, col, fill, h, axis, nbatch)

    return _shift_each_line(storage, tok, idx, head, nbatch, shifted), removed


def _pop_edit(storage, tok, idx, axis, fill, read, ordered, values=None):
    idx, head = _split_head(idx, axis)
    bshape, size = _batch_size(idx)
    if _touches_nothing(size, storage.shape):
        return storage, jnp.zeros(bshape + storage.shape[axis + 1 :], storage.dtype)
    heads = _heads(head, bshape)
    new_line = lambda j, line, col, ax=None: _shift_left(line, col, fill, heads(j), ax)
    if not read:  # a delete: the removed elements are not wanted
        storage, _ = _shift(storage, tok, idx, axis, new_line, ordered, values=values)
        return storage, jnp.zeros(bshape + storage.shape[axis + 1 :], storage.dtype)
    # A ring is one line (`_split_head`): neither of the next two paths, which
    # take the removed element at its logical position in the physical line.
    windowed = _reduce_readable(storage, size, axis) and head is None
    if windowed and not _one_line(storage, size, axis):
        # Read the line through a reduction, straight-line, take the removed
        # element out of it, and shift (see `window2_edit`). This holds after
        # another straight-line write too (`ordered`), since every unbatched write
        # spans two elements of each non-unit dimension (`window2_edit`,
        # `widened_write`) and so is not fused into the read.
        def body(j, state, idx):
            ix = _element(idx, j)
            s, line = window2_edit(
                state[0], ix, axis, new_line, reduce_line=True, values=values
            )
            return s, lax.dynamic_index_in_dim(line, ix[-1], 0, keepdims=False)

        vshape = storage.shape[axis + 1 :]
        state = (storage, jnp.zeros(vshape, storage.dtype))
        storage, removed = _write(tok, size, body, state, idx)
        return storage, removed.reshape(bshape + vshape)
    pair = _line_pair(storage, size, axis) if head is None else None
    if pair is not None:
        # One line of two: read the line through a reduction over both lines
        # (`window_by_reduce`), take the removed element out of that value, and
        # write the line, straight-line (as `window2_edit` with `reduce_line`).
        # Reading the removed element through a reduction of its own first, as
        # for a single line below, cost one more kernel per pop.
        def body(j, state, idx):
            ix = _element(idx, j)
            s = state[0]
            start = _line_start(ix, s.ndim)
            line, _ = window_by_reduce(s, start, _line_sizes(s.shape, axis), pair)
            line = line.reshape(s.shape[axis:])
            out = _write_line(s, start, new_line(j, line, ix[-1]), axis)
            return out, lax.dynamic_index_in_dim(line, ix[-1], 0, keepdims=False)

        vshape = storage.shape[axis + 1 :]
        state = (storage, jnp.zeros(vshape, storage.dtype))
        storage, removed = _write(tok, size, body, state, idx)
        return storage, removed.reshape(bshape + vshape)
    if _one_line(storage, size, axis) and storage.shape[axis] >= 2:
        # The line is the whole buffer, so its write is not in place whatever
        # comes before it (the shifted line is a new array, as in plain `lax`):
        # read only the removed element, through a reduction (`_read_impl`), and
        # shift after it, waiting on its token. Reading the whole line in a loop
        # copied it into the loop's state every step (a copy of the buffer).
        col = _physical(idx[-1], head, storage.shape[axis])
        starts = (
            list(idx[:-1]) + [col] + [jnp.zeros_like(col)] * (storage.ndim - axis - 1)
        )
        sizes = (1,) * (axis + 1) + tuple(storage.shape[axis + 1 :])
        storage, removed, tok = _read_impl(storage, tok, *starts, sizes=sizes)
        storage, _ = _shift(storage, tok, idx, axis, new_line, False)
        return storage, removed.reshape(bshape + storage.shape[axis + 1 :])
    if size > 1:
        # Batched: one loop over the batch, each trip reading its line, taking
        # the removed element out of it and writing the shifted line, as for an
        # insert (`_shift`, unordered: the writes are in a loop, not fused with
        # a straight-line write before them). The lines read in a loop of their
        # own first (below) filled zeros the size of all the lines, every step (a
        # batch of 1-D buffers under `vmap`: 2.5x plain `lax`'s forward).
        n = storage.shape[axis]

        def each(j, state, idx):
            s, out = state
            ix = _element(idx, j)
            start, line = _read_line(s, ix, axis)
            col = _physical(ix[-1], heads(j), n)
            removed = lax.dynamic_index_in_dim(line, col, 0, keepdims=False)
            out = _put(out, j, removed.astype(out.dtype))
            # The write waits for the removed elements' update, which XLA fuses
            # with the read of the removed element from the buffer: after the
            # write, that read is of the old buffer, which is then a copy.
            start[0] = start[0] + _index_zero(read_token(tok, out)).astype(
                start[0].dtype
            )
            s = _write_line(s, start, new_line(j, line, ix[-1]), axis)
            return s, out

        vshape = storage.shape[axis + 1 :]
        state = (storage, _loop_zeros(storage, (size,) + vshape))
        storage, removed = _write(tok, size, each, state, idx)
        return storage, removed.reshape(bshape + vshape)
    # Otherwise the removed elements are read before the write (in place only if
    # ordered before it by data) from materialised lines: an ordered shift, its
    # reads in a loop.
    storage, lines = _shift(storage, tok, idx, axis, new_line, True, True)
    cols = jnp.broadcast_to(_physical(idx[-1], head, storage.shape[axis]), bshape)
    cols = cols.reshape(size)
    removed = jax.vmap(lambda line, c: lax.dynamic_index_in_dim(line, c, 0, False))(
        lines, cols
    )
    return storage, removed.reshape(bshape + storage.shape[axis + 1 :])


def _pop_abstract(storage, tok, *idx, axis, fill, read, ordered, nbatch):
    bshape = tuple(idx[0].shape)
    vshape = storage.shape[axis + 1 :]
    return storage, _batch_aval(storage, bshape + vshape, storage.dtype, nbatch), tok


# ---------------------------------------------------------------------------
# Definitions.


def _deferrable(ctx, *, sizes, nbatch, wrap=None, ring=None, residual=False) -> bool:
    """Whether a read may be lowered as a plain slice (`deferred_read`): when
    `_read_impl` would read it through a reduction, of a dtype XLA:CPU moves exactly
    (`DEFERRABLE_DTYPES`)."""
    storage = ctx.avals_in[0]
    starts = ctx.avals_in[2:]
    return (
        nbatch == 0
        and all(a.shape == () for a in starts)
        and not _touches_nothing(1, sizes)
        and storage.dtype in DEFERRABLE_DTYPES
        and (ring is not None or _reduce_read(storage, 1, sizes) is not None)
    )


def _deferrable_batch(
    ctx, *, sizes, nbatch, wrap=None, ring=None, residual=False
) -> bool:
    """Whether a batched read, which `_read_impl` reads in a loop over the batch,
    may be marked for an edit after it to make it a gather instead
    (`deferred_loop_read`): one window of each batch element's buffer, not a
    ring's (whose windows may wrap), not the whole of it (`_each_element_whole`:
    the storage itself), of a dtype XLA:CPU moves exactly (`DEFERRABLE_DTYPES`),
    with one token for the batch."""
    storage = ctx.avals_in[0]
    bshape = tuple(ctx.avals_in[2].shape) if len(ctx.avals_in) > 2 else ()
    return (
        nbatch > 0
        and wrap is None
        and ring is None
        and ctx.avals_in[1].shape == ()
        and _one_per_batch_element(storage, bshape, nbatch)
        and not _each_element_whole(storage, bshape, sizes, nbatch)
        and not _touches_nothing(math.prod(bshape), sizes)
        and storage.dtype in DEFERRABLE_DTYPES
    )


def _deferrable_ring_batch(
    ctx, *, sizes, nbatch, wrap=None, ring=None, residual=False
) -> bool:
    """Whether a batched read of a ring's windows, which `_ring_read_impl` would
    read in a loop over the batch (windows of more than
    `GATHER_RING_WINDOWS_UP_TO` elements), may be lowered as one plain gather of
    the windows (`deferred_read`), which XLA fuses into its readers: one window
    of each element's buffer along one batch dimension, of a batch of more than
    one (`_reduced_read` reads a batch of one), of a real dtype XLA:CPU moves
    exactly (`DEFERRABLE_DTYPES`), with one token for the batch. An edit that
    follows it materialises it (`_reduced_read`).

    In the loop, a batch of 4 blocks of `(4, 32)` read from rings of
    `(1024, 32)` (the natural row `block_write` under `vmap`) took 1.6-1.8x
    plain `lax`'s forward, whose gather XLA fuses into its reader.

    Not for the primal read of a derivative (`residual`, set by `_read_jvp`): its
    window is also saved for the backward pass, XLA then writes the gather out in
    a kernel of its own, and XLA:CPU splits that kernel over threads, which cost
    more than the loop (a batch of 4 delay lines `(1024, 32)`, `insert(0, x)` then
    a read of 4 rows: `vmap(grad)` 0.56 -> 0.80 ms, `grad(vmap)` 0.97 -> 1.43)."""
    storage = ctx.avals_in[0]
    bshape = tuple(ctx.avals_in[2].shape) if len(ctx.avals_in) > 2 else ()
    return (
        not residual
        and nbatch == 1
        and ring is not None
        and ctx.avals_in[1].shape == ()
        and math.prod(bshape) > 1
        and math.prod(sizes) > GATHER_RING_WINDOWS_UP_TO
        and _one_per_batch_element(storage, bshape, nbatch)
        and not _each_element_whole(storage, bshape, sizes, nbatch)
        and storage.dtype in DEFERRABLE_DTYPES
    )


def _ring_batch_gather(storage, starts, sizes: Sequence[int], ring: int):
    """`_ring_gather` of one window of each batch element's ring, `starts` (of
    the batch's shape, or scalars) broadcast to one shape; with every start a
    scalar, the one window of an unbatched ring."""
    bshape = jnp.broadcast_shapes(*(jnp.shape(st) for st in starts))
    starts = [jnp.broadcast_to(st, bshape) for st in starts]
    return _ring_gather(storage, starts, sizes, ring)


def _batch_gather(storage, starts, sizes: Sequence[int]):
    """One window of `sizes` of each batch element's buffer (the batch dimensions,
    which `starts` begin with and the windows are 1 wide in): one gather of the
    storage, clamping as `lax.dynamic_slice` does (the starts are in range, checked
    or promised, as every start is)."""
    dtype = jnp.result_type(*starts)
    indices = jnp.stack([jnp.asarray(st, dtype) for st in starts], axis=-1)
    bshape = tuple(starts[0].shape)
    dims = lax.GatherDimensionNumbers(
        offset_dims=tuple(range(len(bshape), len(bshape) + storage.ndim)),
        collapsed_slice_dims=(),
        start_index_map=tuple(range(storage.ndim)),
    )
    return lax.gather(
        storage, indices, dims, tuple(sizes), mode=lax.GatherScatterMode.CLIP
    )


def _reduced_read(storage, *starts, sizes, ring=None, nbatch=0):
    """`(window, bits)`: the read `_read_impl` makes through a reduction; batched
    (`nbatch`), the gather of each element's window (`_batch_gather`) behind an
    `optimization_barrier`, which is its own bits. The barrier makes the windows
    one value that their readers read: XLA duplicates a gather into its readers,
    and one recomputed in a reader after the edit would read the older buffer (a
    copy).

    A batch of one element is read as an unbatched read of the whole storage
    (`window_by_reduce`), whose batch dimensions are 1 wide. XLA simplifies a
    gather of one window to a dynamic slice and, being cheap, duplicates that
    into each of its readers past the barrier (XLA:CPU expands barriers into
    control dependencies before fusion): the pop's removed element was read again
    after the shift, a copy of the buffer per step under `vmap` with a batch of
    one."""
    if nbatch and ring is not None:  # `_deferrable_ring_batch`
        # In a loop over the batch, as `_ring_read_impl` reads them: gathered
        # behind a barrier instead, a batch of 4 blocks of `(4, 32)` of rings of
        # `(1024, 32)` read before a write of each took twice the loop's time.
        dtype = storage.dtype
        bits = _ring_windows_in_loop(
            to_carrier(storage), starts, sizes, ring, jnp.int32(0)
        )
        bshape = jnp.broadcast_shapes(*(jnp.shape(st) for st in starts))
        return from_carrier(bits.reshape(bshape + tuple(sizes)), dtype), bits
    if nbatch:
        bshape = tuple(starts[0].shape)
        d = _reduce_read(storage, 1, sizes) if math.prod(bshape) == 1 else None
        if d is not None:
            flat = [jnp.reshape(st, ()) for st in starts]
            window, bits = window_by_reduce(storage, flat, sizes, d)
            return window.reshape(bshape + tuple(sizes)), bits
        (g,) = lax.optimization_barrier((_batch_gather(storage, starts, sizes),))
        return g, g
    if ring is not None:
        return _ring_reduced(storage, starts, sizes, ring)
    d = _read_dim(sizes, storage.shape)
    assert d is not None  # `_deferrable` read it so
    return window_by_reduce(storage, starts, sizes, d)


def _after_deferred_reads(ctx, args):
    """`args` with the token waiting for the deferred reads of the storage, now
    materialised (`materialise_deferred_reads`)."""
    storage, tok, *rest = args
    module = ctx.module_context.module
    waits, arrays = materialise_deferred_reads(ctx, storage, _reduced_read, read_token)
    for array in (storage, *arrays):
        waits += user_reads_before(array, module)
        waits += user_slices_materialised(ctx, array, _reduced_read, _can_reduce_read)
    tok = after_marked_reads(storage, tok, module)
    if not waits:
        return (storage, tok, *rest)
    tok_aval = ctx.avals_in[1]
    bits, bits_avals = zip(*waits, strict=True)
    sub = ctx.replace(
        primitive=None, avals_in=[tok_aval, *bits_avals], avals_out=[tok_aval]
    )
    (tok,) = mlir.lower_fun(waiting, multiple_results=True)(sub, tok, *bits)
    return (storage, tok, *rest)


def _with_wrapped_starts(ctx, args, wrap):
    """`(ctx, args)` for a read's operands with its ring start resolved
    (`wrapped_starts`, lowered in line), `ctx` with their types."""
    storage, tok, *starts = args
    avals = ctx.avals_in[2:]
    out_avals = [
        a.update(dtype=jnp.dtype(jnp.int32)) if k == wrap[0] else a
        for k, a in enumerate(avals)
    ]
    sub = ctx.replace(primitive=None, avals_in=avals, avals_out=out_avals)
    at = mlir.lower_fun(lambda *st: wrapped_starts(st, wrap), multiple_results=True)(
        sub, *starts
    )
    ctx = ctx.replace(avals_in=[*ctx.avals_in[:2], *out_avals])
    return ctx, (storage, tok, *at)


def _accum_unordered(storage, tok, window, *starts, scalars, ring=None):
    """An unbatched accumulation, as `accum_p` lowers it (`fold_cotangent_sum`)."""
    lowered = run_time_indices(_accum_impl, 3)
    return lowered(
        storage, tok, window, *starts, ordered=False, scalars=scalars, ring=ring
    )


# What `_xla._finish` lowers once a function holding accesses is lowered whole.
_FINISH_KIT = Kit(_accum_unordered, _reduced_read, _can_reduce_read)


# The least size in bytes of a storage whose reads after an edit are made in a
# conditional (`_edited_bits`). XLA:CPU runs a conditional in about 0.3 us, the
# time of copying about 2 KiB: measured forward (200 steps, `promise_in_bounds`,
# bfloat16, a traced insert or overwrite then a read of 16), the copy against the
# conditional: 256 elements 0.59 against 0.92 us a step, 1024 elements 0.67
# against 0.69, `(2, 4096)` 5.9 against 1.9.
READ_IN_BRANCH_FROM_BYTES = 2048


def _edited_bits(aval, value: ir.Value) -> bool:
    """Whether an operand `value` (of type `aval`) is moved as bits
    (`moved_as_bits`), of at least `READ_IN_BRANCH_FROM_BYTES`, and computed in
    the function being lowered (an edit's result, not an argument): then a read
    of it is made in a conditional of its own (`in_branch`).

    An edit of such a storage writes the bits of its carrier and converts them
    back; a read converts the storage to those bits again, which XLA folds, and
    the edit's computation then has two users it can fuse, the conversion written
    to the buffer and the read. XLA fuses it into both, and the read, recomputing
    the edit from the storage before it, is unordered with respect to the edit's
    write in place: a copy of the buffer per step (a bfloat16 buffer's insert,
    overwrite or pop, then a read of it, in every mode; `copy_sweep.py --dtype
    bfloat16`). A conditional is a user XLA does not fuse into, so the edit is
    computed once, in place, and read after. The conditional costs less than the
    copy it saves: a `(2, 4096)` bfloat16 buffer overwritten then read, 1.37x plain
    `lax`'s forward with the copy, 0.47x in the conditional.
    """
    big = aval.size * aval.dtype.itemsize >= READ_IN_BRANCH_FROM_BYTES
    return big and moved_as_bits(aval.dtype) and not isinstance(value.owner, ir.Block)


def _read_in_branch(ctx, storage: ir.Value, params) -> bool:
    """Whether a read is made in a conditional (`_edited_bits`): not where its
    window is the storage itself (a whole read, not of a ring), which as the
    conditional's result would be a copy of it."""
    aval, window = ctx.avals_in[0], ctx.avals_out[1]
    itself = params.get("ring") is None and window.size >= aval.size
    return not itself and _edited_bits(aval, storage)


def _read_impl_in_branch(storage, tok, *starts, **params):
    """`_read_impl`, in a conditional (`in_branch`) keyed on a start, which
    `run_time_indices` makes a run-time value (a token XLA finds constant would
    fold the conditional away)."""
    read = lambda *args: _read_impl(*args, **params)[1:]
    key = starts[0] if starts else tok
    window, tok = in_branch(read, key, storage, tok, *starts)
    return storage, window, tok


def _define(name: str, impl: Callable, abstract: Callable, n_arrays: int) -> Primitive:
    p = Primitive(name)
    p.multiple_results = True
    impl = tokens_reduced_locally(impl)
    p.def_impl(
        lambda *args, **params: jax.jit(impl, static_argnames=tuple(params))(
            *args, **params
        )
    )
    p.def_abstract_eval(abstract)
    lowered = run_time_indices(impl, n_arrays)
    plain = mlir.lower_fun(lowered, multiple_results=True)
    branched = mlir.lower_fun(
        run_time_indices(_read_impl_in_branch, n_arrays), multiple_results=True
    )
    split = mlir.lower_fun(split_over_devices(lowered, n_arrays), multiple_results=True)

    def lowering(ctx, *args, **params):
        many = params["nbatch"] > 0 and on_several_devices(ctx)
        if not many:
            finished_later(ctx, _FINISH_KIT)
        if not many and name == "esb_read" and ctx.avals_out[2].shape == ():
            # A read of a storage already edited here reads the old value: lowered
            # before the edit, which waits for it (`_xla.edits_of`).
            edits = edits_of(args[0], args[1:], ctx.module_context.module)
            if edits is not None:
                anchor, hooks = edits
                out = lowered_at(anchor, lambda: plain(ctx, *args, **params))
                wait_at_hooks(hooks, out[2])
                return out
        if params.get("wrap") is not None:  # the start resolved first
            ctx, args = _with_wrapped_starts(ctx, args, params.pop("wrap"))
        if (
            not many
            and name == "esb_read"
            and (_deferrable(ctx, **params) or _deferrable_ring_batch(ctx, **params))
        ):
            storage, tok, *starts = args
            sizes, ring = params["sizes"], params.get("ring")

            def gather(storage, starts, ring=ring):
                # The plain gather of a ring's window, or of one window of each
                # batch element's ring, for `deferred_read` (a plain read is a
                # `dynamic_slice`, with no gather).
                assert ring is not None
                sub = ctx.replace(
                    primitive=None,
                    avals_in=[ctx.avals_in[0], *ctx.avals_in[2:]],
                    avals_out=[ctx.avals_out[1]],
                )
                fn = lambda s, *st: [_ring_batch_gather(s, st, sizes, ring)]
                (out,) = mlir.lower_fun(fn, multiple_results=True)(
                    sub, storage, *starts
                )
                return out

            lowered_once_per_call(ctx)
            window, tok = deferred_read(
                storage, tok, starts, sizes, ring, gather, nbatch=params["nbatch"]
            )
            return [storage, window, tok]
        if not many and name == "esb_read" and _deferrable_batch(ctx, **params):
            storage, tok, *starts = args
            tok, *starts = run_time_values([tok, *starts])
            lowered_once_per_call(ctx)
            _, window, after = plain(ctx, storage, tok, *starts, **params)
            window, after = deferred_loop_read(storage, tok, starts, window, after)
            marked_read(storage, after)  # for a later edit to wait for
            return [storage, window, after]
        rotated = None
        if name == "esb_accum" and params.get("ring") is None:
            ctx, args, rotated = rotated_window(ctx, args, params["nbatch"])
            if rotated is None:
                ctx, args = unpadded_window(ctx, args, params["nbatch"])
            else:
                params = dict(params, ring=rotated)
        onto_zeros = False
        if not many:
            fold_cotangent_sum(ctx, args[0], _accum_unordered, unmarked=True)
            # (Not the window of a ring read, whose accumulation
            # `fold_cotangent_sum` would re-lower as an ordinary one; a rotated
            # window's, it re-lowers with its ring.)
            onto_zeros = (
                name == "esb_accum"
                and params["nbatch"] == 0
                and (params.get("ring") is None or rotated is not None)
                and is_zeros(args[0])
            )
            if onto_zeros:
                window, starts = marked_onto_zeros(
                    args[0], args[2], args[3:], ring=rotated
                )
                args = (args[0], args[1], window, *starts)
            args = _after_deferred_reads(ctx, args)
        if not many and name != "esb_read":
            args = (args[0], marked_edit(args[0], args[1]), *args[2:])
        if name == "esb_accum":
            module = ctx.module_context.module
            params = dict(params, scalars=added_in_halves_fused(args[2], module))
        if many:
            out = split(ctx, *args, **params)
        elif name == "esb_read" and _read_in_branch(ctx, args[0], params):
            out = branched(ctx, *args, **params)
        else:
            out = plain(ctx, *args, **params)
        if name == "esb_read" and not many:
            marked_read(args[0], out[2])  # for a later edit to wait for
        if onto_zeros:
            out = [marked_onto_zeros_result(out[0]), *out[1:]]
        return out

    # Not cacheable: JAX would lower each (primitive, types, parameters) once, in a
    # function of its own, and inline copies of it, so that a write's lowering
    # would not see the reads of its storage before it (`_after_deferred_reads`).
    mlir.register_lowering(
        p, lowered_without_explicit_shardings(lowering), cacheable=False
    )
    # The lowering asks how many devices the program runs on (`on_several_devices`),
    # which JAX tells only to the lowerings of primitives it knows to need them.
    # Without this, a sharded batch's accesses are not split over the devices
    # unless some other such primitive (a callback) is in the same program, and XLA
    # all-gathers the buffers (`tests/test_sharding.py`, "edits, unread").
    dispatch.prim_requires_devices_during_lowering.add(p)
    return p


# `n_arrays`: the operands before the indices (storage, token, window/update/value).
read_p = _define("esb_read", _read_impl, _read_abstract, 2)
accum_p = _define("esb_accum", _accum_impl, _accum_abstract, 3)
swap_p = _define("esb_swap", _swap_impl, _swap_abstract, 3)
insert_p = _define("esb_insert", _insert_impl, _insert_abstract, 3)
pop_p = _define("esb_pop", _pop_impl, _pop_abstract, 2)


# ---------------------------------------------------------------------------
# Binding helpers.
#
# Every primitive takes a token and returns one, so the accesses of one buffer form
# a chain of values: a read returns its operand token plus a run-time zero made from
# what it read, a write returns its operand token unchanged. The caller threads the
# token to the next access (a `ShiftBuffer` keeps it as its `_token` leaf). Tokens
# are float32 so that they have tangents and cotangents: the JVP of an access
# threads the *tangent* token through the tangent access, and its transpose threads
# the *cotangent* token backwards through the cotangent access (see the rules
# below). The tangent and cotangent chains are then ordered like the primal one,
# with no trace-time table and no primal token in the linearised program (where it
# would be a residual, saved every step).


def _producer(storage):
    """`(primitive, params)` of the equation that produced `storage` in the
    program being traced, if it is a straight-line write primitive's storage
    output (`_WRITES`); else None. Read off the trace itself, so no state is
    kept; where the trace does not say (eager values, other tracers), None."""
    eqn = getattr(storage, "parent", None)  # jit's tracer: the producing equation
    if eqn is not None and getattr(eqn, "primitive", None) in _WRITES:
        outvars = getattr(eqn, "outvars", ())
        if outvars and outvars[0] is getattr(storage, "val", None):
            return eqn.primitive, eqn.params
    recipe = getattr(storage, "recipe", None)  # partial evaluation (linearize)
    if recipe is not None and getattr(recipe, "primitive", None) in _WRITES:
        refs = getattr(recipe, "out_tracer_refs", ())
        if refs and refs[0]() is storage:
            return recipe.primitive, recipe.params
    return None


def _after_a_whole_line_shift(storage) -> bool:
    """Whether `storage` is the output of an unbatched shift (`insert_p`,
    `pop_p`) of a buffer whose line is the whole buffer (`_whole_line`): a
    `select` over all of it."""
    found = _producer(storage)
    if found is None or found[0] not in (insert_p, pop_p):
        return False
    params = found[1]
    return params["nbatch"] == 0 and _whole_line(jax.typeof(storage), 1, params["axis"])


def _written_by_a_write(storage) -> bool:
    """Whether `storage` is, in the program being traced, the storage output of a
    straight-line write primitive (`accum_p`, `swap_p`, `insert_p`, `pop_p`).
    Where the trace does not say (`_producer`), False: the access is then not
    `ordered`, which costs copies, never values."""
    return _producer(storage) is not None


def _needs_order(storage, ordered: bool) -> bool:
    # See the module docstring, "Which accesses are loops": a shift or accumulation
    # that follows a straight-line write, and cannot write a widened window (it is
    # batched, or its buffer has one line), reads its lines in a loop first.
    return ordered or _written_by_a_write(storage)


def bind_read(
    storage, tok, starts, sizes, nbatch=0, wrap=None, ring=None, residual=False
):
    """`(storage, window, token)`.

    `nbatch` (every helper here): how many leading dimensions of the storage are
    batch dimensions, each indexed by its batch position (`_batch_common`), which
    a sharded program splits over devices (`_partitioned`).

    `wrap = (axis, offset, capacity)`: a read of a ring, whose start along `axis`
    is `(starts[axis] + offset) % capacity`, `starts[axis]` the ring's head
    (`wrapped_starts`). The read's tangent takes the head, not the start: under
    `jax.grad` of a `lax.scan`, the reads of a ring at static offsets (a delay
    line's taps) then save one residual per step, the head, where each would save
    its own start (a stacking kernel per read per step).

    `ring`: the axis along which the window's rows wrap round the end of the
    storage (`bind_swap`); read by a gather.

    `residual`: the primal read of a derivative, whose window may be saved for the
    backward pass (`_deferrable_ring_batch`)."""
    # Without them, the parameters are left out: the equation is as before they
    # existed.
    extra = {} if wrap is None else {"wrap": wrap}
    if ring is not None:
        extra["ring"] = ring
    if residual:
        extra["residual"] = True
    return read_p.bind(
        storage, tok, *starts, sizes=tuple(sizes), nbatch=nbatch, **extra
    )


def bind_accum(storage, tok, window, starts, ordered=False, nbatch=0, ring=None):
    """`(storage, token)`. `ring`: as `bind_swap`'s (a scatter-add)."""
    ordered = _needs_order(storage, ordered)
    extra = {} if ring is None else {"ring": ring}
    return accum_p.bind(
        storage, tok, window, *starts, ordered=ordered, nbatch=nbatch, **extra
    )


def bind_swap(storage, tok, update, starts, read=True, nbatch=0, ring=None, wide=False):
    """`(storage, old window, token)`.

    `ring`: the axis along which the window's rows wrap round the end of the
    storage (a window of a ring, `_ops._ring_update`): row `i` is written at
    `(starts[ring] + i) % storage.shape[ring]`, by a scatter. `wide`: a window
    of one element along a dimension of the buffer is written 2 wide there
    (`widened_write`) whatever the buffer's rank."""
    # Without them, the parameters are left out: the equation is as before they
    # existed.
    extra = {} if ring is None else {"ring": ring}
    if wide and nbatch == 0 and ring is None:
        extra["wide"] = True
    if read and ring is None and nbatch == 0 and _after_a_whole_line_shift(storage):
        # The old window is read in a loop of its own: read through a reduction,
        # XLA:CPU fused the shift's `select` over the whole buffer into it, which
        # then read the buffer from before the shift, unordered with respect to
        # the shift's in-place write: a copy a step (a pop at the back of a ring
        # then an insert beside it, under `grad`: the transposed insert, a shift
        # of the cotangent, then the transposed pop, a swap that reads). Read off
        # each bind's own storage: the rules take `ordered` and do not pass it on.
        extra["ordered"] = True
    return swap_p.bind(storage, tok, update, *starts, read=read, nbatch=nbatch, **extra)


def bind_insert(storage, tok, value, idx, axis, ordered=False, nbatch=0):
    """`(storage, token)`."""
    ordered = _needs_order(storage, ordered)
    return insert_p.bind(
        storage, tok, value, *idx, axis=axis, ordered=ordered, nbatch=nbatch
    )


def bind_pop(storage, tok, idx, axis, fill, read=True, ordered=False, nbatch=0):
    """`(storage, removed, token)`."""
    ordered = _needs_order(storage, ordered)
    return pop_p.bind(
        storage,
        tok,
        *idx,
        axis=axis,
        fill=fill,
        read=read,
        ordered=ordered,
        nbatch=nbatch,
    )


_WRITES = (accum_p, swap_p, insert_p, pop_p)


# ---------------------------------------------------------------------------
# rotate_p: `out[j] = x[(j + shift) % n]` along `axis`, for `shift` in `[0, n]`.
#
# What a ring's whole-line read and write, and `.array`, apply to its storage
# (`_ops.Ring`). Not a buffer access: a value in, a value out. It is a primitive
# for its transpose, the rotation back: as `jnp.take` (a gather, which XLA fuses
# into its consumers) its transpose was a scatter-add into zeros (a delay line's
# whole-window read: the gradient 1.9x plain `lax`'s shift), and as a slice of
# `concatenate([x, x])`, which transposes to a pad and an add, the forward pass
# read the line three times (1.5x plain `lax`). `contents=True`: a rotation of a
# ring's contents (`_ops._rotate`), the identity where the head is 0 (see below);
# its JVP is the same rotation, its transpose a plain one. `ordered=True`: a ring's
# whole line as read, which the next edit waits for (`after_p`); lowered as a
# deferred rotation, made a rotation in a conditional if an edit of the storage
# follows it (`_xla.deferred_rotation`).


def _rotate_impl(x, shift, *, axis, contents=False, ordered=False):
    n = x.shape[axis]
    nb = shift.ndim  # leading batch dimensions of `x`, one shift each
    pos = lax.broadcasted_iota(jnp.int32, shift.shape + (n,), nb)
    pos = pos + shift.astype(jnp.int32)[..., None]
    pos = jnp.where(pos >= n, pos - n, pos)
    pos = pos.reshape(pos.shape + (1,) * (x.ndim - axis - 1))
    pos = pos.reshape(pos.shape[:nb] + (1,) * (axis - nb) + pos.shape[nb:])
    # Moved as bits (see `carrier`): a gather of bfloat16 or float8 on XLA:CPU
    # drops NaN payloads.
    c = to_carrier(x)
    out = jnp.take_along_axis(c, pos, axis=axis, mode="promise_in_bounds")
    if contents and nb == 0:
        # A ring's contents read or written whole (`contents`; not a cotangent
        # rotated back). The head of a ring that only window writes edit (a cache
        # attended over whole at every step) stays in a loop's carry the 0 it
        # started as, which XLA finds: this select is then the line itself, and
        # the gather dead. XLA does not simplify a gather of its operand's own
        # positions: the `kv_cache_attention` corpus body's forward (a `(100, 64)`
        # cache) took 1.8-2x plain `lax`'s. Not on a transpose's rotation: its
        # operand is a cotangent that XLA fused into both the gather and the
        # select, computing it twice for every element (under `esb.scan`, in
        # whose loops XLA cannot see the head to be constant, the cache body's
        # gradient took 4.5x longer). Pinned by `tests/test_ring.py`.
        out = jnp.where((shift == 0) | (shift == n), c, out)
    # Behind a barrier, XLA:CPU keeps the gather's result as it is for its
    # consumer: a delay line's whole-window read and sum then reduces a (K, D)
    # array, where without it the reduction was of the gather's (K, 1, D) output,
    # over three dimensions (the gather is its own fusion either way). Measured,
    # not explained further: `benchmarks/patterns.py`'s `delay_whole` forward,
    # 1.26-1.33x plain `lax`'s shift and sum without the barrier, 0.80-0.92x with.
    out = lax.optimization_barrier(out)
    return from_carrier(out, x.dtype)


def _rotate_abstract(x, shift, *, axis, contents=False, ordered=False):
    return x


rotate_p = Primitive("esb_rotate")
rotate_p.def_impl(
    lambda x, shift, **params: jax.jit(_rotate_impl, static_argnames=tuple(params))(
        x, shift, **params
    )
)
rotate_p.def_abstract_eval(_rotate_abstract)


def _rotated_in_branch(x, shift, key=None, *, axis):
    """A ring's contents, rotated in a conditional (`in_branch`, keyed on `key`,
    by default `shift`; they are a new array either way), which XLA writes out
    once instead of fusing it into its readers. A head XLA finds constant (only
    window writes edit the ring) folds the conditional away, and the rotation
    with it (`_rotate_impl`), unless the key is rekeyed (`_xla.rotation_key`)."""
    rotate = lambda x, shift: _rotate_impl(x, shift, axis=axis, contents=True)
    return in_branch(rotate, shift if key is None else key, x, shift)


def _rotate_lowering(ctx, x, shift, *, axis, contents=False, ordered=False):
    if contents and _edited_bits(ctx.avals_in[0], x):
        # A ring's contents read whole right after an edit of it moved as bits (a
        # bfloat16 delay line's `insert(0, x)`, then `read()`): see `_edited_bits`.
        impl = functools.partial(_rotated_in_branch, axis=axis)
        return mlir.lower_fun(impl, multiple_results=False)(ctx, x, shift)
    impl = functools.partial(_rotate_impl, axis=axis, contents=contents)
    x_aval, shift_aval = ctx.avals_in
    batched = shift_aval.ndim > 0
    on_zeros = (
        None
        if contents or batched or moved_as_bits(x_aval.dtype)
        else (window_on_zeros(x) or (x, [0] * x_aval.ndim))
    )
    if on_zeros is not None:
        # A cotangent rotated back (the transpose of a ring's contents read): marked
        # for the accumulation of the result to add it unrotated, at its rotated
        # start, its rows wrapping (`_xla.rotated_window`): a scatter-add in place.
        # A window on zeros (a slice's cotangent) is added alone. The whole line
        # (a delay line read whole) was gathered into a new array, then added to
        # the buffer's cotangent in a single-trip loop: the backward pass 1.2-1.3x
        # plain `lax`'s shift and add (`delay_whole`, `delay_read_first`), 0.75x
        # as a scatter-add. Added in place without the loop (fused with the
        # gather), XLA fused the add into the next edit's read too and copied
        # the batch of cotangents every step under `vmap(grad)`.
        window, at = on_zeros
        dynamic = [a for a in at if not isinstance(a, int)]
        w_shape = ir.RankedTensorType(window.type).shape
        n = x_aval.shape[axis]

        def rotated_and_starts(x, shift, *dynamic):
            it = iter(dynamic)
            starts = []
            for d, a in enumerate(at):
                if not isinstance(a, int):  # clamped, as `dynamic_update_slice`
                    hi = x_aval.shape[d] - w_shape[d]
                    a = jnp.clip(next(it).astype(jnp.int32), 0, hi)
                starts.append(jnp.asarray(a, jnp.int32))
            p = starts[axis] - shift.astype(jnp.int32)
            starts[axis] = jnp.where(p < 0, p + n, p)
            return [impl(x, shift), *starts]

        int32 = ShapedArray((), jnp.dtype(jnp.int32))
        sub = ctx.replace(
            avals_in=[*ctx.avals_in, *(aval_of(v) for v in dynamic)],
            avals_out=[*ctx.avals_out, *[int32] * len(at)],
        )
        out, *starts = mlir.lower_fun(rotated_and_starts, multiple_results=True)(
            sub, x, shift, *dynamic
        )
        rotated_on_zeros(out, window, starts, axis)
        return [out]
    if not ordered or (batched and on_several_devices(ctx)) or on_explicit_mesh(x_aval):
        # (Not for a batch of rings, each with its own head, split over devices:
        # the conditional's predicate would be made from one device's head; nor
        # where the types carry shardings, which its branches would have to
        # match.)
        return mlir.lower_fun(impl, multiple_results=False)(ctx, x, shift)
    # A read the next edit waits for (`after_p`): in a conditional if an edit
    # follows it (`deferred_rotation`), lowered beside it.
    key = rotation_key(shift)
    both = lambda x, shift, key: [
        impl(x, shift),
        _rotated_in_branch(x, shift, key, axis=axis),
    ]
    sub = ctx.replace(avals_in=[*ctx.avals_in, ctx.avals_in[1]])
    rotated, in_a_branch = mlir.lower_fun(both, multiple_results=True)(
        sub, x, shift, key
    )
    lowered_once_per_call(ctx)
    return [deferred_rotation(x, rotated, in_a_branch, key)]


# Not cacheable: JAX would lower it in a function of its own, whose operand is an
# argument there (`_edited_bits`).
mlir.register_lowering(rotate_p, _rotate_lowering, cacheable=False)
dispatch.prim_requires_devices_during_lowering.add(rotate_p)  # `on_several_devices`


def _rotate_jvp(primals, tangents, **params):
    x, shift = primals
    out = rotate_p.bind(x, shift, **params)
    if type(tangents[0]) is ad.Zero:
        return out, _zero_tangent(out)
    return out, rotate_p.bind(tangents[0], shift, **params)


def _rotate_transpose(ct, x, shift, *, axis, contents=False, ordered=False):
    del contents, ordered
    if type(ct) is ad.Zero:
        return [ad.Zero(_aval(x)), None]
    n = _aval(x).shape[axis]
    return [rotate_p.bind(ct, n - shift, axis=axis), None]


def _rotate_batch(args, dims, *, axis, **params):
    x, shift = args
    xd, sd = dims
    size = x.shape[xd] if xd is not None else shift.shape[sd]
    x = _move_front(x, xd, size)
    if sd is None:
        # One shift for the whole batch (a batch of rings whose heads move
        # together; a batch of caches whose head never moves): rotated as one
        # array, so that `contents`' select still applies. With the shift
        # broadcast, a batch of `kv_cache_attention` caches was gathered whole
        # every step (its forward under `vmap` 2.1x plain `lax`).
        return rotate_p.bind(x, shift, axis=axis + 1, **params), 0
    # The batch dimension leads both operands, one more of `_rotate_impl`'s `nb`.
    shift = _move_front(shift, sd, size)
    return rotate_p.bind(x, shift, axis=axis + 1, **params), 0


ad.primitive_jvps[rotate_p] = _rotate_jvp
ad.primitive_transposes[rotate_p] = _rotate_transpose
batching.primitive_batchers[rotate_p] = _rotate_batch


# ---------------------------------------------------------------------------
# after_p: `tok`, as a token that also waits for the value `x`, a ring's whole
# line as read (`rotate_p`'s `ordered`): the next edit runs after `x` is computed.
# `key`: the ring's head; where XLA finds it 0, `x` is the storage itself and the
# token does not wait for it.
#
# A ring's whole line read (`_ops._ring_read`) is `read_p`'s window, the storage
# itself, then `rotate_p`: read_p's token orders the next edit after nothing that
# reads the storage. An edit after it (a delay line's `read()` then `insert(0,
# x)`) wrote in place while the rotation, fused into its readers, still read the
# storage: XLA copied the buffer (2 a step forward, 2 under `grad` and 4 under
# `jvp`, where plain `lax` copies 1, 2 and 2: the natural pattern
# `delay_read_first`). The rotation is deferred
# (`_xla.deferred_rotation`): an edit of the storage in the same function makes
# it a rotation in a conditional and waits for it (`.array` too, whose buffer is
# not carried on); this token is what an edit in a function called with the
# buffer (a `jax.jit` inside the step) waits for. Lowered as `tok` itself until
# such an edit follows (`_xla.deferred_token`): made from the plain rotation, it
# was a second reader of it, and the gradient of a delay line's `insert(0, x)`
# then `read()`, with no edit after the read, took 1.2x as long.
#
# Linear in `(tok, x)` with coefficient zero for `x`, as the accesses are in their
# token: the tangent token waits for the tangent value, and the cotangent passes
# to `tok` alone.


def _after_impl(tok, x, key, *, nbatch=0):
    # `nbatch` leading dimensions, shared by all three: one token per batch
    # element, each made from an element of its own (`opaque_zero`'s `nlead`: a
    # batch sharded over devices is not sliced across them). Folded to 0 where
    # XLA finds the head 0, as `rotate_p` folds to the storage: a token made from
    # the storage's first element, right after a write of it (a cache's), would
    # make XLA compute that element again from the storage before the write,
    # unordered with respect to it.
    return tok + opaque_zero(x, nbatch, folded_where=key == 0).astype(tok.dtype)


def _after_abstract(tok, x, key, *, nbatch=0):
    return tok


after_p = Primitive("esb_after")
after_p.def_impl(
    lambda tok, x, key, **params: jax.jit(_after_impl, static_argnames="nbatch")(
        tok, x, key, **params
    )
)
after_p.def_abstract_eval(_after_abstract)


def _after_lowering(ctx, tok, x, key, **params):
    branched = rotation_in_a_branch(x)
    if branched is None:
        # Not a deferred rotation (one rotated in a conditional anyway, or one
        # `_rotate_lowering` does not defer: a batch of rings split over devices,
        # types with shardings): the token as it was.
        return [tok]
    # A deferred rotation (`deferred_rotation`): the token waits for it only once
    # an edit follows it, and then for the rotation in a conditional.
    plain = mlir.lower_fun(functools.partial(_after_impl, **params), False)
    (waiting,) = plain(ctx, tok, branched, key)
    return [deferred_token(x, tok, waiting)]


# Not cacheable: JAX would lower it in a function of its own, whose operand is an
# argument there, not the rotation's mark.
mlir.register_lowering(after_p, _after_lowering, cacheable=False)


def _after_jvp(primals, tangents, **params):
    tok, x, key = primals
    out = after_p.bind(tok, x, key, **params)
    tt, tx = tangents[0], tangents[1]
    if _all_zero(tt, tx):
        return out, _zero_tangent(out)
    return out, after_p.bind(_inst(tt, tok), _inst(tx, x), key, **params)


def _after_transpose(ct, tok, x, key, **params):
    ct_x = ad.Zero(_aval(x)) if ad.is_undefined_primal(x) else None
    return [_tok_ct(tok, ct), ct_x, None]


def _after_batch(args, dims, *, nbatch=0):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    tok, x, key = (_move_front(a, d, size) for a, d in zip(args, dims))
    return after_p.bind(tok, x, key, nbatch=nbatch + 1), 0


ad.primitive_jvps[after_p] = _after_jvp
ad.primitive_transposes[after_p] = _after_transpose
batching.primitive_batchers[after_p] = _after_batch


# ---------------------------------------------------------------------------
# JVP rules. Every primitive is affine in its array operands (linear, except the
# constant `fill` of `pop_p`), so the tangent map is the primitive itself applied to
# the tangents, with `fill=0`. The token is linear too, with coefficient zero: no
# output's value depends on it (it is zero), only when the access runs. The tangent
# access takes the tangent token and returns the tangent of the output token.


def _zero_tangent(x):
    return ad.Zero(jax.typeof(x).to_tangent_aval())


def _zeros_like_aval(x):
    """Zeros of the type `x` (an aval or array): inside a `shard_map`, varying over
    the same axes, as its checks require of a tangent or cotangent; on a mesh with
    explicit axes, sharded as `x` is (a cotangent of a batch sharded over devices
    must have its type)."""
    aval = jax.typeof(x) if isinstance(x, jax.Array) else x
    z = lax.full(aval.shape, 0, aval.dtype, sharding=explicit_sharding(aval))
    axes = tuple(sorted(varying_axes_of_aval(x)))
    return jax.lax.pcast(z, axes, to="varying") if axes else z


def _inst(t, primal):
    return _zeros_like_aval(primal) if type(t) is ad.Zero else t


def _all_zero(*ts):
    return all(type(t) is ad.Zero for t in ts)


def _read_jvp(
    primals, tangents, *, sizes, nbatch, wrap=None, ring=None, residual=False
):
    storage, tok, *starts = primals
    # The primal window may be saved for the backward pass (`residual`).
    out = bind_read(storage, tok, starts, sizes, nbatch, wrap, ring, residual=True)
    ts, tt = tangents[0], tangents[1]
    if type(ts) is ad.Zero:
        return out, [_zero_tangent(out[0]), _zero_tangent(out[1]), tt]
    return out, list(bind_read(ts, _inst(tt, tok), starts, sizes, nbatch, wrap, ring))


def _accum_jvp(primals, tangents, *, ordered, nbatch, ring=None):
    storage, tok, window, *starts = primals
    extra = {} if ring is None else {"ring": ring}
    out = accum_p.bind(
        storage, tok, window, *starts, ordered=ordered, nbatch=nbatch, **extra
    )
    ts, tt, tw = tangents[0], tangents[1], tangents[2]
    if _all_zero(ts, tw):
        return out, [_zero_tangent(out[0]), tt]
    t_out = bind_accum(
        _inst(ts, storage),
        _inst(tt, tok),
        _inst(tw, window),
        starts,
        ordered,
        nbatch,
        ring,
    )
    return out, list(t_out)


def _swap_jvp(primals, tangents, *, read, nbatch, ring=None, ordered=False, wide=False):
    storage, tok, update, *starts = primals
    out = bind_swap(storage, tok, update, starts, read, nbatch, ring, wide)
    ts, tt, tu = tangents[0], tangents[1], tangents[2]
    if _all_zero(ts, tu):
        return out, [_zero_tangent(out[0]), _zero_tangent(out[1]), tt]
    ts, tu = _inst(ts, storage), _inst(tu, update)
    # The tangent's write is widened (`widened_write`) on a buffer of 2 dimensions
    # too: written as its window, a row of a `(T, D)` buffer written then a
    # window of several rows read (a local-attention cache), XLA fused the
    # tangent's write into the tangent window's read, which then read the
    # tangent buffer from before the write: 2 copies a step under `jvp`, where
    # the primal's identical write and read copied nothing.
    t_out = bind_swap(ts, _inst(tt, tok), tu, starts, read, nbatch, ring, True)
    return out, list(t_out)


def _insert_jvp(primals, tangents, *, axis, ordered, nbatch):
    storage, tok, value, *idx = primals
    out = insert_p.bind(
        storage, tok, value, *idx, axis=axis, ordered=ordered, nbatch=nbatch
    )
    ts, tt, tv = tangents[0], tangents[1], tangents[2]
    if _all_zero(ts, tv):
        return out, [_zero_tangent(out[0]), tt]
    t_out = bind_insert(
        _inst(ts, storage),
        _inst(tt, tok),
        _inst(tv, value),
        idx,
        axis,
        ordered,
        nbatch,
    )
    return out, list(t_out)


def _pop_jvp(primals, tangents, *, axis, fill, read, ordered, nbatch):
    storage, tok, *idx = primals
    out = pop_p.bind(
        storage,
        tok,
        *idx,
        axis=axis,
        fill=fill,
        read=read,
        ordered=ordered,
        nbatch=nbatch,
    )
    ts, tt = tangents[0], tangents[1]
    if type(ts) is ad.Zero:
        return out, [_zero_tangent(out[0]), _zero_tangent(out[1]), tt]
    t_out = bind_pop(ts, _inst(tt, tok), idx, axis, 0, read, ordered, nbatch)
    return out, list(t_out)


ad.primitive_jvps[read_p] = _read_jvp
ad.primitive_jvps[accum_p] = _accum_jvp
ad.primitive_jvps[swap_p] = _swap_jvp
ad.primitive_jvps[insert_p] = _insert_jvp
ad.primitive_jvps[pop_p] = _pop_jvp


# ---------------------------------------------------------------------------
# Transpose rules. The storage, the token and the value/window/update operands may
# be linear; the indices are always known. The cotangent of the output token is the
# token of the cotangent accesses transposed before this one (those of the later
# accesses): the cotangent access takes it, and the token it returns is the
# cotangent of the input token, for the cotangent accesses transposed after it.


def _ct_or_zeros(ct, aval):
    if type(ct) is ad.Zero:
        return _zeros_like_aval(aval)
    return ct


def _aval(x):
    return x.aval if ad.is_undefined_primal(x) else jax.typeof(x)


def _tok_ct(tok, ct):
    """The cotangent of the token operand `tok`: `ct` if `tok` is linear."""
    return ct if ad.is_undefined_primal(tok) else None


def _read_transpose(
    cts, storage, tok, *starts, sizes, nbatch, wrap=None, ring=None, residual=False
):
    ct_s, ct_w, ct_t = cts
    if _all_zero(ct_s, ct_w):
        return [ad.Zero(_aval(storage)), _tok_ct(tok, ct_t)] + [None] * len(starts)
    batch = _aval(storage).shape[:nbatch]
    if type(ct_s) is ad.Zero and nbatch and ct_w.shape[:nbatch] == batch:
        # A batch of windows whose buffers were dropped: accumulated onto zeros
        # of their own (`_unmerged`). Unbatched, the accumulation onto zeros is
        # folded into the sum JAX makes of the buffer's cotangents instead
        # (`_xla.fold_cotangent_sum`).
        ct_s = _unmerged(_zeros_like_aval(_aval(storage)), ct_w, nbatch)
    elif type(ct_s) is ad.Zero and not nbatch and _aval(ct_w).ndim > len(sizes):
        # Windows at batched starts of one buffer (`grad` of a `vmap` over the
        # inputs only), whose buffer was dropped: accumulated onto zeros of their
        # own, as above, with one condition for the batch (a reduction over it, so
        # that a batch sharded over devices is not sliced).
        zero = jnp.max(opaque_zero(ct_w, _aval(ct_w).ndim - len(sizes)))
        ct_s = _unmerged(_zeros_like_aval(_aval(storage)), zero, 0)
    ct_s = _ct_or_zeros(ct_s, _aval(storage))
    t = _ct_or_zeros(ct_t, _aval(tok))
    if type(ct_w) is not ad.Zero:
        at = wrapped_starts(starts, wrap)
        ct_s, t = bind_accum(ct_s, t, ct_w, at, nbatch=nbatch, ring=ring)
    return [ct_s, _tok_ct(tok, t)] + [None] * len(starts)


def _accum_transpose(cts, storage, tok, window, *starts, ordered, nbatch, ring=None):
    ct_s, ct_t = cts
    if type(ct_s) is ad.Zero:
        return [ct_s, _tok_ct(tok, ct_t), ad.Zero(_aval(window))] + [None] * len(starts)
    sizes = _aval(window).shape[len(starts[0].shape) :]
    t = _ct_or_zeros(ct_t, _aval(tok))
    ct_s, ct_w, t = bind_read(ct_s, t, starts, sizes, nbatch, ring=ring)
    ct_st = ct_s if ad.is_undefined_primal(storage) else None
    ct_wt = ct_w if ad.is_undefined_primal(window) else None
    return [ct_st, _tok_ct(tok, t), ct_wt] + [None] * len(starts)


def _swap_transpose(
    cts,
    storage,
    tok,
    update,
    *starts,
    read,
    nbatch,
    ring=None,
    ordered=False,
    wide=False,
):
    ct_s, ct_old, ct_t = cts
    if _all_zero(ct_s, ct_old):
        return [
            ad.Zero(_aval(storage)),
            _tok_ct(tok, ct_t),
            ad.Zero(_aval(update)),
        ] + [None] * len(starts)
    ct_s = _ct_or_zeros(ct_s, _aval(storage))
    # Without `read`, the old window was discarded: its cotangent is zero, and the
    # transpose writes zeros where the update went (and reads out its cotangent).
    ct_old = (
        _ct_or_zeros(ct_old, _aval(update)) if read else _zeros_like_aval(_aval(update))
    )
    t = _ct_or_zeros(ct_t, _aval(tok))
    ct_s, ct_u, t = bind_swap(ct_s, t, ct_old, starts, True, nbatch, ring)
    return [ct_s, _tok_ct(tok, t), ct_u] + [None] * len(starts)


def _insert_transpose(cts, storage, tok, value, *idx, axis, ordered, nbatch):
    ct_s, ct_t = cts
    if type(ct_s) is ad.Zero:
        return [ct_s, _tok_ct(tok, ct_t), ad.Zero(_aval(value))] + [None] * len(idx)
    t = _ct_or_zeros(ct_t, _aval(tok))
    ct_s, ct_v, t = bind_pop(ct_s, t, idx, axis, 0, nbatch=nbatch)
    return [ct_s, _tok_ct(tok, t), ct_v] + [None] * len(idx)


def _pop_transpose(cts, storage, tok, *idx, axis, fill, read, ordered, nbatch):
    ct_s, ct_v, ct_t = cts
    if _all_zero(ct_s, ct_v):
        return [ad.Zero(_aval(storage)), _tok_ct(tok, ct_t)] + [None] * len(idx)
    s_aval = _aval(storage)
    ct_s = _ct_or_zeros(ct_s, s_aval)
    vshape = tuple(idx[0].shape) + s_aval.shape[axis + 1 :]
    if read:
        ct_v = _ct_or_zeros(ct_v, s_aval.update(shape=vshape))
    else:  # a delete: its `removed` output is a constant, with no cotangent
        ct_v = _zeros_like_aval(s_aval.update(shape=vshape))
    t = _ct_or_zeros(ct_t, _aval(tok))
    ct_s, t = bind_insert(ct_s, t, ct_v, idx, axis, nbatch=nbatch)
    return [ct_s, _tok_ct(tok, t)] + [None] * len(idx)


ad.primitive_transposes[read_p] = _read_transpose
ad.primitive_transposes[accum_p] = _accum_transpose
ad.primitive_transposes[swap_p] = _swap_transpose
ad.primitive_transposes[insert_p] = _insert_transpose
ad.primitive_transposes[pop_p] = _pop_transpose


# ---------------------------------------------------------------------------
# Under `jax.checkpoint`.


def _edit_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """Under `jax.checkpoint` (and a scan in one): an access whose operands are all
    known runs in the forward pass only, and what the rematerialised pass needs of
    its outputs (a window, a popped value, a token) is saved, never recomputed.

    By default JAX reruns an access in the rematerialised pass, from its storage,
    whatever `saveable` says of the outputs' types, so the storage from before the
    step is saved: a buffer-sized residual per step of `lax.scan(jax.checkpoint(step))`,
    and, because JAX's stacking of that residual reads the buffer unordered with
    respect to the step's first edit, a copy of the buffer per step (1-2 per step
    under `grad`, `copy_sweep.py --kind remat`). The accesses' tangents and
    transposes need no storage (each is affine in it), so the rematerialised pass
    needs only what the user's code computes from the outputs, O(window). The
    storage output is saved only if code outside this library uses it there (a
    whole-buffer read the user differentiates through, as it would be otherwise).
    An access with an unknown operand (a tangent) is staged, as by default."""
    del saveable
    n = len(eqn.outvars)
    if any(unks_in):
        res = [v for v, i in zip(eqn.invars, inst_in, strict=True) if not i]
        return None, eqn, [True] * n, [True] * n, res
    return eqn, None, [False] * n, [False] * n, []


for _p in (read_p, accum_p, swap_p, insert_p, pop_p, after_p):
    pe.partial_eval_jaxpr_custom_rules[_p] = _edit_partial_eval_custom


def _rotate_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """A ring's whole line as read (`ordered`) runs in the forward pass only, as an
    access does (`_edit_partial_eval_custom`), and its rotation is saved: saved as
    read, the window is the storage itself, and JAX's stacking of it as a residual
    read the storage unordered with respect to the step's edit after the read (2
    copies a step under `grad` of `lax.scan(jax.checkpoint(step))` for a delay
    line's `read()` then `insert(0, x)`). Any other rotation as JAX does it by
    default: saved if `saveable` says so, else rerun from its operands (also
    where the policy would offload it, which this rule does not do)."""
    n = len(eqn.outvars)
    if any(unks_in) or eqn.params.get("ordered"):
        return _edit_partial_eval_custom(saveable, unks_in, inst_in, eqn)
    policy = saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    if isinstance(pe.ensure_enum(policy), pe.SaveableType):
        return eqn, None, [False] * n, [False] * n, []
    res = [v for v, i in zip(eqn.invars, inst_in, strict=True) if not i]
    return eqn, eqn, [False] * n, [True] * n, res


pe.partial_eval_jaxpr_custom_rules[rotate_p] = _rotate_partial_eval_custom


# ---------------------------------------------------------------------------
# Batching rules.
#
# Storage batched along `bd`: move it to the front, and index it with the batch
# position, so that the new index arrays have shape `(B,) + S`. An unbatched storage
# with batched indices or values is broadcast only when the primitive writes (each
# batch element then needs its own buffer); a read from an unbatched storage simply
# reads `B` windows. A batched token (a batch of buffers, each with its own) is
# reduced to one: the batch's accesses run in one loop, after all of them; except
# that a batch sharded over devices keeps one token per element, reduced by each
# device for its own elements (`tokens_per_element`). The token result is batched
# (at 0) exactly when it is not a scalar.


def _move_front(x, bd, size):
    if bd is None:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, bd, 0)


def _unmerged(b: jax.Array, like: jax.Array, nlead: int) -> jax.Array:
    """`b`, selected by a condition XLA cannot fold (true at run time) computed from
    `like`, an operand of the write into `b`: their first `nlead` dimensions are
    batch dimensions, shared. So that XLA does not merge `b`, a broadcast, with an
    equal one elsewhere: two batched writes onto one broadcast (the cotangents of
    two `dynamic_slice` windows in a loop body, accumulated onto the zeros of the
    dropped buffer's cotangent, under `vmap(grad)` or `grad(vmap)`; one in each
    step of an unrolled scan) each got a copy of it, every step.

    The condition is per batch element (`opaque_zero`), so that a batch sharded
    over devices is not sliced across them; selected as bits (`carrier`), so
    exact."""
    dtype, b = b.dtype, to_carrier(b)
    zero = opaque_zero(like, nlead)
    zero = zero.reshape(zero.shape + (1,) * (b.ndim - nlead))
    other = jnp.broadcast_to((zero + 1).astype(b.dtype), b.shape)
    return from_carrier(jnp.where(zero == 0, b, other), dtype)


def _batch_common(args, dims, n_leading: int, write: bool):
    """Normalise (storage, tok, *values[:n_leading], *idx) for a batched call.

    Returns (storage, tok, values, idx, storage_batched) where all idx have shape
    `(B,) + S`, values `(B,) + S + vshape`, and storage is batched at axis 0 if it
    was batched or if `write`.
    """
    storage, tok, *rest = args
    sdim, tdim, *rdims = dims
    values, idx = rest[:n_leading], rest[n_leading:]
    vdims, idims = rdims[:n_leading], rdims[n_leading:]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    storage_batched = sdim is not None or write
    if storage_batched and tokens_per_element(tok, tdim):
        tok = _move_front(tok, tdim, size)  # the storage's batch dimensions
    elif tdim is not None and jnp.ndim(tok) == 1:
        tok = jnp.max(jnp.moveaxis(tok, tdim, 0).reshape(size, -1), axis=0)[0]
    elif jnp.ndim(tok) > 0:
        tok = jnp.max(tok)
    i0, d0 = idx[0], idims[0]
    bshape = tuple(i0.shape) if d0 is None else i0.shape[:d0] + i0.shape[d0 + 1 :]
    idx = [
        _move_front(i, d, size).reshape((size,) + bshape) for i, d in zip(idx, idims)
    ]
    if storage_batched and sdim is None:
        like, ldim = next((a, d) for a, d in zip(args, dims) if d is not None)
        storage = jnp.broadcast_to(storage, (size,) + storage.shape)
        storage = _unmerged(storage, jnp.moveaxis(like, ldim, 0), 1)
    elif storage_batched:
        storage = _move_front(storage, sdim, size)
    if storage_batched:
        pos = lax.broadcasted_iota(idx[0].dtype, (size,) + bshape, 0)
        idx = [pos] + idx
    values = [_move_front(v, d, size) for v, d in zip(values, vdims)]
    return storage, tok, values, idx, storage_batched


def _tdim(tok) -> int | None:
    return 0 if jnp.ndim(tok) else None


def _read_batch(args, dims, *, sizes, nbatch, wrap=None, ring=None, residual=False):
    if _same_window_of_each_element(args, dims, nbatch, 0):
        return _read_across_the_batch(args, dims, sizes, wrap, ring)
    if wrap is not None:  # the start resolved, on the batch of heads
        storage, tok, *starts = args
        args = (storage, tok, *wrapped_starts(starts, wrap))
    storage, tok, _, idx, sb = _batch_common(args, dims, 0, write=False)
    if sb:
        sizes = (1,) + tuple(sizes)
        ring = None if ring is None else ring + 1  # the storage's new leading axis
    # A read of an unbatched storage at batched indices is not split over devices.
    nb = nbatch + 1 if sb else 0
    s, w, t = bind_read(storage, tok, idx, sizes, nb, ring=ring, residual=residual)
    if sb:
        w = w.reshape(w.shape[: len(idx[0].shape)] + w.shape[len(idx[0].shape) + 1 :])
    return (s, w, t), (0 if sb else None, 0, _tdim(t))


def _same_window_of_each_element(args, dims, nbatch: int, n_leading: int) -> bool:
    """Whether a batched access (`n_leading` value operands after the storage and
    token, then the starts) touches the same window of each batch element's
    buffer: the storage batched, its starts not (a Python-int index, a delay
    line's taps at static offsets from a head the batch shares), on one device,
    the token a scalar (`tokens_per_element`), of a dtype XLA:CPU moves exactly.
    A bfloat16 or float8 buffer (`moved_as_bits`) keeps one access per element:
    across the batch, an overwrite then a read, slice or `.array` (`copy_sweep.py`'s
    `dus_read`, `dus_ds`, `dus_arr` on `(2, 4096)` and `(16, 64, 32)`), and an
    insert then a read at a negative Python int of a one-line buffer, copied the
    batch of buffers every step under `vmap` (1), `vmap(grad)` (1) and
    `jvp(vmap)` (2)."""
    storage, tok, *_ = args
    sdim, tdim, *rest = dims
    return (
        nbatch == 0
        and sdim is not None
        and all(d is None for d in rest[n_leading:])
        and not tokens_per_element(tok, tdim)
        and not on_explicit_mesh(jax.typeof(storage))
        and not moved_as_bits(storage.dtype)
    )


def _across_the_batch(storage, sdim, tok, tdim, starts, wrap, ring):
    """`(storage, tok, starts, wrap, ring)` for an unbatched access of the window
    that a batched one touches in every batch element
    (`_same_window_of_each_element`): the storage's batch dimension moved first
    and spanned by the window, which starts at 0 along it.

    Plain `lax` makes one `dynamic_slice` or `dynamic_update_slice` of an
    unbatched index under `vmap`; one access per element was a loop over the batch
    for a read (`_read_impl`; a batch of delay lines' eleven taps ran eleven loops
    a step) and a scatter for a write. As gathers instead of loops, the taps were
    2.2x slower still: XLA:CPU fused each into its consumer and split those over
    threads (the whole batch of buffers counted as the bytes each reads).

    Reads and overwrites only. An accumulation across the batch (a shared read's
    transpose under `vmap(grad)`) was not folded into the sum of a buffer's two
    cotangents (`_xla.fold_cotangent_sum`) where a read and an insert at
    Python ints near the back of a one-line buffer both used it, and XLA copied
    the batch of buffers every step (`copy_sweep.py`'s `ds_ins`, `pyneg`;
    `tests/test_vmap.py`). One per element, `delay_taps`' `vmap(grad)` is 0.11x
    plain `lax` where it was 0.08x across the batch (0.18x before)."""
    storage = jnp.moveaxis(storage, sdim, 0)
    if tdim is not None:  # one token for the batch, as `_batch_common` reduces it
        tok = jnp.max(tok)
    # The new start's type is the other starts' (a ring's head, resolved into its
    # start by `wrapped_starts`, may be a float).
    ints = [st for k, st in enumerate(starts) if wrap is None or k != wrap[0]]
    zero = jnp.zeros((), jnp.result_type(*ints) if ints else jnp.int32)
    if wrap is not None:
        wrap = (wrap[0] + 1, *wrap[1:])  # the storage's new leading axis
    ring = None if ring is None else ring + 1
    return storage, tok, [zero, *starts], wrap, ring


def _read_across_the_batch(args, dims, sizes, wrap, ring):
    storage, tok, *starts = args
    storage, tok, starts, wrap, ring = _across_the_batch(
        storage, dims[0], tok, dims[1], starts, wrap, ring
    )
    sizes = (storage.shape[0], *sizes)
    s, w, t = bind_read(storage, tok, starts, sizes, 0, wrap=wrap, ring=ring)
    return (s, w, t), (0, 0, None)


def broadcast_operand(x) -> Any:
    """What `x` was broadcast from, in the program being traced: the operand of
    the `broadcast_in_dim` equation that produced it, or None. Read off the trace
    itself (as `_producer`), so no state is kept; where the trace does not say,
    None."""
    eqn = getattr(x, "parent", None)  # jit's tracer: the producing equation
    if eqn is None or getattr(eqn, "primitive", None) is not lax.broadcast_in_dim_p:
        return None
    invars = getattr(eqn, "invars", ())
    return invars[0] if invars else None


def _literal_zeros(x) -> bool:
    """Whether `x` is, in the program being traced, zeros broadcast from a literal
    (as `_zeros_like_aval` makes the cotangent of a dropped buffer)."""
    literal = getattr(broadcast_operand(x), "val", None)
    value = getattr(literal, "val", None)
    return type(literal).__name__ == "Literal" and bool(np.all(np.asarray(value) == 0))


def _windows_onto_zeros(args, dims, *, ordered, nbatch, ring=None):
    """The batched accumulation of one window for each batch element onto
    unbatched zeros (`_literal_zeros`), as a scatter-add onto the batch of zeros,
    or None where that does not apply.

    That is the transpose of a `dynamic_slice` under `vmap(grad)`: the read's
    buffer was dropped, and its cotangent is its window's, accumulated onto zeros,
    which JAX then adds to the rest of the buffer's cotangent. XLA turns `rest +
    scatter-add(zeros, ...)` into a scatter-add into `rest`, in place; accumulated
    in a loop over the batch (onto zeros selected so that XLA does not merge them,
    `_unmerged`), the sum was written out of place: a copy of the batch of
    buffers every step (a delay line's taps read with `dynamic_slice` before its
    `insert(0, x)`: 2.3-2.7x plain `lax`'s time)."""
    storage, tok, window, *starts = args
    sdim, tdim, wdim, *idims = dims
    shape = tuple(jnp.shape(storage))
    if (
        sdim is not None
        or wdim is None
        or jnp.ndim(window) != len(shape) + 1
        or moved_as_bits(jnp.result_type(storage))
        or nbatch != 0
        or ring is not None
        or jnp.ndim(tok) != 0
        or not starts
        or explicit_sharding(jax.typeof(storage)) is not None
        or varying_axes_of_aval(jax.typeof(storage))
        or not _literal_zeros(storage)
    ):
        return None
    del ordered  # (onto fresh zeros: nothing to order against)
    size = window.shape[wdim]
    w = jnp.moveaxis(window, wdim, 0).astype(storage.dtype)
    if w.shape[1:] == shape:
        # Each element's window is the whole buffer (`.array` of a buffer the
        # batch has made its own): the sum is the windows. Scattered, XLA copied
        # the batch of cotangents every step under `vmap(grad)` of `.array` then
        # a whole-buffer `dynamic_update_slice` of a `(1, n)` buffer (3 against
        # plain `lax`'s 2).
        return (w, tok), (0, tdim)
    dtype = jnp.result_type(*starts)
    st = [_move_front(jnp.asarray(i, dtype), d, size) for i, d in zip(starts, idims)]
    indices = jnp.stack([lax.iota(dtype, size), *st], axis=-1)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, len(shape) + 1)),
        inserted_window_dims=(0,),
        scatter_dims_to_operand_dims=tuple(range(len(shape) + 1)),
    )
    zeros = jnp.zeros((size,) + shape, storage.dtype)
    out = lax.scatter_add(zeros, indices, w, dnums, mode=lax.GatherScatterMode.CLIP)
    return (out, tok), (0, tdim)


def _accum_batch(args, dims, *, ordered, nbatch, ring=None):
    onto_zeros = _windows_onto_zeros(
        args, dims, ordered=ordered, nbatch=nbatch, ring=ring
    )
    if onto_zeros is not None:
        return onto_zeros
    storage, tok, window, *starts = args
    sdim, tdim, wdim = dims[:3]
    unbatched = lambda x, d: tuple(n for k, n in enumerate(x.shape) if k != d)
    if (
        ring is None
        and _same_window_of_each_element(args, dims, nbatch, 1)
        and unbatched(window, wdim) == unbatched(storage, sdim)
    ):
        # Each element's whole buffer (a whole read's transpose, the buffer
        # batched, the read not): one whole-buffer add across the batch, in place
        # in halves (`added_in_halves`). Through `_batch_common` it was an add per
        # element in a loop over the batch, which XLA copied (the batch of
        # cotangents, every step, under `vmap(grad)` of a read then a
        # whole-buffer `dynamic_update_slice` of a `(1, n)` buffer: 3 copies a
        # step against plain `lax`'s 2).
        storage, tok, starts, _, _ = _across_the_batch(
            storage, sdim, tok, tdim, starts, None, None
        )
        window = _move_front(window, wdim, storage.shape[0])
        s, t = bind_accum(storage, tok, window, starts, ordered, 0)
        return (s, t), (0, _tdim(t))
    storage, tok, (window,), idx, _ = _batch_common(args, dims, 1, write=True)
    nb = len(idx[0].shape)
    window = window.reshape(window.shape[:nb] + (1,) + window.shape[nb:])
    ring = None if ring is None else ring + 1  # the storage's new leading axis
    s, t = bind_accum(storage, tok, window, idx, ordered, nbatch + 1, ring)
    return (s, t), (0, _tdim(t))


def _swap_batch(args, dims, *, read, nbatch, ring=None, ordered=False, wide=False):
    if _same_window_of_each_element(args, dims, nbatch, 1):
        storage, tok, update, *starts = args
        storage, tok, starts, _, ring = _across_the_batch(
            storage, dims[0], tok, dims[1], starts, None, ring
        )
        update = _move_front(update, dims[2], storage.shape[0])
        s, old, t = bind_swap(storage, tok, update, starts, read, 0, ring)
        return (s, old, t), (0, 0, None)
    storage, tok, (update,), idx, _ = _batch_common(args, dims, 1, write=True)
    nb = len(idx[0].shape)
    update = update.reshape(update.shape[:nb] + (1,) + update.shape[nb:])
    ring = None if ring is None else ring + 1  # the storage's new leading axis
    s, old, t = bind_swap(storage, tok, update, idx, read, nbatch + 1, ring)
    return (s, old.reshape(old.shape[:nb] + old.shape[nb + 1 :]), t), (0, 0, _tdim(t))


def _insert_batch(args, dims, *, axis, ordered, nbatch):
    storage, tok, (value,), idx, _ = _batch_common(args, dims, 1, write=True)
    s, t = bind_insert(storage, tok, value, idx, axis + 1, ordered, nbatch + 1)
    return (s, t), (0, _tdim(t))


def _pop_batch(args, dims, *, axis, fill, read, ordered, nbatch):
    storage, tok, _, idx, _ = _batch_common(args, dims, 0, write=True)
    s, v, t = bind_pop(storage, tok, idx, axis + 1, fill, read, ordered, nbatch + 1)
    return (s, v, t), (0, 0, _tdim(t))


batching.primitive_batchers[read_p] = _read_batch
batching.primitive_batchers[accum_p] = _accum_batch
batching.primitive_batchers[swap_p] = _swap_batch
batching.primitive_batchers[insert_p] = _insert_batch
batching.primitive_batchers[pop_p] = _pop_batch
