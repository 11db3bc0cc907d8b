"""Every way this library works around XLA, in one place.

The buffer primitives (`_primitives.py`) are written with the same `lax` operations
plain JAX code would use; what keeps their loops in place, and their reads exact, is
a handful of tricks against particular XLA behaviours. Each is a function here, and
its docstring says what XLA does without it and which test fails if it goes:

| workaround | without it, XLA... |
|---|---|
| `opaque_zero` | folds a constant zero, so an index or trip count orders nothing |
| `run_time_indices` | turns constant-index slices static, and rewrites the whole buffer |
| `loop_not_unrolled` | removes a 1-trip loop and reorders what it kept apart |
| `NO_WRAP` | materialises lax's negative-start wrap as a kernel per access |
| `widened_write` | duplicates a lower-rank write into the next read: a copy |
| `fold_cotangent_sum` / `marked_onto_zeros` | (with JAX) adds the two buffer-sized cotangents of a buffer a `dynamic_slice` leaves used twice out of place, fused into the next access's read: a copy |
| `added_in_halves` | fuses a whole-buffer add into the next read and writes it out of place (a copy), or, in a loop, writes its operand out first |
| `window2_edit` | the same, for a shift's single-line write |
| `deferred_read` / `materialise_deferred_reads` | (with `window_by_reduce`) runs a reduction kernel per read that no write follows, where plain `lax` fuses the slice into its consumer |
| `pick_by_max` / `window_by_reduce` | duplicates a cheap slice into each consumer, unordered with the next write: a copy; a masked max of the values is not exact |
| `carrier` | computes bfloat16/float8 selects and writes in float32: NaN payloads and subnormals change |
| `check_on_the_side` | copies the buffer through the check's conditional every step, or removes a check whose result only zero-size values use; (JAX) a `jax.debug.callback` to keep it takes the program off `jax.jit`'s fast path |
| `after` | removes a check no output depends on |
| `invariant` | (JAX, not XLA) `shard_map`'s checks refuse a varying value in Equinox's check |
| `split_over_devices` | gathers the whole sharded batch to loop over its elements |
| `lowered_without_explicit_shardings` | (JAX) refuses the lowering's slices of a sharded dimension, and its values typed on the mesh beside local ones |
| `on_the_operands_mesh` | (JAX) types a constant made without `jax.set_mesh` on no mesh, which `vmap` of a sharded batch cannot batch |
| `tokens_per_element` / `tokens_reduced_locally` | (JAX) all-reduces a sharded batch of tokens at every access |

These behaviours were measured on XLA:CPU with jaxlib 0.10.x (the pinned range in
`pyproject.toml`); the tests named in each docstring are what tells if a new XLA
changes them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir, partial_eval as pe


def opaque_zero(x: Any, nlead: int = 0, folded_where: Any = None) -> jax.Array:
    """An int32 zero computed from `x` that XLA cannot constant-fold; with `nlead`,
    one for each index of `x`'s first `nlead` dimensions (shape `x.shape[:nlead]`),
    each computed from an element of its own (so that a batch sharded over devices
    along them is not sliced across the devices).

    `x > inf` is false for every float, NaN included, so this is zero at run time
    whatever the data; XLA does not reason about it, so it stays a run-time value.

    Without it: a token or index offset XLA can prove is zero is folded away, and
    with it the data dependence that orders a read before the next write (a copy).
    Pinned by `tests/test_exact_reads.py::test_the_ordering_token_is_zero_for_every_value`
    (zero for every value) and `tests/test_corpus.py::test_no_per_iteration_copies`.
    """
    x = jnp.asarray(x)
    lead = x.shape[:nlead]
    if x.size > 0:
        first = x.reshape(lead + (-1,))[..., 0]
    else:
        first = jnp.zeros(lead, jnp.float32)
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = jnp.real(first)
    first = lax.convert_element_type(first, jnp.float32)
    if folded_where is not None:
        # A constant zero where XLA finds `folded_where` true (of shape
        # `x.shape[:nlead]`): made from no element of `x` there.
        first = jnp.where(folded_where, jnp.zeros_like(first), first)
    return (first > jnp.inf).astype(jnp.int32)


def run_time_indices(impl: Callable, n_arrays: int) -> Callable:
    """`impl` with its index operands (those after the first `n_arrays`) passed
    through an `optimization_barrier`, so that XLA sees them as run-time values.

    An index that XLA knows to be a constant (a Python int, `jnp.zeros_like(x)`, a
    token that no access in the loop advances) turns the `dynamic-slice`s of the
    buffer into static `slice`s; a fusion that writes the buffer with
    `dynamic-update-slice` and also reads it through a `slice` cannot write it in
    place, and rewrites all of it every step (`insert((0, 0), v)` then
    `pop((0, 0))`: 2 whole-buffer rewrites per step forward, 4 in `grad`). The
    barrier is hoisted out of a loop when its operands are loop-invariant: the
    indices stay unknown to the loop body, at no cost per step.

    Pinned by `tests/test_natural_patterns.py::test_no_per_iteration_copies`
    (the `pyint` and `npint` rows).
    """

    def lowered(*args, **params):
        arrays, idx = args[:n_arrays], args[n_arrays:]
        if idx:
            idx = lax.optimization_barrier(tuple(idx))
        return impl(*arrays, *idx, **params)

    return lowered


def loop_not_unrolled(zero, size: int, body: Callable, state):
    """Run `body(j, state)` for `j` in `range(size)` in a loop XLA can't unroll.

    `state`'s first leaf is the storage; its first element, and `zero` (an int32
    zero from the access's token, which may be a constant for a buffer's first
    access), are added to the trip count as run-time zeros.

    Without it: XLA removes a loop whose trip count it knows to be 1, and then
    fuses, duplicates and reorders the reads and writes the loop kept apart (a
    batched access of one element then copies). Pinned by
    `tests/test_in_place.py::test_batched_insert_pop_has_no_per_iteration_copies`.
    """
    anchor = jax.tree.leaves(state)[0]
    n = jnp.int32(size) + zero + opaque_zero(anchor.reshape(-1)[:1])
    return lax.fori_loop(jnp.int32(0), n, body, state)


# `NO_WRAP` is the `allow_negative_indices` of the straight-line reads and writes
# of unbatched accesses. Their indices are checked (or promised) to be in range,
# and lax's wrapping of a negative start is a scalar `select` that XLA:CPU often
# materialises as a kernel of its own, shared by a read and the write after it (one
# more kernel per access, every step). A broken promise then gets XLA's clamp of
# the start into range, with a negative start clamped to 0. This costs time, not
# copies: `benchmarks/corpus.py` shows it in the forward ratios.
NO_WRAP = False


def widened_write(s, st, sizes, new_window):
    """`s` with the window `s[st : st + sizes]` replaced by `new_window(window)`,
    through a window 2 wide in every dimension where `sizes` is 1 and `s` is not.

    XLA:CPU duplicates a write whose update has fewer non-unit dimensions than the
    buffer into the next read of the buffer, turning that read into a read of the
    older buffer, unordered with respect to the write: the write then copies (as for
    the shifts, `window2_edit`). `new_window` is applied elementwise to the wide
    window, and only the window's own elements are taken from it.

    The new values, broadcast to the wide window, are computed in a kernel of
    their own: XLA does not fuse a producer such as `tanh` into a consumer that
    reads each of its elements twice (one more kernel a step than plain `lax`'s
    write, in the corpus's `kv_cache_attention` forward). Placed in a wide window
    of zeros by a `dynamic_update_slice` instead, they fuse into the write, but the
    corpus's `dynamic_update_slice` forward took 1.7-1.9x as long (the fused
    update computes and selects every element), and the cache's 0.97-0.99x.
    Written into the buffer seen as 1-D (a bitcast; the window, one contiguous run,
    is then as many dimensions wide as the buffer, and the values fuse into the
    write), XLA copies the buffer every step: it does not write in place through
    a fusion whose root is the bitcast back (the corpus's `dynamic_update_slice`
    and `kv_cache_attention` forwards, 1 copy a step).

    An overwrite of a buffer of 2 dimensions is written as its window instead
    (`_primitives._swap_impl`: `copy_sweep.py` finds no copy without the widening
    there, and the window saves that kernel); accumulations are widened whatever
    the rank (an insert then a read of a `(8, 32, 64)` buffer copied 2 a step under
    `grad` without it).

    Pinned by `tests/test_in_place.py::test_an_insert_then_a_read_copies_nothing_under_grad`
    (accumulations) and `test_an_overwrite_then_a_pop_copies_nothing` (overwrites),
    on buffers of 3 and 4 dimensions. (The corpus's bodies, all on 2-D buffers, no
    longer copy without it: `tests/test_corpus.py` passes with every write
    written as its window.)
    """
    shape = s.shape
    starts, wide, offs = [], [], []
    for i, n, m in zip(st, sizes, shape, strict=True):
        if n == 1 and m >= 2:
            i0 = jnp.minimum(i, m - 2)
            starts.append(i0)
            wide.append(2)
            offs.append(jnp.minimum(i - i0, 1))  # clamped, as lax clamps
        else:
            starts.append(i)
            wide.append(n)
            offs.append(None)
    if tuple(wide) == tuple(sizes):
        old = lax.dynamic_slice(s, starts, sizes)
        return lax.dynamic_update_slice(s, new_window(old).astype(s.dtype), starts)
    big = lax.dynamic_slice(s, starts, wide, allow_negative_indices=NO_WRAP)
    mask = None
    for d, k in enumerate(offs):
        if k is not None:
            m_d = lax.broadcasted_iota(k.dtype, tuple(wide), d) == k
            mask = m_d if mask is None else mask & m_d
    assert mask is not None  # some dimension was widened
    new = jnp.where(mask, new_window(big).astype(s.dtype), big)
    return lax.dynamic_update_slice(s, new, starts, allow_negative_indices=NO_WRAP)


def added_in_halves(s, w, zero):
    """`s + w` for a `w` of the shape of `s`, as two in-place updates of half of `s`
    along a dimension at least 2 long (which `s` must have).

    `zero` is an int32 run-time zero (from the access's token); it is passed through
    an `optimization_barrier` so that the halves' starts stay run-time values.

    Without it: a plain `s + w` is elementwise, and XLA:CPU fuses it into the next
    read of the buffer (computing the sum again there, from the old buffer) and
    writes it out of place: 1 copy per step of the gradient of a whole-buffer read
    after an insert. In a single-trip loop (`loop_not_unrolled`) the add is in place,
    but `w` is a loop operand, which XLA writes out before the loop: the window
    cotangent of `(w * s).sum()` is a broadcast of a scalar, written to a
    buffer-sized array every step, and the gradient was 1.13-1.26x plain `lax`'s.
    As two `dynamic_update_slice`s, each reading the half it writes at the same
    starts, XLA updates the buffer in place and fuses the broadcast into the
    updates. A constant start would turn the half's read into a static `slice`,
    which XLA does not let a fusion update in place (a rewrite of the buffer);
    lax's wrap of negative starts would give the read and the write different
    start values, and XLA then writes the half read out first.

    Pinned by `tests/test_natural_patterns.py::test_no_per_iteration_copies` (the
    `whole_read` and `whole_array` rows under grad); the time is
    `benchmarks/patterns.py`'s.
    """
    d = next(i for i, n in enumerate(s.shape) if n >= 2)  # the caller checks
    w = w.astype(s.dtype)
    zero = lax.optimization_barrier(zero)
    n = s.shape[d]
    for lo, hi in ((0, n // 2), (n // 2, n)):
        starts = [zero] * s.ndim
        starts[d] = zero + lo
        sizes = s.shape[:d] + (hi - lo,) + s.shape[d + 1 :]
        old = lax.dynamic_slice(s, starts, sizes, allow_negative_indices=False)
        new = old + lax.slice_in_dim(w, lo, hi, axis=d)
        s = lax.dynamic_update_slice(s, new, starts, allow_negative_indices=False)
    return s


# A read whose storage output is dropped (`dynamic_slice`, which returns the window
# only) leaves its buffer used twice, so that under `jax.grad` JAX adds two
# buffer-sized cotangents, the read's (its window's cotangent accumulated onto
# zeros) and the rest's, with an `add_any` that XLA:CPU fuses into the next access's
# read and writes out of place: a copy per step (`whole_ds`), and a buffer-sized add
# for a one-row window. The accumulation onto zeros marks its window and starts;
# the lowering of the next access of the sum turns `zeros + window` then `+ rest`
# into the accumulation of the window into `rest`, in place.
_ONTO_ZEROS_WINDOW = "esb.onto_zeros_window"
_ONTO_ZEROS_STARTS = "esb.onto_zeros_starts"


def is_zeros(value: ir.Value) -> bool:
    """Whether `value` (during a lowering) is a constant zero, or a broadcast of one."""
    op = _operation(value.owner)
    if op is None:
        return False
    if op.name == "stablehlo.broadcast_in_dim":
        return is_zeros(op.operands[0])
    if op.name != "stablehlo.constant":
        return False
    try:
        attr = ir.DenseElementsAttr(op.attributes["value"])
    except TypeError:  # complex constants: the bindings cannot read them, but
        # print them, a splat as `dense<(re,im)>`
        text = str(op).split("dense<", 1)[-1]
        parts = text.removeprefix("(").split(")>")[0].split(",")
        if not text.startswith("(") or len(parts) != 2:
            return False
        try:
            return all(float(x) == 0.0 for x in parts)
        except ValueError:
            return False
    if not attr.is_splat:
        return False
    splat = attr.get_splat_value()
    if isinstance(splat, ir.FloatAttr):
        return ir.FloatAttr(splat).value == 0.0
    if isinstance(splat, ir.IntegerAttr):
        return ir.IntegerAttr(splat).value == 0
    return False


# A rotation of a window on zeros (JAX's transpose of a slice of a ring's
# `.array`, rotated back: `_primitives._rotate_transpose`), or of a whole line (the
# transpose of the contents read whole, its window the line at 0), marked by an
# unused tuple of the rotation's result, the window and its start along each
# dimension once rotated (`rotated_on_zeros`).
_ROTATED_WINDOW = "esb.rotated_window"
_ROTATED_AXIS = "esb.rotated_axis"


def window_on_zeros(x: ir.Value):
    """`(window, starts)` if `x` (during a lowering) is a window on zeros: padded
    with zeros at its edges (JAX's transpose of a static slice; `starts` the
    padding below it, ints) or written into zeros by a `dynamic_update_slice`
    (of a `dynamic_slice`; `starts` its start values, which it clamps so that
    the window fits); else None."""
    op = _operation(x.owner)
    if op is None:
        return None
    if op.name == "stablehlo.dynamic_update_slice":
        if not is_zeros(op.operands[0]):
            return None
        return op.operands[1], list(op.operands[2:])
    padding = _zero_padding(op)
    return None if padding is None else (op.operands[0], padding[0])


def _zero_padding(op: ir.Operation) -> tuple | None:
    """`(low, high)`, the padding below and above along each dimension, if `op`
    pads its operand with zeros at its edges only (no interior or negative
    padding: JAX's transpose of a static slice); else None."""
    if op.name != "stablehlo.pad":
        return None
    low, high, interior = (
        list(ir.DenseI64ArrayAttr(op.attributes[k]))
        for k in ("edge_padding_low", "edge_padding_high", "interior_padding")
    )
    if any(interior) or min(low + high) < 0 or not is_zeros(op.operands[1]):
        return None
    return low, high


def rotated_on_zeros(rotated: ir.Value, window: ir.Value, starts, axis: int) -> None:
    """Mark `rotated`, a rotation along `axis` of `window` on zeros, whose window
    starts at `starts` (int32 values) once rotated, its rows along `axis`
    wrapping, for an accumulation of it to add the window alone
    (`rotated_window`)."""
    info = hlo.TupleOp([rotated, window, *starts])
    i64 = ir.IntegerType.get_signless(64)
    info.operation.attributes[_ROTATED_WINDOW] = ir.UnitAttr.get()
    info.operation.attributes[_ROTATED_AXIS] = ir.IntegerAttr.get(i64, axis)


def rotated_window(ctx, args: tuple, nbatch: int):
    """`(ctx, args, ring)` of an unbatched accumulation `(storage, tok, window,
    *starts)` of a whole buffer whose window is a marked rotation of a window on
    zeros (`rotated_on_zeros`) in the block being lowered: the window itself, at its
    rotated start, added as a ring's window along `ring` (wrapping round the end
    of the storage). Else unchanged, and `ring` None.

    `buf.array[:4]` of a ring (a delay line's newest frames) is a rotation of its
    storage by the head, then a slice. Under `grad` the slice's cotangent was
    padded with zeros to the whole line, rotated back (a gather of the whole line)
    and added to the buffer's cotangent: O(line) a step against a forward of four
    frames (`benchmarks/patterns.py`'s `delay_array`: gradient over forward
    33). The whole line rotated back (its window the whole rotation, at 0) is
    scatter-added the same way, in place, instead of gathered and added."""
    storage, tok, window, *starts = args
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    info = next(
        (
            op
            for op in (_operation(u.owner) for u in window.uses)
            if op is not None and _ROTATED_WINDOW in op.attributes and op.block == block
        ),
        None,
    )
    if (
        info is None
        or nbatch
        or _aval_of(window).shape != _aval_of(storage).shape
        or len(starts) != _aval_of(storage).ndim
    ):
        return ctx, args, None
    axis = ir.IntegerAttr(info.attributes[_ROTATED_AXIS]).value
    inner, *at = info.operands[1:]
    if _aval_of(inner).shape == _aval_of(storage).shape and _zeros_whole(storage):
        # The whole line onto zeros (a whole overwrite's transpose zeroed the
        # rest): the rotation itself, which XLA simplifies `zeros +` away from.
        # Scattered into zeros, the result was a constant's buffer written, which
        # XLA copied into the loop's carry every step (`test_vmap.py`'s whole
        # read then overwrite of a batch of rings).
        return ctx, args, None
    # (The accumulation's own starts are zeros: its window is the whole buffer.)
    moved = [hlo.ConvertOp(st.type, a).result for st, a in zip(starts, at, strict=True)]
    ctx = ctx.replace(avals_in=[*ctx.avals_in[:2], _aval_of(inner), *ctx.avals_in[3:]])
    return ctx, (storage, tok, inner, *moved), axis


def _zeros_whole(x: ir.Value) -> bool:
    """Whether `x` (during a lowering) is zeros (`is_zeros`), or zeros written
    over all of it (the transpose of an overwrite of a whole buffer)."""
    op = _operation(x.owner)
    if op is not None and op.name == "stablehlo.dynamic_update_slice":
        update = op.operands[1]
        if _aval_of(update).shape != _aval_of(x).shape:
            return False
        while (u := _operation(update.owner)) is not None and u.name == (
            "stablehlo.reshape"
        ):
            update = u.operands[0]  # (batched: through the batch's unit dimension)
        return is_zeros(update)
    return is_zeros(x)


def unpadded_window(ctx, args: tuple, nbatch: int) -> tuple:
    """`(ctx, args)` of an accumulation `(storage, tok, window, *starts)` whose
    window is a zero-padded array (JAX's transpose of a static slice): the array
    itself, at the starts moved by the padding below it. Else unchanged.

    `buf.array[:8]` is a read of the whole buffer and a slice: under `grad` the
    read's cotangent is the slice's, padded with zeros to the whole buffer, which
    was added to the buffer's cotangent every step, O(buffer) (1.14x plain `lax`'s
    gradient for an insert then `.array[:8, :16]` of a (100, 500) buffer, whose
    forward is O(window)). Padding adds zeros, so accumulating only the array is
    the same sum (but that a -0.0 stays -0.0 where the padding left it +0.0)."""
    storage, tok, window, *starts = args
    pad = _operation(window.owner)
    if pad is not None and pad.name == "stablehlo.dynamic_update_slice" and starts:
        return _window_of_update(ctx, args, pad, nbatch)
    if pad is None or not starts or (padding := _zero_padding(pad)) is None:
        return ctx, args
    low, high = padding
    if len(low) != nbatch + len(starts) or any(low[:nbatch] + high[:nbatch]):
        return ctx, args
    moved = [
        hlo.AddOp(start, _index_constant(start, by)).result if by else start
        for start, by in zip(starts, low[nbatch:])
    ]
    inner = pad.operands[0]
    ctx = ctx.replace(avals_in=[*ctx.avals_in[:2], _aval_of(inner), *ctx.avals_in[3:]])
    return ctx, (storage, tok, inner, *moved)


def _replacing_scatter(op: ir.Operation) -> tuple | None:
    """`(base, indices, update, dimension numbers)` if `op` is a `scatter` of one
    update into one operand, at indices JAX clamped into range (out of range, a
    scatter skips a window where `dynamic_update_slice` clamps it), replacing
    what was there; else None."""
    if op.name != "stablehlo.scatter" or len(op.operands) != 3:
        return None
    base, indices, update = op.operands
    clamp = _operation(indices.owner)
    body = [o.operation for o in op.regions[0].blocks[0].operations]
    if (
        clamp is None
        or clamp.name != "stablehlo.clamp"
        or len(body) != 1
        or body[0].operands[0] != op.regions[0].blocks[0].arguments[1]
    ):
        return None
    dn = hlo.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
    return base, indices, update, dn


def _clamped_starts(indices, to_operand, shape, ushape, lead: tuple) -> list:
    """The starts along each dimension `d` of `shape` past the `len(lead)` given
    in `lead`, of a window of `ushape` whose starts along `to_operand` are the
    last dimension of `indices` (zero along the others), clamped into range as
    `dynamic_update_slice` clamps them: int32 values of `indices`' shape but its
    last dimension."""
    ishape = list(_aval_of(indices).shape[:-1])
    i32 = ir.IntegerType.get_signless(32)
    itype = ir.RankedTensorType.get(ishape, i32)
    starts = list(lead)
    for d in range(len(lead), len(shape)):
        if d not in to_operand:
            starts.append(mlir.ir_constant(np.zeros(ishape, np.int32)))
            continue
        j = to_operand.index(d)
        col = hlo.SliceOp(
            indices, [0] * len(ishape) + [j], [*ishape, j + 1], [1] * (len(ishape) + 1)
        ).result
        element = ir.RankedTensorType(indices.type).element_type
        col = hlo.ReshapeOp(ir.RankedTensorType.get(ishape, element), col).result
        if element != i32:
            col = hlo.ConvertOp(itype, col).result
        lo = mlir.ir_constant(np.zeros(ishape, np.int32))
        hi = mlir.ir_constant(np.full(ishape, shape[d] - ushape[d], np.int32))
        starts.append(hlo.ClampOp(lo, col, hi).result)
    return starts


def _scatter_as_update(op: ir.Operation) -> tuple | None:
    """`(update, starts)` if `op` is a `scatter` that is a `dynamic_update_slice`
    of `update` (`_replacing_scatter`): one window, as large as the operand in
    each dimension it does not index, at one index. Its starts along every
    dimension are int32 values, clamped, made at the insertion point. JAX's
    transpose of a `dynamic_slice` at unbatched starts of a batch of buffers
    under `vmap` (`lax.dynamic_slice(buf.array, ...)` at Python-int starts under
    `vmap(grad)`: its cotangent, the update written into zeros, was added to the
    whole batch of buffers' every step). Else None."""
    found = _replacing_scatter(op)
    if found is None:
        return None
    base, indices, update, dn = found
    shape, ushape = _aval_of(base).shape, _aval_of(update).shape
    to_operand = list(dn.scattered_dims_to_operand_dims)
    if (
        len(ushape) != len(shape)
        or list(dn.update_window_dims) != list(range(len(shape)))
        or list(dn.inserted_window_dims)
        or list(dn.input_batching_dims)
        or _aval_of(indices).shape != (len(to_operand),)
        or dn.index_vector_dim != 0
    ):
        return None
    return update, _clamped_starts(indices, to_operand, shape, ushape, ())


def _scatter_per_element(op: ir.Operation) -> tuple | None:
    """`(windows, starts)` if `op` is a `scatter` that writes, for each element `b`
    of its operand's leading dimension, one window `update[b]`
    (`_replacing_scatter`): JAX's transpose of a `dynamic_slice` of each batch
    element's buffer at its own start under `vmap` (`lax.dynamic_slice(buf.array,
    ...)` at traced starts, `vmap(grad)`). The windows (`update` with a unit
    dimension after the first), and the starts of each along every dimension of
    the operand (`(B,)` int32 values, clamped: `b` along the first, made at the
    insertion point); else None."""
    found = _replacing_scatter(op)
    if found is None:
        return None
    base, indices, update, dn = found
    shape, ushape = _aval_of(base).shape, _aval_of(update).shape
    b = (shape or (0,))[0]
    to_operand = list(dn.scattered_dims_to_operand_dims)
    if (
        len(shape) < 1
        or len(ushape) != len(shape)
        or ushape[0] != b
        or list(dn.update_window_dims) != list(range(1, len(shape)))
        or list(dn.inserted_window_dims)
        or list(dn.input_batching_dims) != [0]
        or list(dn.scatter_indices_batching_dims) != [0]
        or 0 in to_operand
        or _aval_of(indices).shape != (b, len(to_operand))
        or dn.index_vector_dim != 1
    ):
        return None
    vec = ir.RankedTensorType.get([b], ir.IntegerType.get_signless(32))
    i64 = ir.IntegerType.get_signless(64)
    first = hlo.IotaOp(vec, ir.IntegerAttr.get(i64, 0)).result
    starts = _clamped_starts(indices, to_operand, shape, ushape, (first,))
    wtype = ir.RankedTensorType.get(
        [b, 1, *ushape[1:]], ir.RankedTensorType(update.type).element_type
    )
    return hlo.ReshapeOp(wtype, update).result, starts


def _window_of_update(ctx, args: tuple, dus, nbatch: int) -> tuple:
    """`unpadded_window` of a window that is zeros with one update written into
    them (JAX's transpose of a `dynamic_slice`): the update itself, at the starts
    moved by its start, clamped as `dynamic_update_slice` clamps it.

    `buf.array[r, :4]` under `grad`: as for a static slice, the whole buffer's
    cotangent was the update written into zeros, added to the buffer's cotangent
    every step (`test_scan.py`'s "array sliced after", under a checkpointed
    `esb.scan`: a zeros and an add of the whole buffer a step)."""
    storage, tok, window, *starts = args
    base, update, *at = dus.operands
    wshape, ushape = _aval_of(window).shape, _aval_of(update).shape
    if (
        len(at) != nbatch + len(starts)
        or ushape[:nbatch] != wshape[:nbatch]
        or any(_aval_of(start).shape for start in starts)  # (one start each)
        or not is_zeros(base)
    ):
        return ctx, args
    moved = []
    for start, a, n, u in zip(starts, at[nbatch:], wshape[nbatch:], ushape[nbatch:]):
        a = hlo.ConvertOp(start.type, a).result
        lo, hi = _index_constant(start, 0), _index_constant(start, n - u)
        a = hlo.ClampOp(lo, a, hi).result
        moved.append(hlo.AddOp(start, a).result)
    ctx = ctx.replace(avals_in=[*ctx.avals_in[:2], _aval_of(update), *ctx.avals_in[3:]])
    return ctx, (storage, tok, update, *moved)


def marked_onto_zeros(
    storage: ir.Value, window: ir.Value, starts, ring: int | None = None
) -> tuple:
    """`(window, starts)` of an accumulation, marked for `fold_cotangent_sum` if
    `storage` is zeros (`window` through a no-op `reshape`, `starts` through an
    `optimization_barrier`, as `run_time_indices` puts them anyway); unchanged
    otherwise. `ring`: the window's rows wrap along that axis (`rotated_window`)."""
    if not starts:
        return window, starts
    w = hlo.ReshapeOp(window.type, window)
    w.operation.attributes[_ONTO_ZEROS_WINDOW] = ir.UnitAttr.get()
    if ring is not None:
        i64 = ir.IntegerType.get_signless(64)
        w.operation.attributes[_ROTATED_AXIS] = ir.IntegerAttr.get(i64, ring)
    b = hlo.OptimizationBarrierOp(list(starts))
    b.operation.attributes[_ONTO_ZEROS_STARTS] = ir.UnitAttr.get()
    return w.result, list(b.results)


_ONTO_ZEROS_RESULT = "esb.onto_zeros_result"


def marked_onto_zeros_result(result: ir.Value) -> ir.Value:
    """`result`, the storage an accumulation marked by `marked_onto_zeros` returns,
    through a marked no-op `reshape`: `fold_cotangent_sum` folds a sum only when
    one of its operands is exactly such a result."""
    op = hlo.ReshapeOp(result.type, result)
    op.operation.attributes[_ONTO_ZEROS_RESULT] = ir.UnitAttr.get()
    return op.result


def _accumulation_marks(result: ir.Operation) -> tuple:
    """The window and starts marks of the accumulation whose result mark is
    `result`: the nearest before it in its block, as `_primitives` emits them in
    one lowering, with only the accumulation's own operations between."""
    ops = list(result.block.operations)
    k = next(i for i, o in enumerate(ops) if o.operation == result)
    window = starts = None
    for o in reversed(ops[:k]):
        o = o.operation
        if _ONTO_ZEROS_RESULT in o.attributes:
            break  # another accumulation's: this one's marks are missing
        if window is None and _ONTO_ZEROS_WINDOW in o.attributes:
            window = o
        if starts is None and _ONTO_ZEROS_STARTS in o.attributes:
            starts = o
        if window is not None and starts is not None:
            break
    return window, starts


def fold_cotangent_sum(
    ctx, storage: ir.Value, accum: Callable, unmarked: bool = False
) -> None:
    """If `storage` is JAX's sum of a buffer `rest` and an accumulation of a window
    onto zeros (`marked_onto_zeros`), rewrite the sum, in place, into
    `accum(rest, tok, window, *starts) -> (storage, tok)` plus zeros, which XLA
    simplifies away. The sum's value, which JAX holds, keeps its meaning. With
    `unmarked`, also of a window written into zeros by JAX (`_zeros_around`).

    Under `vmap(grad)` the accumulation may be unbatched where `rest` is a batch
    (a whole-buffer read whose cotangent is the same for every element, as for
    `buf.array.sum()`): JAX's batched add broadcasts it over the batch first. The
    broadcast window is then accumulated at the start of every batch dimension.
    Left as a broadcast add, XLA fused it into the next access's reads of the
    cotangent and wrote it out of place: a copy per step."""
    add = _operation(storage.owner)
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    if add is None or add.name != "stablehlo.add" or add.block != block:
        return
    for k in (0, 1):
        marked, lead = _operation(add.operands[k].owner), 0
        rest = add.operands[1 - k]
        if marked is not None and marked.name == "stablehlo.broadcast_in_dim":
            marked, lead = _unbroadcast(marked, rest)
        if (
            marked is None
            or _ONTO_ZEROS_RESULT not in marked.attributes
            or marked.block != block
            or (lead == 0 and rest.type != storage.type)
        ):
            continue
        window_op, starts_op = _accumulation_marks(marked)
        if window_op is None or starts_op is None:
            continue
        window = window_op.operands[0]
        starts = list(starts_op.operands)
        ring = (
            ir.IntegerAttr(window_op.attributes[_ROTATED_AXIS]).value + lead
            if _ROTATED_AXIS in window_op.attributes
            else None
        )
        with ir.InsertionPoint(add):
            if lead:
                window, starts = _broadcast_window(window, starts, rest, lead)
            _fold(ctx, add, k, window, starts, accum, ring)
        return
    for k in (0, 1) if unmarked else ():
        rest = add.operands[1 - k]
        owner = _operation(add.operands[k].owner)
        if rest.type != storage.type or owner is None or owner.block != block:
            continue
        with ir.InsertionPoint(add):
            found = _zeros_around(owner)
            if found is not None:
                window, starts = found
                _fold(ctx, add, k, window, starts, accum, None)
                return


def _fold(ctx, add: ir.Operation, k: int, window, starts, accum, ring) -> None:
    """Rewrite `add`, a sum of a buffer and (its `k`-th operand) `window` at
    `starts` on zeros, into `accum` of the window into the buffer plus zeros
    (`fold_cotangent_sum`), at the insertion point."""
    rest = add.operands[1 - k]
    tok_aval = ShapedArray((), jnp.float32)
    avals_in = [_aval_of(rest), tok_aval, _aval_of(window)] + [
        _aval_of(i) for i in starts
    ]
    sub = ctx.replace(
        primitive=None, avals_in=avals_in, avals_out=[avals_in[0], tok_aval]
    )
    fn = functools.partial(
        accum,
        scalars=added_in_halves_fused(window, ctx.module_context.module),
        ring=ring,
    )
    tok = mlir.ir_constant(jnp.float32(0))
    new, _ = mlir.lower_fun(fn, multiple_results=True)(sub, rest, tok, window, *starts)
    zero = mlir.ir_constant(jnp.zeros((), avals_in[0].dtype))
    zeros = hlo.BroadcastInDimOp(add.result.type, zero, mlir.dense_int_array([]))
    add.operands[1 - k] = new
    add.operands[k] = zeros.result


def _zeros_around(op: ir.Operation) -> tuple | None:
    """`(window, starts)` if `op` is JAX's scatter of windows into zeros as large
    as its result: one window (`_scatter_as_update`), or one for each element of
    the leading dimension (`_scatter_per_element`); else None. (A
    `dynamic_update_slice` or pad into zeros is a library read's cotangent,
    accumulated where it is made: `unpadded_window`.)"""
    if op.name != "stablehlo.scatter" or not is_zeros(op.operands[0]):
        return None
    return _scatter_per_element(op) or _scatter_as_update(op)


def _unbroadcast(op: ir.Operation, rest: ir.Value) -> tuple:
    """`(operation, lead)`: the operation of the value `op` broadcasts, and the
    number of leading dimensions the broadcast adds, if `op` broadcasts a value of
    `rest`'s shape without its `lead` leading dimensions over those (as JAX's
    batched add broadcasts an unbatched operand); else `(None, 0)`."""
    inner = op.operands[0]
    out_t, in_t = ir.RankedTensorType(rest.type), ir.RankedTensorType(inner.type)
    lead = out_t.rank - in_t.rank
    dims = list(ir.DenseI64ArrayAttr(op.attributes["broadcast_dimensions"]))
    if (
        lead <= 0
        or ir.RankedTensorType(op.result.type) != out_t
        or dims != list(range(lead, out_t.rank))
        or list(in_t.shape) != list(out_t.shape)[lead:]
    ):
        return None, 0
    return _operation(inner.owner), lead


def _broadcast_window(window: ir.Value, starts: list, rest: ir.Value, lead: int):
    """`(window, starts)` of an accumulation broadcast over the `lead` leading
    dimensions of `rest`: the window broadcast over them, starting at 0 in each."""
    w_t = ir.RankedTensorType(window.type)
    shape = list(ir.RankedTensorType(rest.type).shape)[:lead] + list(w_t.shape)
    w = hlo.BroadcastInDimOp(
        ir.RankedTensorType.get(shape, w_t.element_type),
        window,
        mlir.dense_int_array(list(range(lead, lead + w_t.rank))),
    ).result
    return w, [_index_constant(starts[0], 0)] * lead + list(starts)


def _index_constant(like: ir.Value, value: int) -> ir.Value:
    """A scalar constant `value` of the integer type of the index `like`."""
    return mlir.ir_constant(np.asarray(value, _aval_of(like).dtype))


# Operations XLA fuses into their consumers, computing each element where it is
# used: an array computed by them from scalars is never written out.
_ELEMENTWISE = frozenset(
    f"stablehlo.{name}"
    for name in (
        "add subtract multiply divide negate abs convert select compare and or not "
        "maximum minimum tanh exponential log sqrt rsqrt sine cosine reshape "
        # (JAX's `jax.checkpoint` passes the values it saves through a
        # `reduce_precision` to their own type.)
        "reduce_precision"
    ).split()
)


def computed_from_scalars(value: ir.Value, depth: int = 8) -> bool:
    """Whether `value` (during a lowering) is computed, in the function being
    lowered, from scalars by broadcasts and elementwise operations (at most `depth`
    deep): then XLA fuses its computation into its consumers and never writes it
    out. Used by `added_in_halves`' caller to choose between the halves (which take
    such a value fused) and a loop (faster for a value written out anyway)."""
    t = ir.RankedTensorType(value.type)
    if t.rank == 0:
        return True
    op = _operation(value.owner)
    if op is None or depth == 0:
        return False
    if op.name in ("stablehlo.constant", "stablehlo.iota"):
        return True
    if op.name == "stablehlo.broadcast_in_dim":
        return ir.RankedTensorType(op.operands[0].type).rank == 0
    if op.name in _ELEMENTWISE:
        return all(computed_from_scalars(o, depth - 1) for o in op.operands)
    return False


def added_in_halves_fused(value: ir.Value, module) -> bool:
    """Whether a whole-buffer accumulation of the window `value` adds it in halves
    (`added_in_halves`) rather than in a single-trip loop: where XLA fuses
    `value` into the halves (`computed_from_scalars`), or where it is read from
    memory, an argument of the function being lowered or a slice of one (through
    reshapes, conversions, slices, broadcasts and calls of functions that return
    such), which the halves read where it is. Such a window is a scan's slice of its
    stacked cotangents of a step's output (the whole buffer as it was before an
    edit, output every step): as a loop operand, XLA wrote it out again every
    step, and that gradient took 4x plain `lax`'s time (1.31-1.35 against
    0.32-0.33 ms), against 0.11 ms in halves; under `esb.scan`, whose step takes
    the slice through a call, 1.29 against 0.30 ms unfolded; under `vmap(grad)`,
    where it is broadcast over the batch (`fold_cotangent_sum`), 3.58 against
    0.82-0.93 unfolded and 0.62 in halves."""
    v, calls = value, []
    for _ in range(16):
        op = _operation(v.owner)
        if op is None:
            if not calls:
                return True
            # An argument of a function called here: the call's operand.
            v = calls.pop().operands[ir.BlockArgument(v).arg_number]
        elif op.name == "func.call":
            body = _callee(op, module).regions[0].blocks
            if not body:  # (a declaration: JAX's functions all have bodies)
                break
            ret = list(body[0].operations)[-1]
            v = ret.operands[ir.OpResult(v).result_number]
            calls.append(op)
        elif op.name in _FROM_MEMORY:
            v = op.operands[0]
        else:
            break
    return computed_from_scalars(value)


_FROM_MEMORY = frozenset(
    f"stablehlo.{n}"
    for n in ("reshape", "convert", "slice", "dynamic_slice", "broadcast_in_dim")
)


def bits_dtype(dtype) -> Any:
    """The unsigned integer dtype of the same width as `dtype`."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return dtype
    info = jnp.iinfo(dtype) if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype)
    return jnp.dtype(f"uint{info.bits}")


def carrier(dtype) -> Any:
    """The dtype to move values of `dtype` through, exactly, when an operation
    selects or writes them: the unsigned integer of the same width for bfloat16 and
    the float8 and float4 dtypes, `dtype` itself otherwise.

    XLA:CPU has no arithmetic for those dtypes, and computes every fused operation
    on them, even a `select` or a `dynamic_update_slice`, in float32, converting
    there and back: the way back quiets signalling NaNs and drops NaN payloads (of
    the patterns of every element a `dynamic_update_slice` rewrites). Integers move
    exactly. The other dtypes XLA:CPU moves exactly as they are.

    Pinned by `tests/test_exact_reads.py` (every dtype, NaN payloads, subnormals).
    """
    dtype = jnp.dtype(dtype)
    narrow = dtype == jnp.bfloat16 or dtype.itemsize == 1
    return (
        bits_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) and narrow else dtype
    )


def moved_as_bits(dtype) -> bool:
    """Whether a buffer of `dtype` is moved as the bits of its `carrier`: then XLA
    writes it in place through the conversion only when nothing else in the
    write's own fusion reads the storage, so its edits read first, in a kernel of
    their own (`_primitives`: the narrow window write, shift and accumulation)."""
    return carrier(dtype) != jnp.dtype(dtype)


def to_carrier(x: jax.Array) -> jax.Array:
    """`x` as its `carrier` dtype (the same bits; `x` itself if that is its dtype)."""
    c = carrier(x.dtype)
    return x if c == x.dtype else lax.bitcast_convert_type(x, c)


def from_carrier(x: jax.Array, dtype) -> jax.Array:
    """The values of `dtype` whose `carrier` bits `x` holds."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def pick_by_max(pair, k, d: int, keepdims: bool = False):
    """`(element, reduced)`: element `k` (0 or 1) of `pair` along `d`, where `pair`
    is 2 wide, read as a `max` with the other element masked to zero, over the bit
    patterns; `reduced` is the reduction's own result (those bits).

    Exact for every value of every real or bool dtype. Not a `max` of the values
    with the other element masked to `-inf`: the float8 dtypes without infinities
    turn `-inf` into NaN, which then wins, and XLA:CPU computes bfloat16 and the
    float8 dtypes in float32, flushing subnormals and quieting NaNs. The bits, as
    the unsigned integer of the same width, are all at least the masked 0.

    XLA materialises a reduction once instead of duplicating it into its consumers
    (see `window_by_reduce`). Pinned by `tests/test_exact_reads.py`.
    """
    pos = lax.broadcasted_iota(k.dtype, pair.shape, d)
    keep = pos == k
    if pair.dtype == jnp.bool_:  # False is the lowest bool: no bits needed
        out = jnp.max(jnp.where(keep, pair, False), axis=d, keepdims=keepdims)
        return out, out
    ubits = bits_dtype(pair.dtype)
    bits = jnp.where(keep, lax.bitcast_convert_type(pair, ubits), jnp.zeros((), ubits))
    bits = jnp.max(bits, axis=d, keepdims=keepdims)
    return lax.bitcast_convert_type(bits, pair.dtype), bits


def materialised(x, zero):
    """`x`, read through a reduction (`pick_by_max` of `x` paired with itself),
    which XLA computes once, in a kernel of its own, instead of fusing it into its
    consumers. `zero` is a run-time int32 zero (`opaque_zero`). For a real or bool
    `x`."""
    return pick_by_max(jnp.stack([x, x]), zero, 0)[0]


def _rolled_by_pad(x, shift: int, axis: int):
    """`jnp.roll(x, shift, axis)` for `shift` of 1 or -1, written as a pad of the
    elements that stay in their line, and a `select` of the element that wraps
    round it.

    `jnp.roll` is two slices and a concatenate. XLA:CPU fuses those into their
    consumer along the leading axis or along the only line, but along a later axis
    of several lines (a batch of 1-D buffers under `vmap`) it made the slices and
    the concatenate three kernels over the buffer. Padded, the roll is one
    kernel with its consumer there, and no slower elsewhere: the roll (then read
    through a `reduce_window`) of a `(3, 4096)` batch took 7.9 us with `jnp.roll` and 3.1 us padded, of a batch
    of delay lines `(3, 1024, 32)` along axis 1 84 and 42 us, and the same (3.1
    us) for one line of 12288 elements (a loop of 100 rolls, XLA:CPU).
    """
    n = x.shape[axis]
    if n == 0 or abs(shift) != 1:
        return jnp.roll(x, shift, axis)
    # Shift 1: the first `n - 1` elements move one on, the last wraps to the front;
    # shift -1: the last `n - 1` move one back, the first wraps to the end.
    start, low, edge, src = (0, 1, 0, n - 1) if shift > 0 else (1, 0, n - 1, 0)
    kept = lax.slice_in_dim(x, start, start + n - 1, axis=axis)
    cfg = [(0, 0, 0)] * x.ndim
    cfg[axis] = (low, 1 - low, 0)
    r = lax.pad(kept, jnp.zeros((), x.dtype), cfg)
    wrapped = lax.slice_in_dim(x, src, src + 1, axis=axis)
    return jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, axis) == edge, wrapped, r)


def in_branch(f: Callable, key, *args):
    """`f(*args)`, computed in a conditional whose predicate is always true, but
    not to XLA (`opaque_zero(key)`), which XLA does not fuse into the
    conditional's users (see `_primitives._edited_bits`, `rolled_in_branch`). Its
    results leave the conditional as their carriers' bits (`to_carrier`): as
    bfloat16, XLA:CPU passed them through float32, dropping their NaN payloads.
    Its operands enter it as they are: entering as bits, the storage's conversion
    was a second user of the edit that XLA computed apart from the buffer's write
    (a copy)."""
    shapes = jax.eval_shape(f, *args)
    bits = lambda *args: jax.tree.map(to_carrier, f(*args))
    skip = lambda *args: jax.tree.map(
        lambda s: jnp.zeros(s.shape, carrier(s.dtype)), shapes
    )
    out = lax.cond(opaque_zero(key) == 0, bits, skip, *args)
    return jax.tree.map(lambda o, s: from_carrier(o, s.dtype), out, shapes)


def rolled_in_branch(x, shift: int, axis: int = 0):
    """`jnp.roll(x, shift, axis)`, materialised: computed in a conditional whose
    predicate is always true, but not to XLA (`in_branch`, keyed on `x`), moved as
    bits (`carrier`). Exact for every dtype.

    A shift of a buffer of one line at a traced position is one `select` over the
    whole buffer between the line and its roll. XLA:CPU fused the roll into that
    `select`, whose kernel then read the buffer at shifted positions and could not
    write it in place: a copy of the buffer per step for a single traced insert,
    delete or pop (1 forward, 2 in grad and jvp; a (4096,) buffer, a `(256, 64)`
    delay line). XLA does not fuse into a conditional's users: the roll is
    written once, in one kernel, and the `select` reads the buffer and it at the
    same positions, in place. Read as a `max` over pairs of the rolled bits and
    zeros (a `reduce_window`, which XLA does not fuse into its users either) it
    took two kernels, and a traced insert a step took 1.2-1.5x as long (1.18
    against 0.78 us on a (4096,) line, 4.6 against 3.4 us on 16384, 33 against
    24 us on 65536; XLA:CPU). Pinned by `tests/test_one_line.py`; its exactness
    by `tests/test_ring.py::test_shifts_and_writes_move_every_bit_pattern`.
    """
    # (Rolled as bits: XLA:CPU moves the bfloat16 and float8 values of a pad
    # through float32, see `carrier`.)
    rolled = in_branch(lambda b: _rolled_by_pad(b, shift, axis), x, to_carrier(x))
    return from_carrier(rolled, x.dtype)


def window_by_reduce(s, st, sizes, d: int):
    """`(window, reduced)`: `s[st : st + sizes]`, read as a `max` over the window
    and its neighbour along `d` (a dimension it is 1 wide in), the neighbour masked
    out (`pick_by_max`): exact for every value of every real or bool dtype.
    `reduced` is the reduction's own result, to take the read's token from.

    A plain dynamic slice is cheap, so XLA duplicates it into each of its
    consumers, where it reads the storage unordered with respect to the next write:
    a copy. A reduction is materialised once, and its consumers (the next access,
    through the token) read its result. Reducing along a 2-wide dimension keeps it
    one kernel: XLA:CPU splits a reduction over more than 32 elements into two.

    The token is taken from `reduced`, not from the window bitcast back from it,
    so that the reduction has two users, the window and the token, as a reduction
    of the values had. With the bitcast as its only user, XLA fused the computation
    of the storage (a sum of cotangents) into the reduction as well as computing it
    for the write, so that the reduction read that sum's operands, unordered with
    respect to the write: a copy per step in the `kv_cache_attention` body's
    gradient.

    Pinned by `tests/test_corpus.py::test_no_per_iteration_copies` and
    `tests/test_in_place.py::test_reads_need_no_inner_loop`.
    """
    st = list(st)
    n = sizes[d]
    i0 = jnp.minimum(st[d], s.shape[d] - n - 1)
    k = jnp.minimum(st[d] - i0, 1)  # an index past the end is clamped, as in lax
    st[d] = i0
    wide = list(sizes)
    wide[d] = n + 1
    big = lax.dynamic_slice(s, st, wide, allow_negative_indices=NO_WRAP)
    if n == 1:
        return pick_by_max(big, k, d, keepdims=True)
    # A window `n > 1` wide along `d` (no dimension of the buffer it is 1 wide in:
    # rows of a delay line, a span of a 1-D buffer) is paired with the window one
    # further along `d`: both are slices of one read `n + 1` wide. Without a
    # dimension to pair on, such a read ran in a loop of its own (`_read_impl`),
    # and a window of a ring, two of them: 4x plain `lax`'s forward.
    # Paired as bits: XLA:CPU moves the bfloat16 and float8 values of a
    # concatenation through float32, dropping NaN payloads (see `carrier`).
    dtype = big.dtype
    if dtype != jnp.bool_:
        big = lax.bitcast_convert_type(big, bits_dtype(dtype))
    lo = lax.slice_in_dim(big, 0, n, axis=d)
    hi = lax.slice_in_dim(big, 1, n + 1, axis=d)
    window, reduced = pick_by_max(jnp.stack([lo, hi], d), k, d)
    return lax.bitcast_convert_type(window, dtype), reduced


# A read is materialised (`window_by_reduce`) only so that the next write of its
# buffer can wait for it; a read that no write follows needs none of that, and as a
# plain slice XLA fuses it into its consumers, as it does plain `lax` code: eleven
# one-row taps of a ring took eleven reduction kernels a step, 1.8x plain `lax`'s
# forward. Whether a write follows is not known when a read is traced or lowered,
# so an unbatched read is lowered as a plain `dynamic_slice` of the storage, marked,
# and returns its token through a marked hook; the lowering of each later access
# materialises the marked reads it may follow (`materialise_deferred_reads`),
# rewires their hooks to wait for them, and waits for them itself. A read that no
# access of ours sees stays plain: that costs at most a copy (XLA orders values,
# never computes a wrong one), which `esb.find_loop_copies` shows.
_DEFERRED_READ = "esb.deferred_read"
_READ_TOKEN = "esb.read_token"
# A deferred gather's mark (`deferred_read`): its ring axis and window sizes.
_RING = "esb.deferred_ring"
_SIZES = "esb.deferred_sizes"
_NBATCH = "esb.deferred_nbatch"


def run_time_values(values: list) -> list:
    """`values` through one `optimization_barrier`: XLA sees them as run-time
    values, and a deferred read's starts and token are found as its results."""
    return list(hlo.OptimizationBarrierOp(values).results)


def deferred_read(
    storage: ir.Value, tok: ir.Value, starts, sizes, ring=None, gather=None, nbatch=0
):
    """`(window, token)`: the unbatched read `storage[starts : starts + sizes]`,
    lowered as a plain `dynamic_slice`, for `materialise_deferred_reads` to find.
    A window of a ring whose rows wrap along the axis `ring` is a plain gather
    instead, `gather(storage, starts)` (a `stablehlo.gather` of `storage`), and
    its mark records `ring` and `sizes`; with `nbatch`, it is one window of each
    buffer of a batch along `nbatch` leading dimensions, and the mark records
    that too.

    The starts and the token go through one `optimization_barrier` (so that XLA
    sees the starts as run-time values, as in `run_time_indices`, and so that the
    token's hook can be found from the slice). The window is a marked no-op
    `reshape` of the slice and the token a marked no-op `reshape` of the token:
    materialising the read rewires their operands, so that the values the lowering
    returned, which JAX holds for the read's users still to be lowered, stay valid.

    Pinned by `tests/test_deferred_reads.py` and, for the reads an access follows,
    by every copy count of the suite.
    """
    tok, *starts = run_time_values([tok, *starts])
    if ring is None:
        read = hlo.DynamicSliceOp(storage, starts, mlir.dense_int_array(list(sizes)))
        value = read.result
    else:
        assert gather is not None
        value = gather(storage, starts)
        op = _operation(value.owner)
        assert op is not None and op.name == "stablehlo.gather"
    window = hlo.ReshapeOp(value.type, value)
    window.operation.attributes[_DEFERRED_READ] = ir.UnitAttr.get()
    if ring is not None:
        i64 = ir.IntegerType.get_signless(64)
        window.operation.attributes[_RING] = ir.IntegerAttr.get(i64, ring)
        window.operation.attributes[_SIZES] = mlir.dense_int_array(list(sizes))
        if nbatch:
            window.operation.attributes[_NBATCH] = ir.IntegerAttr.get(i64, nbatch)
    hook = hlo.ReshapeOp(tok.type, tok)
    hook.operation.attributes[_READ_TOKEN] = ir.UnitAttr.get()
    return window.result, hook.result


# A batch of windows, one of each batch element's buffer, read in a loop over the
# batch (`_primitives._read_impl`): the loop is materialised already (its result is
# a value XLA writes out), and stays where no edit follows it. XLA:CPU runs a
# batch of one-row reads (a delay line's taps) faster as loops than as gathers fused
# into their readers. An edit that follows it replaces it by one gather of the
# storage behind an `optimization_barrier` (`_materialise`), as a read it must
# wait for: the gather is one kernel where the loop's set-up is eight, which past
# XLA:CPU's threshold of eight kernels a loop body (`benchmarks/experiments/
# thunk_threshold.py`) made a batch of `slice_matmul_write` steps 1.3x plain
# `lax`'s forward. The unused tuple `_LOOP_READ` holds what the gather is made
# from: the storage, the window's mark, the token's hook, the token and the starts.
_LOOP_READ = "esb.loop_read"


def deferred_loop_read(
    storage: ir.Value, tok: ir.Value, starts, window: ir.Value, tok_after: ir.Value
) -> tuple[ir.Value, ir.Value]:
    """`(window, token)`: a batch of windows read by a loop over the batch
    (`window`, its token `tok_after`), marked so that an edit that follows it
    replaces the loop by a gather of `storage` at `starts` (`_materialise`), its
    token then made from `tok` (the loop's operand token, passed through the
    `optimization_barrier` that `starts` come from, as in `deferred_read`)."""
    mark = hlo.ReshapeOp(window.type, window)
    mark.operation.attributes[_DEFERRED_READ] = ir.UnitAttr.get()
    hook = hlo.ReshapeOp(tok_after.type, tok_after)
    hook.operation.attributes[_READ_TOKEN] = ir.UnitAttr.get()
    info = hlo.TupleOp([storage, mark.result, hook.result, tok, *starts])
    info.operation.attributes[_LOOP_READ] = ir.UnitAttr.get()
    return mark.result, hook.result


# A ring's whole line, read and rotated (`_primitives`' `rotate_p` with `ordered`):
# a plain rotation, a gather that XLA fuses into each of its readers, where no edit
# follows it. An edit of the storage that follows it makes it a rotation in a
# conditional (`in_branch`), which XLA writes out once, before the edit
# (`_materialise`): fused into several readers (the sum the user takes of it, and
# under `jax.grad` the stacking of it as a residual), each read the storage
# unordered with respect to the edit's write in place, and XLA copied the buffer
# (a delay line's `read()` then `insert(0, x)`: 2 copies a step forward, 2 under
# `grad`, 4 under `jvp`). Always in a conditional, the gradient of a delay line's
# `insert(0, x)` then `read()` took 1.1x as long (`benchmarks/patterns.py`'s
# `delay_whole`, `p.g/f` 3.5-3.7 against 3.9-4.1; under `esb.scan` 3.0-3.2 against
# 3.9). The unused tuple `_ROTATION` holds the window's mark and the rotation in a
# conditional, lowered beside the plain one, unused until an edit follows (XLA
# drops it otherwise).
_ROTATION = "esb.deferred_rotation"
# Once materialised, an unused tuple of the storage and the rotation's mark, for
# a function that calls an edit of the storage to wait for the rotation's readers
# (`_reads_before_call`).
_ROTATED = "esb.materialised_rotation"


# The key of a rotation in a conditional (`deferred_rotation`'s `in_a_branch`): its
# shift, through a marked no-op `reshape`. Where XLA finds the head constant (a
# ring that only window writes or middle inserts edit), the conditional folds
# away, and the rotation with it: the contents are the storage itself. Where the
# function returns them (`lax.scan`'s residual of a whole read before an insert,
# `copy_sweep.py`'s `all_ins`), the stacking then read the storage after the
# edit's write in place, and XLA copied the buffer (1 a step under `grad`, 2 under
# `vmap(grad)`). `_rekeyed` then keys it on the storage too, which XLA cannot
# fold: the rotation stays a new array, the snapshot the return needs, where it
# costs nothing more wherever the head moves.
_ROTATION_KEY = "esb.rotation_key"


def rotation_key(shift: ir.Value) -> ir.Value:
    """`shift`, through a marked no-op `reshape`, as the key of a rotation in a
    conditional (`_ROTATION_KEY`)."""
    hook = hlo.ReshapeOp(shift.type, shift)
    hook.operation.attributes[_ROTATION_KEY] = ir.UnitAttr.get()
    return hook.result


def deferred_rotation(
    x: ir.Value, rotated: ir.Value, in_a_branch: ir.Value, key: ir.Value
):
    """`rotated`, a rotation of `x`, marked so that an edit of `x` that follows it
    replaces it by `in_a_branch`, the same rotation in a conditional keyed on
    `key` (`rotation_key`, `_materialise`)."""
    # Under `vmap`, `x` is each batch element's whole buffer, the storage with a
    # unit dimension added, then dropped (`_primitives._each_element_whole`): the
    # storage is what its edit is of.
    while (op := _operation(x.owner)) is not None and (
        op.name == "stablehlo.reshape" and _unit_dims_only(op.operands[0], x)
    ):
        if any(m in op.attributes for m in _MARKS):
            # A window of the line read (a column of a delay line, `deferred_read`),
            # not the storage: an edit materialises that read first, and the
            # rotation reads the window. Deferred, the tuple held the window's
            # `dynamic_slice`, which `_materialise` erases: a dangling operand (a
            # verifier error forward, a crash under `jax.jvp`).
            return rotated
        x = op.operands[0]
    mark = hlo.ReshapeOp(rotated.type, rotated)
    mark.operation.attributes[_DEFERRED_READ] = ir.UnitAttr.get()
    info = hlo.TupleOp([x, mark.result, in_a_branch, key])
    info.operation.attributes[_ROTATION] = ir.UnitAttr.get()
    return mark.result


# The token made from a deferred rotation (`_primitives`' `after_p`): the token it
# was given, through a marked no-op `reshape` (its hook), until an edit follows
# the rotation; then the token made from the rotation in a conditional. Made from
# the plain rotation, the token was a second reader of it, and XLA wrote the
# rotation out before both where it had fused it into its one reader (under
# `jax.grad`, the stacking of it as a residual): a delay line's `insert(0, x)`
# then `read()`, whose gradient took 1.2x as long. The unused tuple
# `_ROTATION_WAIT` holds the rotation's mark, the hook and the waiting token.
_ROTATION_WAIT = "esb.deferred_rotation_wait"
_ROTATION_TOKEN = "esb.deferred_rotation_token"


def rotation_in_a_branch(x: ir.Value) -> ir.Value | None:
    """The rotation in a conditional of the deferred rotation whose mark's value
    is `x` (`deferred_rotation`), or None if `x` is not one."""
    mark = _operation(x.owner)
    if mark is None or _DEFERRED_READ not in mark.attributes:
        return None
    rotation = _info(mark, _ROTATION)
    return None if rotation is None else rotation.operands[2]


def deferred_token(x: ir.Value, tok: ir.Value, waiting: ir.Value) -> ir.Value:
    """`tok`, for the deferred rotation whose mark's value is `x` to replace by
    `waiting` if an edit follows it (`_materialise`)."""
    hook = hlo.ReshapeOp(tok.type, tok)
    hook.operation.attributes[_ROTATION_TOKEN] = ir.UnitAttr.get()
    info = hlo.TupleOp([x, hook.result, waiting])
    info.operation.attributes[_ROTATION_WAIT] = ir.UnitAttr.get()
    return hook.result


def _info(mark: ir.Operation, kind: str) -> ir.Operation | None:
    """The unused tuple (`_LOOP_READ`, `_ROTATION`) of a deferred read's mark, if
    it has one of `kind`."""
    for use in mark.result.uses:
        op = _operation(use.owner)
        if op is not None and kind in op.attributes:
            return op
    return None


def _barrier_above(v: ir.Value) -> ir.Operation:
    """The `optimization_barrier` a deferred gather's indices are computed from."""
    todo = [v]
    while todo:
        op = _operation(todo.pop().owner)
        if op is None:
            continue
        if op.name == "stablehlo.optimization_barrier":
            return op
        todo.extend(op.operands)
    raise AssertionError("eqx_shiftbuf: a deferred gather without its barrier")


# A read of a buffer's storage traced after an edit of that storage reads the value
# from before the edit (`new = buf.insert(...)`, then `buf.dynamic_slice(...)`):
# lowered where it is traced, after the edit's in-place write, it keeps the old
# storage alive past the write, and XLA copies the buffer (1-4 copies per step in
# every mode). Each edit's lowering therefore marks the storage it edits and the
# token it waits for (`marked_edit`); a read of a storage an edit already lowered
# in its block is lowered before that edit instead, and the edit's token is
# rewired to wait for it (`edits_of`, then `_primitives`' read lowering).
_EDIT_OF = "esb.edit_of"
_EDIT_TOKEN = "esb.edit_token"


def _hook_after(ops: list, i: int) -> ir.Operation | None:
    """The first edit token hook (`marked_edit`) among `ops` after the `i`-th."""
    return next((o for o in ops[i + 1 :] if _EDIT_TOKEN in o.attributes), None)


def marked_edit(storage: ir.Value, tok: ir.Value) -> ir.Value:
    """The token an edit of `storage` about to be lowered waits for: `tok` through
    a marked no-op `reshape` (its hook), after a marked, unused no-op `reshape` of
    `storage` that `edits_of` finds among the storage's uses."""
    mark = hlo.ReshapeOp(storage.type, storage)
    mark.operation.attributes[_EDIT_OF] = ir.UnitAttr.get()
    hook = hlo.ReshapeOp(tok.type, tok)
    hook.operation.attributes[_EDIT_TOKEN] = ir.UnitAttr.get()
    return hook.result


def edits_of(storage: ir.Value, operands, module) -> tuple | None:
    """`(anchor, hooks)` if edits of `storage` were lowered in the current block
    (`marked_edit`) and every one of `operands` is defined before the first:
    `anchor` is that edit's first marked operation, for a read of `storage` to be
    lowered before, and `hooks` the edits' token hooks, to wait for it. None
    otherwise (no such edit, or the read's indices are computed after it: it is
    then lowered where it is, and XLA copies)."""
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    marks = [
        op
        for op in (_operation(u.owner) for u in storage.uses)
        if op is not None and _EDIT_OF in op.attributes and op.block == block
    ]
    if not marks:
        return None
    ops = [o.operation for o in block.operations]
    at = [i for i, o in enumerate(ops) if any(o == m for m in marks)]
    # Each mark's hook: the next token hook after it (a read moved before the
    # edit earlier put its wait between the two).
    hooks = [_hook_after(ops, i) for i in at]
    if any(h is None for h in hooks):
        return None
    anchor, before = ops[at[0]], ops[: at[0]]
    # The read's indices are usually computed after the edit (its checks, a
    # ring's wrap): the pure operations that compute them move before it.
    moves: list = []
    if not all(_movable(v, block, before, moves, module) for v in operands):
        return None
    for op in moves:
        op.move_before(anchor)
    return anchor, hooks


# StableHLO operations with effects, never moved (a `custom_call` is moved only if
# it is a host callback: `_pure`); moving any other operation without marks of
# ours earlier in its block (after its operands) changes nothing but where it is.
_UNMOVABLE = frozenset(
    {
        "stablehlo.rng",
        "stablehlo.rng_bit_generator",
        "stablehlo.send",
        "stablehlo.recv",
        "stablehlo.infeed",
        "stablehlo.outfeed",
        "stablehlo.after_all",
        "stablehlo.create_token",
    }
)
# A read lowered materialised (batched, or of a dtype whose reads are not
# deferred) whose window is then used without its token (`dynamic_slice`): a later
# edit of the storage in the same block did not wait for it, and XLA copied the
# buffer (a window then an insert under `vmap`: 2 copies per step). The read's
# lowering leaves a dead `tuple` of the storage and its token, marked, for the
# edit's lowering to find (`after_marked_reads`); XLA removes it.
_READ_WAIT = "esb.read_wait"


def marked_read(storage: ir.Value, tok: ir.Value) -> None:
    """Mark a materialised read of `storage` whose token is `tok` (`_READ_WAIT`)."""
    op = hlo.TupleOp([storage, tok])
    op.operation.attributes[_READ_WAIT] = ir.UnitAttr.get()


def after_marked_reads(storage: ir.Value, tok: ir.Value, module) -> ir.Value:
    """`tok`, an edit's token, made to wait for the materialised reads of
    `storage` (`marked_read`) in the block being lowered: plus their tokens."""
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    for read in _marked_read_tokens(storage, module, block):
        if read.type == tok.type:
            tok = hlo.AddOp(tok, read).result
    return tok


def _marked_read_tokens(storage: ir.Value, module, block) -> list:
    """The tokens of the materialised reads of `storage` (and of the values it
    was passed on from, `_aliases`) in `block` (`marked_read`)."""
    found = []
    for v in _aliases(storage, module):
        for use in list(v.uses):
            op = _operation(use.owner)
            if (
                op is not None
                and _READ_WAIT in op.attributes
                and op.block == block
                and use.operand_number == 0
            ):
                found.append(op.operands[1])
    return found


_MARKS = (
    _EDIT_OF,
    _EDIT_TOKEN,
    _DEFERRED_READ,
    _READ_TOKEN,
    _READ_WAIT,
    _LOOP_READ,
    _ROTATION,
    _ROTATION_WAIT,
    _ROTATION_TOKEN,
    _ROTATED,
)


def _pure(op: ir.Operation, module) -> bool:
    """Whether `op` computes its results from its operands alone: a StableHLO
    operation with no effects or marks of ours, whose regions (a reduction's
    body, a conditional's branches) hold only such operations, or a call of a
    function (a `jax.jit` inside the program: `jnp.where`, an index check) whose
    operations all are."""
    if op.name in ("func.return", "stablehlo.return"):
        return True
    if op.name == "func.call":
        return _pure_blocks(_callee(op, module).regions, module)
    if op.name == "stablehlo.custom_call":
        # A host callback: an index check's error (`equinox.error_if`), raised
        # by the read's own check; run before the edit's, it raises the same.
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        token = hlo.TokenType.get()
        return "python" in target and all(t != token for t in op.results.types)
    return (
        op.name.startswith("stablehlo.")
        and op.name not in _UNMOVABLE
        and not any(m in op.attributes for m in _MARKS)
        and _pure_blocks(op.regions, module)
    )


def _pure_blocks(regions, module) -> bool:
    return all(
        _pure(o.operation, module)
        for region in regions
        for block in region.blocks
        for o in block.operations
    )


def _movable(v: ir.Value, block: ir.Block, before: list, moves: list, module) -> bool:
    """Whether `v` is, or can be, computed before the operations `before` end
    (appending to `moves`, in order, the operations to move there)."""
    owner = _operation(v.owner)
    if owner is None or owner.block != block:
        return True  # a block argument, or defined around the block
    if any(owner == o for o in before) or any(owner == o for o in moves):
        return True
    if not _pure(owner, module):
        return False
    used = [*owner.operands, *_captured(owner)]
    if not all(_movable(x, block, before, moves, module) for x in used):
        return False
    moves.append(owner)
    return True


def _captured(op: ir.Operation) -> list:
    """The values that the operations in `op`'s regions use and that are defined
    outside it: a conditional's branches read values from around it without
    taking them as operands (JAX lowers `lax.cond` so). Moved without them, an
    index check's conditional came before what its branches read, which MLIR's
    verifier refuses ("operand does not dominate this use": the gradient of a
    checkpointed `esb.scan` whose step edits inside a nested `jax.jit`, then
    reads the buffer from before the edit)."""
    inside, used = [], []

    def visit(o):
        for region in o.regions:
            for block in region.blocks:
                inside.extend(block.arguments)
                for nested in block.operations:
                    nested = nested.operation
                    used.extend(nested.operands)
                    inside.extend(nested.results)
                    visit(nested)

    visit(op)
    out = []
    for v in used:
        if not any(v == w for w in inside) and not any(v == w for w in out):
            out.append(v)
    return out


def lowered_at(anchor: ir.Operation, lower: Callable) -> Any:
    """`lower()`, with what it emits placed before `anchor`."""
    with ir.InsertionPoint(anchor):
        return lower()


def wait_at_hooks(hooks, tok: ir.Value) -> None:
    """Make each edit token hook (`marked_edit`) also wait for `tok`, a read's."""
    for hook in hooks:
        with ir.InsertionPoint(hook):
            hook.operands[0] = hlo.AddOp(hook.operands[0], tok).result


def _operation(owner) -> ir.Operation | None:
    """The operation of a value's owner or a use's owner (an op view), or None for
    a block (the value is a block argument)."""
    if isinstance(owner, ir.Block):
        return None
    return owner.operation


def _callee(call: ir.Operation, module) -> ir.Operation:
    name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
    return ir.SymbolTable(module.operation)[name].operation


def _aliases(storage: ir.Value, module, through_loops: bool = True) -> list:
    """`storage` and the values it was passed on from, through the operations
    that hand an operand on as a result: a loop, a barrier, a call of a function
    (a `jax.jit` inside the program, a step of a `lax.scan(..., unroll=k)`), whose
    returned value is an alias, and so is its argument if it returns that, so that
    their reads are found.

    The returned value of a called function: a step of an unrolled `lax.scan` is a
    call, whose reads at its end (a delay line's taps, read after the step's
    write) are left deferred when that function is lowered, and the next step's
    first edit follows them in the same loop body. Not found there, they were
    plain slices unordered with that edit: 2 copies per step forward, 4 under
    `jvp` (`tests/test_deferred_reads.py`)."""
    out, todo = [], [storage]
    while todo:
        v = todo.pop()
        out.append(v)
        owner = _operation(v.owner)
        if owner is None:
            continue
        k = next(i for i, r in enumerate(owner.results) if r == v)
        if owner.name == "stablehlo.optimization_barrier" or (
            through_loops and owner.name == "stablehlo.while"
        ):
            todo.append(owner.operands[k])
        elif owner.name == "func.call":
            body = _callee(owner, module).regions[0].blocks[0]
            returned = body.operations[len(body.operations) - 1].operands[k]
            todo.append(returned)
            if isinstance(returned.owner, ir.Block):  # the callee's argument
                todo.append(owner.operands[ir.BlockArgument(returned).arg_number])
    return out


def _in_a_called_function(storage: ir.Value) -> bool:
    """Whether `storage` is an argument of a function other than the entry: the
    body of a `jax.jit` inside the program, whose caller may have read it."""
    if not isinstance(storage.owner, ir.Block):
        return False
    op = storage.owner.owner.operation
    if op.name != "func.func":
        return False
    return ir.StringAttr(op.attributes["sym_name"]).value != "main"


def _marks(values) -> list:
    """The marked windows of the deferred reads of `values`."""
    out = []
    for value in values:
        for use in value.uses:
            sliced = _operation(use.owner)
            if (
                sliced is not None
                and (_LOOP_READ in sliced.attributes or _ROTATION in sliced.attributes)
                and use.operand_number == 0
            ):
                mark = _operation(sliced.operands[1].owner)
                if mark is not None and _DEFERRED_READ in mark.attributes:
                    out.append(mark)
                continue
            if (
                sliced is None
                or sliced.name not in ("stablehlo.dynamic_slice", "stablehlo.gather")
                or use.operand_number != 0
            ):
                continue
            for u in sliced.result.uses:
                mark = _operation(u.owner)
                if mark is not None and _DEFERRED_READ in mark.attributes:
                    out.append(mark)
    return out


def _open(block: ir.Block) -> bool:
    """Whether `block` is still being lowered: it has no terminator yet."""
    ops = block.operations
    n = len(ops)
    return n == 0 or ops[n - 1].operation.name not in (
        "func.return",
        "stablehlo.return",
    )


def _all_marks(module, detached: list | tuple = ()) -> list:
    """The marked windows of the deferred reads in blocks still being lowered:
    those of the functions and loop bodies whose lowering called the function being
    lowered; and those at the top of a finished function called from such a block
    (the step before this one, in a `lax.scan(..., unroll=k)`, or a `jax.jit` step
    called twice: see `lowered_once_per_call`). Reads in other finished blocks (an
    earlier loop, the forward pass of a gradient) cannot be followed by this
    access, and are left as they are. `detached`: functions being lowered outside
    the module, which JAX inlines into their caller once lowered
    (`jax.checkpoint`'s: see `_function_cache`), searched too.

    A loop is added to the program once its body is lowered, so the calls in a
    loop body being lowered are not reachable from the module yet: a finished
    function is taken as called from a block being lowered unless a call of it is
    reachable in a finished block (checked on jax 0.10 by
    `tests/test_deferred_reads.py`)."""
    marks, called_when_done = [], set()

    def visit(op):
        if _DEFERRED_READ in op.attributes:
            marks.append(op)
        elif op.name == "func.call" and not _open(op.block):
            called_when_done.add(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for func in detached:
        if _open(func.regions[0].blocks[0]):
            func.walk(visit)
    done = (None, "main", *called_when_done)
    return [m for m in marks if _open(m.block) or _top_of(m.block) not in done]


def _detached(func: ir.Operation) -> bool:
    """Whether `func` is outside any module (`jax.checkpoint`'s body, which JAX
    lowers as a function of its own and inlines: `mlir._emit_lowering_rule_as_fun`
    with `inline`)."""
    try:
        return func.parent is None
    except ValueError:  # (the bindings raise for an operation without a parent)
        return True


def _top_of(block: ir.Block) -> str | None:
    """The name of the function whose body `block` is, or None (a loop body, a
    branch)."""
    op = block.owner.operation
    if op.name != "func.func":
        return None
    return ir.StringAttr(op.attributes["sym_name"]).value


class _FunctionCache(dict):
    """A module's cache of lowered functions (`ModuleContext.
    cached_primitive_lowerings`) that does not hand out a function whose body holds
    deferred reads, and finishes a function when JAX stores it.

    Not handed out: JAX lowers a function once and calls it wherever the same
    jaxpr is called: the steps of a `lax.scan(..., unroll=k)` (each a `closed_call`
    of the body), a `jax.jit` step called twice. The reads at the end of the step
    are left deferred (plain slices that XLA fuses into their users) when it is
    lowered, and the next call's first edit, lowered with it and before them,
    cannot wait for them: XLA copied the buffer (2 copies per step forward, 4 under
    `jvp`, on a delay line's taps with `unroll=2`). Lowered again, the next call's
    edit is lowered after the previous call, and materialises its reads
    (`_all_marks`).

    Finished: JAX stores a function here once its body, return included, is
    lowered, the only point at which what it returns is known; the functions
    `finished_later` registered are finished then (`_finish`)."""

    def __init__(self, cache):
        super().__init__(cache)
        # `(func.func operation, the lowering context of an edit in it)`.
        self.pending: list = []

    def __getitem__(self, key):
        value = super().__getitem__(key)
        func = getattr(value, "func", value)  # `jax.jit`'s cache holds a record
        op = getattr(func, "operation", None)
        if op is not None and op.name == "func.func" and _holds_deferred_reads(op):
            raise KeyError(key)
        return value

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key, value):
        func = getattr(value, "func", value)
        op = getattr(func, "operation", None)
        for k, (pending, ctx, kit) in enumerate(self.pending):
            if op is not None and pending == op:
                del self.pending[k]
                _finish(ctx.replace(tokens_out=None), op, kit)
                break
        super().__setitem__(key, value)


def _function_cache(ctx) -> _FunctionCache:
    """The module's cache of lowered functions, made a `_FunctionCache`, and its
    cache of lowering rules emitted as functions (`ModuleContext.lowering_cache`:
    `jax.checkpoint`'s, which JAX inlines from there into its caller), made one
    sharing its pending functions."""
    module_ctx = ctx.module_context
    cache = module_ctx.cached_primitive_lowerings
    if not isinstance(cache, _FunctionCache):
        cache = _FunctionCache(cache)
        module_ctx.cached_primitive_lowerings = cache
    rules = module_ctx.lowering_cache
    if not isinstance(rules, _FunctionCache):
        rules = _FunctionCache(rules)
        module_ctx.lowering_cache = rules
    rules.pending = cache.pending
    return cache


def _holds_deferred_reads(func: ir.Operation) -> bool:
    ops = func.regions[0].blocks[0].operations
    return any(_DEFERRED_READ in op.operation.attributes for op in ops)


def lowered_once_per_call(ctx) -> None:
    """Make the module being lowered lower a function again for each call of it
    once one holds deferred reads (`_FunctionCache`): called where a read is
    deferred at the top of a function other than the entry."""
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    if _top_of(block) not in (None, "main"):
        _function_cache(ctx)


# Some orders are known only once a function called in a loop body (a step of
# `lax.scan`, a `jax.jit` helper inside it) is lowered whole, return included:
#
# - A function that returns a buffer's storage from before an edit of it (under
#   `jax.grad` of `lax.scan`, a step's whole-buffer read saved as a residual: `w =
#   buf.read(); y = (w * s).sum(); buf = buf.insert(...)`; or a step that outputs
#   the buffer as it was, `return buf.insert(...), buf.array`), or a slice of it,
#   or what elementwise operations compute from either (JAX's residual of `(w * c
#   * v).sum()` for `v` is `w * c`), leaves its caller to read the old storage
#   after the edit wrote it in place, when it stacks the result (`lax.scan`'s
#   `dynamic_update_slice` of its outputs, after the step's call). XLA copied the
#   buffer twice a step for that: the loop's parameter, and that copy again for
#   the edit. The buffer is read into a snapshot instead, before the edit, which
#   waits for it (a slice: read as a window, `user_slices_materialised`'s way):
#   one write of the buffer a step where XLA made two, and no copy.
# - A function called from the step that edits a buffer (`y = buf.array[0].sum();
#   buf = jit_insert(buf, ...)`) is lowered before its call, so its edit could not
#   wait for the reads its caller made of the buffer before the call
#   (`user_reads_before` searches the edit's own block): XLA copied the buffer,
#   1-2 a step forward and 2-4 under `jvp` (copy_sweep's `arr_jit`, every
#   shape). The token the call passes in is made to wait for them.
#
# Each access lowered at the top of a function other than the entry registers it
# (`finished_later`), and it is finished when JAX stores it in the module's cache
# (`_FunctionCache`): in its cache of functions, or of lowering rules emitted as
# functions, where `jax.checkpoint`'s body is stored before JAX inlines it into its
# caller (a step under `lax.scan(jax.checkpoint(step))`: its whole read before an
# insert, saved, copied 1-2 a step under `grad`, and a helper's edit after a read,
# 1-2 forward). A function JAX does not cache (one with constants or named
# arguments) keeps XLA's copies.


class Kit(NamedTuple):
    """The lowerings `_finish` uses, which `_primitives` defines:
    `fold_cotangent_sum`'s `accum`, and `user_slices_materialised`'s `reduced`
    and `can_reduce`."""

    accum: Callable
    reduced: Callable
    can_reduce: Callable


def finished_later(ctx, kit: Kit) -> None:
    """Register the function whose top block an access is being lowered in, for
    `_finish` once its lowering is done."""
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    if _top_of(block) in (None, "main"):
        return
    func = block.owner.operation
    cache = _function_cache(ctx)
    if not any(f == func for f, _, _ in cache.pending):
        cache.pending.append((func, ctx, kit))


def _finish(ctx, func: ir.Operation, kit: Kit) -> None:
    """What the accesses in the top block of the lowered function `func` need
    done once it returns: the cotangent sums it returns folded
    (`fold_cotangent_sum`: with no access after them in the function, none
    folded them), snapshots of the buffers it returns from before an edit, and
    the edits in the functions it calls made to wait for the reads before the
    call."""
    block = func.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    if not ops or ops[-1].name != "func.return":
        return
    ret, module = ops[-1], ctx.module_context.module
    with ir.InsertionPoint(ret):
        for v in list(ret.operands):
            fold_cotangent_sum(ctx, v, kit.accum, unmarked=True)
    for storage, waits in _edits_in(block, module):
        zeros = _returned_read_first(ctx, kit, block, ret, storage, waits)
        for wait in waits:
            if wait[0] == "call":
                zeros += _reads_before_call(ctx, kit, wait[1], storage)
            _wait(ctx, wait, zeros)


def _edits_in(block, module) -> list:
    """`(storage, waits)` for each storage that an edit in `block`, or in the top
    block of a function called there, edits: `waits` holds `("hooks", hooks)` for
    the edits of the block (`marked_edit`'s token hooks), `("call", call, t)` for
    each call, whose `t`-th operand is the token its edit waits for."""
    ops = [o.operation for o in block.operations]
    found: list = []

    def add(storage, wait):
        for s, waits in found:
            if s == storage:
                waits.append(wait)
                return
        found.append((storage, [wait]))

    for i, op in enumerate(ops):
        if _EDIT_OF in op.attributes:
            hook = _hook_after(ops, i)
            if hook is not None:
                add(op.operands[0], ("hooks", [hook]))
        elif op.name == "func.call":
            callee = _callee(op, module)
            if not callee.regions or not callee.regions[0].blocks:
                continue
            cops = [o.operation for o in callee.regions[0].blocks[0].operations]
            for k, mark in enumerate(cops):
                if _EDIT_OF not in mark.attributes:
                    continue
                hook = _hook_after(cops, k)
                a = _argument_number(mark.operands[0])
                t = None if hook is None else _argument_number(_token_source(hook))
                if a is not None and t is not None:
                    add(op.operands[a], ("call", op, t))
    return found


def _wait(ctx, wait: tuple, zeros: list) -> None:
    """Make the edits of `wait` (`_edits_in`) wait for the values `zeros`: for a
    call, its token operand plus a run-time zero made from each of them, computed
    before the call."""
    if not zeros:
        return
    if wait[0] == "hooks":
        for z in zeros:
            wait_at_hooks(wait[1], _token_zero(ctx, z, wait[1][0]))
        return
    _, call, t = wait
    tok = call.operands[t]
    tok_aval = _aval_of(tok)
    sub = ctx.replace(
        primitive=None,
        avals_in=[tok_aval, *(_aval_of(z) for z in zeros)],
        avals_out=[tok_aval],
    )
    with ir.InsertionPoint(call):
        (new,) = mlir.lower_fun(waiting, multiple_results=True)(sub, tok, *zeros)
    call.operands[t] = new


def _token_zero(ctx, value: ir.Value, hook: ir.Operation) -> ir.Value:
    """A run-time zero of the type of the token `hook` waits for, made from
    `value`, computed right after `value`."""
    tok_aval = _aval_of(hook.operands[0])
    sub = ctx.replace(primitive=None, avals_in=[_aval_of(value)], avals_out=[tok_aval])
    zero = lambda v: [opaque_zero(v).astype(tok_aval.dtype)]
    owner = _operation(value.owner)
    assert owner is not None  # a result of a snapshot or a window's read
    with ir.InsertionPoint.after(owner):
        (z,) = mlir.lower_fun(zero, multiple_results=True)(sub, value)
    return z


def waiting(tok, *values):
    """`[tok]` plus a run-time zero made from each of `values` (`opaque_zero`),
    for an access that must wait for them."""
    for v in values:
        tok = tok + opaque_zero(v).astype(tok.dtype)
    return [tok]


def _argument_number(v: ir.Value) -> int | None:
    """The number of the argument of its block that `v` is, if it is one."""
    if isinstance(v.owner, ir.Block):
        return ir.BlockArgument(v).arg_number
    return None


def _token_source(hook: ir.Operation) -> ir.Value:
    """The token the edit token hook `hook` waits for, back through the additions
    of waits to it (`read_token`, `wait_at_hooks`, `after_marked_reads`: the token
    is each addition's first operand) and no-op reshapes."""
    tok = hook.operands[0]
    for _ in range(64):
        op = _operation(tok.owner)
        if op is None or op.name not in ("stablehlo.add", "stablehlo.reshape"):
            break
        tok = op.operands[0]
    return tok


def _before(v: ir.Value, op: ir.Operation) -> bool:
    """Whether `v` is computed in `op`'s block, before `op`."""
    owner = _operation(v.owner)
    if owner is None or owner.block != op.block:
        return False
    for o in op.block.operations:
        if o.operation == owner:
            return True
        if o.operation == op:
            return False
    return False


def _rotations_of(storage: ir.Value, block) -> list:
    """The values of the marks of the rotations of `storage` in `block` (a ring's
    `.array`: `deferred_rotation`, materialised or not)."""
    out = []
    for use in storage.uses:
        op = _operation(use.owner)
        if (
            op is not None
            and op.block == block
            and (_ROTATION in op.attributes or _ROTATED in op.attributes)
            and use.operand_number == 0
        ):
            out.append(op.operands[1])
    return out


def _reads_before_call(ctx, kit: Kit, call: ir.Operation, storage: ir.Value) -> list:
    """The values to wait for of the reads of `storage` (and of a ring's
    rotations of it, `.array`) before `call` in its block: the user's
    (`user_reads_before`), the tokens of the library's reads that return none
    (`dynamic_slice`: `marked_read`), and the user's slices that only operations
    after the call read, read as windows (`_read_as_window`, as
    `user_slices_materialised` reads them)."""
    module, block = ctx.module_context.module, call.block
    values = [storage, *_rotations_of(storage, block)]
    with ir.InsertionPoint(call):
        found = [v for x in values for v, _ in user_reads_before(x, module)]
    found += _marked_read_tokens(storage, module, block)
    for x in values:
        for v, op in _user_uses(x, module, block):
            if (
                op.name not in ("stablehlo.slice", "stablehlo.dynamic_slice")
                or not _before(op.result, call)
                or any(_before(r, call) for r in _readers(op.result, block, 8))
            ):
                continue
            sizes = tuple(_aval_of(op.result).shape)
            if kit.can_reduce(_aval_of(v), sizes):
                read = _read_as_window(ctx, op, v, kit.reduced, sizes)
                if read is not None:
                    found.append(read[0])
    return [v for v in found if _before(v, call)]


def _snapshot(x):
    """`(copy, bits)`: `x` read through a reduction (`pick_by_max`), which XLA
    writes out, and the reduction's result, for the edits after it to wait for."""
    return list(pick_by_max(jnp.stack([x, x]), opaque_zero(x), 0))


def _returned_read_first(ctx, kit: Kit, block, ret, storage, waits) -> list:
    """Snapshot `storage` where the return `ret` of `block` takes it (or a view
    of it, `_whole_views`), or what elementwise operations compute from it, and
    read as windows the slices of it it takes so (`_read_as_window`), for the
    edits of `waits` to wait for; return the values to wait for."""
    module = ctx.module_context.module
    if not _known_dtype(storage):
        return []
    aval = _aval_of(storage)
    if jnp.issubdtype(aval.dtype, jnp.complexfloating):  # (`pick_by_max`: real)
        return []
    first = min(
        (_edit_position(w, block) for w in waits), default=len(block.operations)
    )
    # The storage, and its views made before its first edit: one made in the
    # edit's own lowering is its own read (a pop's value, where the line is one
    # element long: the whole storage), which the edit orders itself; given a
    # snapshot too, XLA copied the new line into the carry (1 a step under
    # `grad`, `tests/test_one_line.py`).
    views, late = [], []
    for v in _whole_views(storage, module, block):
        owner = _operation(v.owner)
        early = owner is None or owner.block != block or _position(owner, block) < first
        (views if early else late).append(v)
    wholes, slices = _returned_uses(ret, views, block, stop=late)
    out = []
    # A ring's `.array` is a rotation of its storage, a new array except where XLA
    # finds the head constant 0 and drops it: its returned slices are read as
    # windows too. (Not the whole rotation, which a snapshot would write out a
    # second time wherever the head moves, a delay line's.)
    for rotated in _rotations_of(storage, block):
        rot_wholes, rot_slices = _returned_uses(ret, [rotated], block)
        slices += rot_slices
        if rot_wholes and _rekeyed(ctx, rotated, storage):
            # (The token made from it, `_primitives._after_impl`, is folded
            # where XLA finds the head 0.)
            out.append(rotated)
    for op in slices:
        sizes = tuple(_aval_of(op.result).shape)
        if _position(op, block) < first and kit.can_reduce(
            _aval_of(op.operands[0]), sizes
        ):
            read = _read_as_window(ctx, op, op.operands[0], kit.reduced, sizes)
            if read is not None:
                out.append(read[0])
    if not wholes:
        return out
    # At the top of the block, or right after the storage is made: before every
    # operation that may take the snapshot.
    owner = _operation(storage.owner)
    at = ir.InsertionPoint.at_block_begin(block)
    if owner is not None and owner.block == block:
        at = ir.InsertionPoint.after(owner)
    avals_out = [ShapedArray(a.shape, a.dtype) for a in jax.eval_shape(_snapshot, aval)]
    sub = ctx.replace(primitive=None, avals_in=[aval], avals_out=avals_out)
    with at:
        copy, bits = mlir.lower_fun(_snapshot, multiple_results=True)(sub, storage)
    for op, k in wholes:
        v = copy
        if op.operands[k].type != copy.type:
            with ir.InsertionPoint(op):
                v = hlo.ReshapeOp(op.operands[k].type, copy).result
        op.operands[k] = v
    return [*out, bits]


def _rekeyed(ctx, rotated: ir.Value, storage: ir.Value) -> bool:
    """Key the conditional of the materialised rotation of `storage` whose mark's
    value is `rotated` (`_ROTATED`) on `storage` too, which XLA cannot fold
    (`_ROTATION_KEY`); whether it was one."""
    mark = _operation(rotated.owner)
    done = None if mark is None else _info(mark, _ROTATED)
    if done is None:
        return False
    hook = _operation(done.operands[2].owner)
    if hook is None or _ROTATION_KEY not in hook.attributes:
        return False
    del hook.attributes[_ROTATION_KEY]  # (once)
    shift = hook.operands[0]
    aval = _aval_of(shift)
    sub = ctx.replace(
        primitive=None, avals_in=[aval, _aval_of(storage)], avals_out=[aval]
    )
    with ir.InsertionPoint(hook):
        (key,) = mlir.lower_fun(waiting, multiple_results=True)(sub, shift, storage)
    hook.operands[0] = key
    return True


def _position(op: ir.Operation, block) -> int:
    return next(k for k, o in enumerate(block.operations) if o.operation == op)


def _edit_position(wait: tuple, block) -> int:
    """The position in `block` of the first edit of `wait` (`_edits_in`)."""
    if wait[0] == "call":
        return _position(wait[1], block)
    return min(_position(h, block) for h in wait[1])


def _returned_uses(
    ret: ir.Operation, views: list, block, depth: int = 8, stop: tuple | list = ()
) -> tuple:
    """`(wholes, slices)`: `(operation, operand number)` of each use of one of
    `views` by `ret` or by an elementwise operation of `block` whose result `ret`
    takes (at most `depth` deep), not past the values `stop`; and the user's
    slices of `views` (static, dynamic) whose results `ret` takes so
    (operations)."""
    wholes, slices, seen, todo = [], [], [], [(ret, depth)]
    while todo:
        op, d = todo.pop()
        for k, v in enumerate(op.operands):
            if any(v == w for w in views):
                wholes.append((op, k))
                continue
            if any(v == w for w in stop):
                continue
            src = _operation(v.owner)
            if (
                src is None
                or d == 0
                or src.block != block
                or any(m in src.attributes for m in _MARKS)
                or any(src == s for s in seen)
            ):
                continue
            if src.name in ("stablehlo.slice", "stablehlo.dynamic_slice"):
                if any(src.operands[0] == w for w in views):
                    seen.append(src)
                    slices.append(src)
                continue
            if src.name not in _ELEMENTWISE:
                continue
            seen.append(src)
            todo.append((src, d - 1))
    return wholes, slices


# The dtypes of the buffers whose reads are deferred: those XLA:CPU moves exactly
# (see `carrier`) and whose MLIR type `_aval_of` maps back. The others (bfloat16,
# float8, int4, ...) are read through a reduction as before. bfloat16 deferred
# too: a bfloat16 delay line's taps (`delay_taps`, (1024, 32), 100 steps) went from
# 2.8 to 1.8 ms forward, but XLA:CPU lowers such a slice as convert to float32,
# slice, convert back, whose NaN payloads survive only as its code generator
# happens to emit it, and the step still copied the buffer (1 a step: the reads
# take the write's bits, and XLA computes the write twice). Not kept.
DEFERRABLE_DTYPES = tuple(
    jnp.dtype(d)
    for d in (
        jnp.float32,
        jnp.float16,
        jnp.float64,
        jnp.int32,
        jnp.int64,
        jnp.int16,
        jnp.int8,
        jnp.uint32,
        jnp.uint64,
        jnp.uint16,
        jnp.uint8,
        jnp.bool_,
    )
)


# Every dtype whose values `_aval_of` may meet: a deferred read's storage, and the
# cotangents `fold_cotangent_sum` folds, of any inexact dtype (a bfloat16 buffer's
# whole-buffer `dynamic_slice` under `grad` raised a TypeError here when the list
# held only `DEFERRABLE_DTYPES`).
_IR_DTYPES = DEFERRABLE_DTYPES + tuple(
    jnp.dtype(d)
    for d in (
        getattr(jnp, name, None)
        for name in (
            "bfloat16",
            "complex64",
            "complex128",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e4m3b11fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e3m4",
            "float8_e4m3",
            "float8_e8m0fnu",
            "float4_e2m1fn",
            "int4",
            "uint4",
            "int2",
            "uint2",
        )
    )
    if d is not None
)


def aval_of(v: ir.Value) -> ShapedArray:
    """The aval of a value (during a lowering): its shape and dtype."""
    return _aval_of(v)


def _aval_of(v: ir.Value) -> ShapedArray:
    t = ir.RankedTensorType(v.type)
    for dtype in _IR_DTYPES:
        if mlir.dtype_to_ir_type(dtype) == t.element_type:
            return ShapedArray(tuple(t.shape), dtype)
    raise TypeError(f"eqx_shiftbuf: no dtype is known for the MLIR type {t}")


def _materialise(ctx, mark: ir.Operation, reduced: Callable, token_after: Callable):
    """Turn the deferred read whose window is `mark` into `reduced(storage,
    *starts, sizes=...) -> (window, bits)`, in its place, and its token hook into
    `token_after(token, bits)`, the token a read returns. Returns `bits`.

    A batch of windows read by a loop (`deferred_loop_read`) is made
    `reduced(..., nbatch=...)`, a gather behind a barrier, before its mark; the
    loop is then unused, and XLA drops it. A rotation (`deferred_rotation`) is
    replaced by the one in a conditional, and the tokens made from it
    (`deferred_token`) by those waiting for that; returns one of those tokens (or
    the rotation, if none was made: the buffer `.array` read is not carried on),
    which the edit waits for too."""
    rotation = _info(mark, _ROTATION)
    if rotation is not None:
        rotated: ir.Value = rotation.operands[2]
        mark.operands[0] = after = rotated
        del mark.attributes[_DEFERRED_READ]
        with ir.InsertionPoint(rotation):
            done = hlo.TupleOp(
                [rotation.operands[0], mark.result, rotation.operands[3]]
            )
        done.operation.attributes[_ROTATED] = ir.UnitAttr.get()
        rotation.erase()
        while (wait := _info(mark, _ROTATION_WAIT)) is not None:
            hook = _operation(wait.operands[1].owner)
            assert hook is not None and _ROTATION_TOKEN in hook.attributes
            hook.operands[0] = after = wait.operands[2]
            del hook.attributes[_ROTATION_TOKEN]
            wait.erase()
        return after, _aval_of(after)
    info = _info(mark, _LOOP_READ)
    if info is not None:  # a loop over the batch
        storage, _, hook_value, tok, *starts = info.operands
        hook = _operation(hook_value.owner)
        nbatch = len(_aval_of(starts[0]).shape)  # the windows' batch dimensions
        sizes = tuple(_aval_of(mark.result).shape[nbatch:])
        fn = functools.partial(reduced, sizes=sizes, ring=None, nbatch=nbatch)
        at, dead = mark, info
    else:
        sliced = _operation(mark.operands[0].owner)
        assert sliced is not None
        ring, nbatch = None, 0
        if _RING in mark.attributes:  # a gather (`deferred_read`)
            ring = ir.IntegerAttr(mark.attributes[_RING]).value
            sizes = tuple(ir.DenseI64ArrayAttr(mark.attributes[_SIZES]))
            barrier = _barrier_above(sliced.operands[1])
            starts = list(barrier.results[1:])
            del mark.attributes[_RING]
            del mark.attributes[_SIZES]
            if _NBATCH in mark.attributes:
                nbatch = ir.IntegerAttr(mark.attributes[_NBATCH]).value
                del mark.attributes[_NBATCH]
        else:
            barrier = _operation(sliced.operands[1].owner)
            starts = list(sliced.operands[1:])
            sizes = tuple(ir.DenseI64ArrayAttr(sliced.attributes["slice_sizes"]))
        assert barrier is not None and barrier.name == "stablehlo.optimization_barrier"
        tok = barrier.results[0]
        hook = next(
            op
            for op in (_operation(u.owner) for u in tok.uses)
            if op is not None and _READ_TOKEN in op.attributes
        )
        storage = sliced.operands[0]
        fn = functools.partial(reduced, sizes=sizes, ring=ring, nbatch=nbatch)
        at, dead = sliced, sliced
    assert hook is not None and _READ_TOKEN in hook.attributes
    avals_in = [_aval_of(storage)] + [_aval_of(i) for i in starts]
    avals_out = [ShapedArray(a.shape, a.dtype) for a in jax.eval_shape(fn, *avals_in)]
    sub = ctx.replace(primitive=None, avals_in=avals_in, avals_out=avals_out)
    with ir.InsertionPoint(at):
        window, bits = mlir.lower_fun(fn, multiple_results=True)(sub, storage, *starts)
    mark.operands[0] = window
    del mark.attributes[_DEFERRED_READ]
    # Erasing an operation still in use leaves a dangling operand: an MLIR
    # verifier error at best, memory corruption at worst (see `deferred_rotation`).
    if any(True for r in dead.results for _ in r.uses):
        raise AssertionError("eqx_shiftbuf: a materialised read is still in use")
    dead.erase()

    def waited(tok, bits):
        return [token_after(tok, bits)]

    tok_aval = _aval_of(tok)
    sub = ctx.replace(
        primitive=None, avals_in=[tok_aval, avals_out[1]], avals_out=[tok_aval]
    )
    with ir.InsertionPoint(hook):
        (new_tok,) = mlir.lower_fun(waited, multiple_results=True)(sub, tok, bits)
        # (For an edit in a function called after it, whose caller passes in
        # the buffer's token, not this read's: `_reads_before_call`.)
        marked_read(storage, new_tok)
    hook.operands[0] = new_tok
    del hook.attributes[_READ_TOKEN]
    return bits, avals_out[1]


def materialise_deferred_reads(
    ctx, storage: ir.Value, reduced: Callable, token_after: Callable
) -> tuple[list, list]:
    """`(waits, arrays)`: materialise (`_materialise`) the deferred reads that the
    access of `storage` being lowered may follow; `waits` are the `(bits, type)` of
    those in its block, which it must wait for, and `arrays` the rotations among
    them (`.array` of a ring), whose users' reads it must wait for too
    (`user_reads_before`): where XLA finds the ring's head constant 0 (a buffer
    made inside the program), it drops the rotation, and those reads read the
    storage (a copy a step for `y = buf.array[:8].sum()` then a traced insert).

    These are the reads of `storage` and of the values it was passed on from
    (`_aliases`), and, when `storage` is an argument of a called function (a
    `jax.jit` inside the program), every deferred read in a block still being
    lowered (`_all_marks`): its caller's reads are not reachable from here, and
    their tokens, passed in, are then made to wait for them. A read in another
    block (a `lax.cond` branch, a called function) is waited for through its token
    only. The search of the whole program is only for an access inside a called
    function, and costs a walk of the program lowered so far.
    """
    module = ctx.module_context.module
    # (`current` is a class property, which the stubs type as `Final`.)
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    marks = _marks(_aliases(storage, module))
    if _in_a_called_function(storage):
        # The caller's reads, in the blocks around this function's call. A read in
        # this access's own block that `_aliases` did not find is of another
        # buffer (under `jax.jvp`, the tangent read beside the primal one): left
        # deferred, its own access materialises it and waits for it. Taken here,
        # that access found no read to wait for, and XLA copied its buffer (a
        # token-less `dynamic_slice` then an insert, under `jvp`: 2 per step).
        detached = [f for f, _, _ in _function_cache(ctx).pending if _detached(f)]
        marks += [m for m in _all_marks(module, detached) if m.block != block]
    waits, arrays = [], []
    for mark in marks:
        if _DEFERRED_READ not in mark.attributes:  # found twice
            continue
        if mark.block == block and _info(mark, _ROTATION) is not None:
            arrays.append(mark.result)
        bits = _materialise(ctx, mark, reduced, token_after)
        if mark.block == block:
            waits.append(bits)
    return waits, arrays


# What a user's read of a whole buffer (`buf.array[:8].sum()`, whose array is the
# storage itself) passes through before a result XLA writes out: an edit after it
# waits for that result (`user_reads_before`).
_THROUGH = _ELEMENTWISE | frozenset(
    f"stablehlo.{n}" for n in ("slice", "broadcast_in_dim", "transpose", "convert")
)


def user_reads_before(storage: ir.Value, module) -> list:
    """`(value, aval)` of the results of the plain reads of `storage` (a static
    `slice` or a `reduce` of it or of a reshape of it, and what follows a slice
    elementwise, up to the next operation; elementwise operations of it, up to a
    reduction), in the block being lowered, that an edit of `storage` must wait
    for.

    `buf.array` is the storage itself: a slice of it then a sum, then an insert
    (`y = buf.array[:2].sum(); buf = buf.insert(...)`) left XLA free to run the
    sum after the insert, so it copied the buffer for it (2 copies per step
    forward). So did the whole buffer's weighted sum (`b, w = buf.read(); y =
    (w * s).sum()`, then an insert: 2 copies forward, 4 under `jvp`; the natural
    pattern `whole_read_first`). The library's own accesses read through dynamic
    slices and marks, and are waited for through their tokens. Only what the
    edit's lowering finds is waited for: a sum written after the edit in the
    program is not lowered yet, and XLA still copies the buffer for it."""
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    found: list = []
    # (Not the operand of a loop that wrote `storage`, a library access: the
    # access waited for the reads of it before it, and its own trip count is
    # one, which an edit waiting for made XLA read that operand again after the
    # loop wrote it in place: a copy per step in the gradient of two whole
    # reads of a complex ring then a traced insert. `_whole_views` does not
    # follow loops.)
    for v, op in _user_uses(storage, module, block):
        if op.name == "stablehlo.reshape" and _unit_dims_only(v, op.result):
            continue  # (a reshape of unit dimensions: a view, searched too)
        if op.name in _USER_SLICES:
            found += _readers(op.result, block, 8)
        elif op.name in _ELEMENTWISE and len(op.results) == 1:
            # The whole buffer computed with elementwise, up to a
            # reduction (`(w * s).sum()` of `w = buf.read()` or `.array`).
            # Not up to any other operation: the library's own elementwise
            # uses of a storage (a cotangent's, under `vmap(grad)`) end in
            # its writes, which an edit waiting for would copy the buffer.
            found += _readers(op.result, block, 8, reductions=True)
        elif op.name == "stablehlo.reduce":
            found.extend(r for r in op.results if _known_dtype(r))
    return [(v, _aval_of(v)) for v in found]


def user_slices_materialised(
    ctx, storage: ir.Value, reduced: Callable, can_reduce: Callable
) -> list:
    """Materialise the user's plain slices of `storage` (`buf.array[r, :16]`, a
    `lax.dynamic_slice` of `.array`) in the block being lowered that nothing uses
    yet (but elementwise operations: `_readers`); return the `(bits, type)` an
    edit of `storage` must wait for.

    Such a slice is used only after the edit being lowered: `w =
    buf.array[r, :16]; buf = buf.insert(...); y = (w * s).sum()` (a row read, then
    edited). `user_reads_before` finds no reader of it to wait for, and XLA fused
    the slice into its reader after the edit's in-place write: 2 copies of the
    buffer per step forward, 4 under `jvp`. The slice is read as the library reads
    a window before an edit, `reduced(storage, *starts, sizes=...) -> (window,
    bits)` (a reduction, which XLA does not fuse into its users), in its place, and
    the slice itself, whose value JAX holds for those later users, is rewired to
    take all of that window (a slice XLA then drops). `can_reduce(aval, sizes)`
    says whether a window can be read so (not one that is the whole buffer, nor of
    a complex dtype); the others are left as they are."""
    block = ir.InsertionPoint.current.block  # pyright: ignore[reportAttributeAccessIssue]
    waits = []
    for v, op in _user_uses(storage, ctx.module_context.module, block):
        if (
            op.name not in _USER_SLICES
            # (A slice read already, its readers waited for: materialised, a
            # static slice then its sum took a kernel more a step, and the
            # gradient of `array_then_insert` 1.3-1.5x as long.)
            or _readers(op.result, block, 8)
        ):
            continue
        aval, sizes = _aval_of(v), tuple(_aval_of(op.result).shape)
        layout = _gather_layout(op) if op.name == "stablehlo.gather" else None
        if layout == "batched":
            waits.append(_gathered_behind_barrier(op))
            continue
        if (op.name == "stablehlo.gather" and layout is None) or not can_reduce(
            aval, sizes
        ):
            continue
        read = _read_as_window(ctx, op, v, reduced, sizes)
        if read is not None:
            waits.append(read)
    return waits


def _user_uses(storage: ir.Value, module, block) -> list:
    """`(view, operation)` for each operation in `block` that takes a view of
    `storage` (`_whole_views`) as its first operand and is not one of the
    library's marks: the user's reads of the storage there."""
    found = []
    for v in _whole_views(storage, module, block):
        for use in list(v.uses):
            op = _operation(use.owner)
            if (
                op is not None
                and op.block == block
                and use.operand_number == 0
                and not any(m in op.attributes for m in _MARKS)
            ):
                found.append((v, op))
    return found


def _window_starts(op: ir.Operation, rank: int):
    """`(operands, starts)` of the slice, dynamic slice or one-window gather `op`:
    its index operands, and a function of their values that returns the window's
    start along each of the `rank` dimensions. None for a strided slice."""
    if op.name == "stablehlo.slice":
        if any(k != 1 for k in ir.DenseI64ArrayAttr(op.attributes["strides"])):
            return None
        first = [int(k) for k in ir.DenseI64ArrayAttr(op.attributes["start_indices"])]
        return [], lambda: [jnp.int32(k) for k in first]
    if op.name == "stablehlo.dynamic_slice":
        return list(op.operands[1:]), lambda *starts: list(starts)
    # A gather of one window, whose index vector holds the starts of some
    # dimensions (`start_index_map`); the others start at 0.
    dn = hlo.GatherDimensionNumbers(op.attributes["dimension_numbers"])
    index_map = list(dn.start_index_map)

    def starts(vector):
        return [
            vector[index_map.index(d)] if d in index_map else jnp.int32(0)
            for d in range(rank)
        ]

    return [op.operands[1]], starts


def _read_as_window(ctx, op: ir.Operation, storage: ir.Value, reduced, sizes):
    """`(bits, type)`: the window that the slice, dynamic slice or one-window
    gather `op` takes of `storage`, read before `op` by `reduced`
    (`window_by_reduce`), and `op` rewired to take all of that window; None where
    `op` is not read so (`_window_starts`)."""
    found = _window_starts(op, len(sizes))
    if found is None:
        return None
    operands, starts = found
    fn = functools.partial(reduced, sizes=sizes, ring=None, nbatch=0)

    def read(x, *idx):
        # (One index type: a gather's index vector is int64 under x64.)
        return fn(x, *(jnp.asarray(i).astype(jnp.int32) for i in starts(*idx)))

    avals_in = [_aval_of(storage)] + [_aval_of(i) for i in operands]
    avals_out = [ShapedArray(a.shape, a.dtype) for a in jax.eval_shape(read, *avals_in)]
    sub = ctx.replace(primitive=None, avals_in=avals_in, avals_out=avals_out)
    with ir.InsertionPoint(op):
        window, bits = mlir.lower_fun(read, multiple_results=True)(
            sub, storage, *operands
        )
        zeros = [mlir.ir_constant(np.zeros(a.shape, a.dtype)) for a in avals_in[1:]]
    op.operands[0] = window
    if op.name == "stablehlo.slice":
        op.attributes["start_indices"] = mlir.dense_int_array([0] * len(sizes))
        op.attributes["limit_indices"] = mlir.dense_int_array(list(sizes))
    for k, z in enumerate(zeros, start=1):
        op.operands[k] = z
    return bits, avals_out[1]


_USER_SLICES = ("stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.gather")


def _gather_layout(gather: ir.Operation) -> str | None:
    """`"batched"` if `gather` takes one window of each of a batch (more than one)
    of buffers, `"single"` if it takes one window of one buffer (a `dynamic_slice`
    under `vmap` at unbatched starts), each returned laid out as its operand is,
    so that a gather of its result with the same dimension numbers at zero starts
    is that result; None otherwise."""
    dn = hlo.GatherDimensionNumbers(gather.attributes["dimension_numbers"])
    shape = ir.RankedTensorType(gather.operands[0].type).shape
    index_rank = ir.RankedTensorType(gather.operands[1].type).rank
    sizes = list(ir.DenseI64ArrayAttr(gather.attributes["slice_sizes"]))
    batch = list(dn.operand_batching_dims)
    laid_out = [shape[d] if d in batch else sizes[d] for d in range(len(shape))]
    if not (
        not list(dn.collapsed_slice_dims)
        and batch == sorted(batch)
        and list(dn.start_indices_batching_dims)
        == sorted(dn.start_indices_batching_dims)
        and index_rank == len(batch) + 1
        and list(dn.offset_dims) == [d for d in range(len(shape)) if d not in batch]
        and list(ir.RankedTensorType(gather.result.type).shape) == laid_out
    ):
        return None
    # (A gather of a batch of one window XLA simplifies to a dynamic slice, which
    # it duplicates into its readers past a barrier: read as one window.)
    if batch and math.prod(shape[d] for d in batch) > 1:
        return "batched"
    return "single" if not batch else None


def _gathered_behind_barrier(gather: ir.Operation) -> tuple:
    """`(bits, type)`: the windows `gather` takes, gathered again before it behind an
    `optimization_barrier`, which XLA:CPU does not duplicate into their readers as
    it does a gather (for a batch of more than one window); `gather` is rewired to
    take them all (`_gather_layout`), so that its readers, lowered later, read
    them too."""
    with ir.InsertionPoint(gather):
        again = gather.clone()
        (windows,) = hlo.OptimizationBarrierOp([again.result]).results
        zeros = mlir.ir_constant(
            np.zeros(
                _aval_of(gather.operands[1]).shape, _aval_of(gather.operands[1]).dtype
            )
        )
    gather.operands[0] = windows
    gather.operands[1] = zeros
    return windows, _aval_of(windows)


def _whole_views(storage: ir.Value, module, block) -> list:
    """`storage`, the values it was passed on from (`_aliases`, not through
    loops), and, in `block`, their reshapes that add or drop unit dimensions only:
    the same array. Under `vmap`, a read of each batch element's whole buffer is
    the storage with a unit dimension added for the windows, then dropped
    (`_primitives._each_element_whole`). (Not a reshape that flattens it, as the
    library's own reads of its first element do, `_primitives._loop_zeros`.)"""
    out, todo = [], _aliases(storage, module, through_loops=False)
    while todo:
        v = todo.pop()
        out.append(v)
        for use in list(v.uses):
            op = _operation(use.owner)
            if (
                op is not None
                and op.block == block
                and op.name == "stablehlo.reshape"
                and not any(m in op.attributes for m in _MARKS)
                and _unit_dims_only(v, op.result)
            ):
                todo.append(op.result)
    return out


def _readers(v: ir.Value, block, depth: int, reductions: bool = False) -> list:
    """The results an edit can wait for of the operations in `block` that read
    `v`, past the operations that pass it on (`_THROUGH`, up to `depth` of them);
    with `reductions`, of reductions only."""
    found = []
    for use in list(v.uses):
        op = _operation(use.owner)
        if op is None or op.block != block or any(m in op.attributes for m in _MARKS):
            continue
        if op.name in _THROUGH and depth > 0 and len(op.results) == 1:
            found += _readers(op.results[0], block, depth - 1, reductions)
        elif reductions and op.name != "stablehlo.reduce":
            continue
        elif op.name.startswith("stablehlo.") and op.name not in _UNMOVABLE:
            found.extend(r for r in op.results if _known_dtype(r))
    return found


def _unit_dims_only(a: ir.Value, b: ir.Value) -> bool:
    """Whether `b`'s shape is `a`'s with unit dimensions added or dropped."""
    sa = [d for d in ir.RankedTensorType(a.type).shape if d != 1]
    sb = [d for d in ir.RankedTensorType(b.type).shape if d != 1]
    return sa == sb


def _known_dtype(v: ir.Value) -> bool:
    try:
        _aval_of(v)
    except (TypeError, ValueError):
        return False
    return True


def window2_edit(s, ix, axis, new_line, line=None, *, reduce_line=False, values=None):
    """Rewrite the line `s[ix[:-1]]` through a window of it and a neighbouring line.

    Returns `(storage, line)`, `line` as read. An ordered shift without a loop.
    XLA:CPU duplicates a write whose update is a single line (it counts as
    "effectively unary") into the next read of the storage, turning that read into
    a read of the older storage, unordered with respect to the write: the write
    copies. A write of two lines is not duplicated
    (`benchmarks/experiments/window2_shift.py` compares the lowerings).

    With `reduce_line`, the line is read as a masked `max` over the window (as in
    `window_by_reduce`), which XLA materialises once: a pop then indexes its
    removed element out of that value, ordered before the write by data alone and
    without a kernel of its own. (Indexed out of a plain slice, the element is
    duplicated into its consumers as a read of the storage: two copies per step in
    the two-insert gradient.)

    `values`: the dtype whose bits `s` holds (`carrier`: a bfloat16 or float8
    buffer), or None. XLA writes such bits in place only when nothing else in the
    write's fusion reads the storage: the window is then read from the values
    (a `dynamic_slice` moves them exactly) and materialised by a reduction first,
    a kernel of its own. Read from the bits in the write's fusion, it copied the
    buffer every step (a traced insert into a `(3, 2000)` bfloat16 buffer: 1
    copy forward, 2 under `grad`).

    Pinned by `tests/test_corpus.py::test_no_per_iteration_copies` on the
    `two_inserts`, `three_inserts` and `pop` bodies, and for `values` by
    `tests/test_in_place.py::test_an_edit_of_a_narrow_float_buffer_of_several_lines_is_in_place`.
    """
    # Every dimension before the line's that has two elements is spanned by two
    # (a window of a `(8, 32, 64)` buffer shifted along its last axis is `(2, 2,
    # 64)`): a window only 1 wide in one of them has fewer non-unit dimensions
    # than the buffer, and is duplicated as above (2 copies per step under `grad`
    # and `jvp` for an insert then a delete, while it spanned only `axis - 1`).
    start = list(ix[:-1]) + [jnp.zeros_like(ix[-1])] * (s.ndim - axis)
    sizes = [1] * axis + list(s.shape[axis:])
    k = None  # the line's position in the window, flattened
    for d in range(axis):
        n = s.shape[d]
        if n < 2:
            continue
        r0 = jnp.minimum(ix[d], n - 2)
        k_d = jnp.minimum(ix[d] - r0, 1)  # an index past the end is clamped, as in lax
        start[d], sizes[d] = r0, 2
        k = k_d if k is None else 2 * k + k_d.astype(k.dtype)
    assert k is not None, "window2_edit needs a dimension before the line's"
    lines = math.prod(sizes[:axis])
    if values is None:
        win = lax.dynamic_slice(s, start, sizes, allow_negative_indices=NO_WRAP)
    else:
        win = lax.dynamic_slice(
            from_carrier(s, values), start, sizes, allow_negative_indices=NO_WRAP
        )
        win = materialised(to_carrier(win), opaque_zero(k))  # (see above)
    win = win.reshape((lines,) + tuple(s.shape[axis:]))
    if reduce_line:
        line, _ = pick_by_max(win, k, 0)
    elif line is None:
        line = lax.dynamic_index_in_dim(win, k, 0, keepdims=False)
    new = new_line(jnp.int32(0), line, ix[-1]).astype(s.dtype)
    which = lax.broadcasted_iota(k.dtype, win.shape, 0)
    win = jnp.where(which == k, new[None], win)
    s = lax.dynamic_update_slice(
        s, win.reshape(sizes), start, allow_negative_indices=NO_WRAP
    )
    return s, line


def _nothing(*_: Any) -> None:
    pass


def varying_axes(x: Any) -> frozenset:
    """The `shard_map` axes that `x`'s value varies over (empty outside one)."""
    return varying_axes_of_aval(jax.typeof(x))


def varying_axes_of_aval(aval: Any) -> frozenset:
    """The `shard_map` axes that values of the type `aval` vary over."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def invariant(x: jax.Array) -> jax.Array:
    """`x`, or, if it varies over `shard_map` axes, a zero of its type that does
    not: the value `equinox.branched_error_if` passes through.

    Equinox's check is a `lax.cond` whose error branch returns a `pure_callback`'s
    result, typed as not varying; with a varying operand the two branches differ in
    type, which `shard_map`'s checks (`check_vma=True`) refuse. The operands passed
    through are run-time zeros, used only for the data dependence on the check's
    result, which a conditional's output has whatever it passes through.

    Pinned by `tests/test_sharding.py` (`shard_map` with its default checks).
    """
    if not varying_axes(x):
        return x
    return jnp.zeros(jnp.shape(x), x.dtype)


def check_on_the_side(error, pred, index, msgs) -> None:
    """Raise the error `error` records, through `equinox.branched_error_if`, with
    nothing depending on the check: the contents are returned as they are.

    A check whose result is not used is dead code to JAX and XLA (Equinox's check
    is a pure callback in a conditional). So the check runs inside a conditional
    that also makes a side-effecting (never dead) callback, taken only when `pred`
    holds: in "raise" mode the check raises first, the program stops and returns
    nothing, so no value of the bad buffer is ever seen. The contents need no data
    dependence on the check, so neither a copy nor a write of the storage: a
    conditional's result is a new buffer (`error_if(storage, ...)` copies the whole
    buffer every step when `.array` is read inside a loop), and writing a corner of
    the storage to make it depend on the check is an in-place write that the next
    edit of the buffer, or returning it from the step, then copies.

    The conditional is the primitive `check_p`, not a `lax.cond` around a
    `jax.debug.callback`: that callback is a JAX effect, and a jitted program with
    an effect is dispatched from Python rather than by `jax.jit`'s C++ fast path,
    about 0.2 ms more per call. `check_p` has no effect in its type; its DCE rule
    keeps it, and its lowering makes the callback with XLA's side-effect flag.

    `check_p`'s batching rule hands it the whole batch, which its lowering reduces
    inside the conditional: one callback for the batch. Batched, the callback runs
    once per element, on the element sliced out of the batch, which a batch
    sharded over devices on a mesh with explicit axes refuses
    (`ShardingTypeError`: a `jax.vmap` of a per-example loss that reads `.array`
    in its loop).

    Pinned by `tests/test_corpus.py::test_no_per_iteration_copies` on the
    `kv_cache_attention` body (which reads the whole cache every step), by the
    tests of `tests/test_errors.py` that a recorded error is raised, by
    `tests/test_errors.py::test_a_checked_read_leaves_the_jit_fast_path_on`, by
    `tests/test_sharding.py` (the per-example loss), and, for an access that
    touches no element (whose results XLA replaces by constants, so a check
    threaded into its indices would be dead code), by
    `tests/test_zero_size.py::test_traced_index_out_of_range_raises_when_the_program_runs`.
    """
    error = lax.stop_gradient(invariant(error))
    check_p.bind(pred, error, jnp.broadcast_to(index, jnp.shape(pred)), msgs=msgs)


def _reduced(pred, error, index):
    """The check of a batch (all operands of one shape) as one: whether any element
    fails, the largest record, and the message of the largest failing code."""
    if jnp.ndim(pred) == 0:
        return pred, error, index
    index = jnp.max(jnp.where(pred, index, jnp.zeros_like(index)))
    return jnp.any(pred), jnp.max(error), index


def _check_impl(pred, error, index, *, msgs):
    # Outside `jax.jit`: raise now, not when some later program runs.
    pred, error, index = _reduced(pred, error, index)
    jax.block_until_ready(eqx.branched_error_if(error, pred, index, msgs))
    return []


def _check_abstract(pred, error, index, *, msgs):
    del pred, error, index, msgs
    return []


def _check_lowered(pred, error, index, *, msgs):
    any_bad = jnp.any(pred)

    def check():
        # The batch is reduced in the branch: only `any` runs when nothing fails.
        _, e, i = _reduced(pred, error, index)
        checked = eqx.branched_error_if(e, any_bad, i, msgs)
        jax.debug.callback(_nothing, checked)

    # Inside a lowering nothing is removed as dead code any more: the callback's
    # effect is seen by XLA only (a side-effecting custom call, which keeps the
    # conditional), not by JAX's dispatch. XLA keeps it even where it finds the
    # record constant (`promise_in_bounds` edits of a buffer made in the
    # program): one conditional a step per read of `.array` in a loop. A loop of
    # `any_bad` trips instead, which XLA removes there, made `array_row_first`'s
    # forward with `promise_in_bounds` 2.2x faster, but the checked gradients of
    # `array_row_first` and `array_dslice` 1.4x slower (a loop costs more than a
    # conditional where the record is a run-time value): not taken.
    lax.cond(any_bad, check, lambda: None)
    return []


def _check_jvp(primals, tangents, *, msgs):
    del tangents  # the record, its code and the predicate are not differentiable
    check_p.bind(*primals, msgs=msgs)
    return [], []


def _check_batch(args, dims, *, msgs):
    # All operands take one shape, the batch axes first; the lowering reduces them.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [
        jnp.moveaxis(a, d, 0)
        if d is not None
        else jnp.broadcast_to(a, (size, *jnp.shape(a)))
        for a, d in zip(args, dims)
    ]
    check_p.bind(*args, msgs=msgs)
    return [], []


def _check_dce(used_outputs, eqn):
    # No output, and no effect in its type: the default rule would remove it.
    del used_outputs
    return [True] * len(eqn.invars), eqn


def _check_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    # Under `jax.checkpoint`: run once, in the forward pass, and not again in the
    # rematerialised one (as JAX does for effects), unless an operand is unknown.
    del saveable
    if any(unks_in):
        return None, eqn, [], [], [v for v, i in zip(eqn.invars, inst_in) if not i]
    return eqn, None, [], [], []


check_p = Primitive("esb_check")
check_p.multiple_results = True
check_p.def_impl(_check_impl)
check_p.def_abstract_eval(_check_abstract)
mlir.register_lowering(check_p, mlir.lower_fun(_check_lowered, multiple_results=True))
ad.primitive_jvps[check_p] = _check_jvp
batching.primitive_batchers[check_p] = _check_batch
pe.dce_rules[check_p] = _check_dce
pe.partial_eval_jaxpr_custom_rules[check_p] = _check_partial_eval_custom
# Its lowering makes callbacks, which JAX lowers only knowing the devices.
dispatch.prim_requires_devices_during_lowering.add(check_p)


@jax.custom_jvp
def after(storage: jax.Array, checked: jax.Array) -> jax.Array:
    """`storage`, data-dependent on `checked` (a record that is 0 if the program goes
    on), at the cost of rewriting a few elements in place: each output of a checked
    scan waits so for the replay's checks (`_replay`), which are otherwise dead.

    Used once per checked scan, after its loop. Not `error_if(storage, ...)`: a
    conditional's result is a new buffer, so that copies the whole storage. Not a
    `lax.optimization_barrier((storage, checked))` either: XLA drops a barrier's
    unused output and with it the (pure) check. Writing back the first elements,
    selected on `checked`, is an in-place write XLA cannot simplify away.

    Pinned by the `checked_mode` tests of `tests/test_scan_buffers.py`.
    """
    # The window spans 2 positions of every dimension that has them: XLA:CPU
    # duplicates a write whose update has a lower "true rank" (ignoring unit
    # dimensions) than the buffer, a single element say, into the next read of the
    # buffer, which then reads the older buffer, unordered with this write: a copy
    # (the `mixed` corpus body). The same reason as `window2_edit`.
    # The start is a run-time zero, not the constant 0: XLA turns a constant-index
    # read into a static `slice`, and a fusion that writes its operand in place may
    # read that operand only through a `dynamic-slice` at the write's own indices.
    # Otherwise the fusion is not in place and rewrites the whole buffer, every
    # step, with no `copy` instruction to show it (the detector reports such a
    # fusion as an out-of-place write). Not a zero made from `checked` alone: when
    # no edit records errors (`promise_in_bounds` edits only), XLA proves the
    # record is 0 and folds it. The corner's `max` is data XLA cannot fold, and a
    # reduction is materialised on its own rather than fused into the write.
    # The elements are rewritten as their bits where XLA:CPU would not write them
    # exactly (`carrier`): the outputs keep every bit.
    dtype = storage.dtype
    storage = to_carrier(storage)
    sizes = tuple(min(2, n) for n in storage.shape)
    corner = lax.slice(storage, (0,) * storage.ndim, sizes)
    if jnp.issubdtype(corner.dtype, jnp.complexfloating):
        corner = jnp.real(corner)
    zero = opaque_zero(jnp.max(corner)) + opaque_zero(checked)
    first = (zero,) * storage.ndim
    win = lax.dynamic_slice(storage, first, sizes)
    win = jnp.where(checked != 0, jnp.zeros_like(win), win)
    return from_carrier(lax.dynamic_update_slice(storage, win, first), dtype)


@after.defjvp
def _after_jvp(primals, tangents):
    # The tangent is the storage's own: the write is an identity wherever the
    # program goes on, so nothing is added to the tangent (or transposed) program.
    storage, checked = primals
    return after(storage, checked), tangents[0]


def split_over_devices(lowered: Callable, n_arrays: int) -> Callable:
    """`lowered` (a primitive's lowering, whose indices follow `n_arrays` array
    operands), run by each device on its own elements when the primitive is
    batched (its `nbatch` parameter, > 0) and the batch is sharded over devices.

    Every non-scalar operand and result of a batched primitive has the `nbatch`
    batch dimensions first, and its first `nbatch` index operands are the batch
    positions (`_primitives._batch_common`); the token is a scalar. The batched
    lowering loops over the batch elements, indexing the storage at each one:
    XLA's SPMD partitioner cannot tell that element `j` of the storage is only ever
    touched at position `j`, and all-gathers the whole storage for each dynamic
    index (4 all-gathers of the buffer in the gradient of a vmapped insert + delete
    scan, over 100 times slower than one device). As a `custom_partitioning`, each
    device runs the same loop over its own elements, with its local batch
    positions: no collective moves the buffer. On one device, or inside a
    `shard_map`, JAX lowers it as `lowered` itself. The line and shift dimensions
    must not be sharded (`_storage_batch_spec` raises).

    Pinned by `tests/test_sharding.py` (no collective on buffer-sized operands).
    """
    from jax.experimental.custom_partitioning import (
        custom_partitioning,
        SdyShardingRule,
    )
    from jax.sharding import NamedSharding

    def rule(*args, **params):
        nbatch = params["nbatch"]
        if nbatch == 0:
            return lowered(*args, **params)

        @custom_partitioning
        def split(*xs):
            return tuple(lowered(*xs, **params))

        def local(*xs):
            # Each device's elements are at positions 0, 1, ... of its own shard.
            return tuple(lowered(*_local_positions(xs, n_arrays, nbatch), **params))

        def shardings(mesh, spec, shapes):
            return tuple(NamedSharding(mesh, _pad_spec(spec, s.ndim)) for s in shapes)

        def infer(mesh, arg_shapes, result_shape):
            spec = _storage_batch_spec(arg_shapes[0], nbatch)
            return shardings(mesh, spec, jax.tree.leaves(result_shape))

        def partition(mesh, arg_shapes, result_shape):
            spec = _storage_batch_spec(arg_shapes[0], nbatch)
            res = shardings(mesh, spec, jax.tree.leaves(result_shape))
            return mesh, local, res, shardings(mesh, spec, arg_shapes)

        def sharding_rule(mesh, operand_types, result_types):
            # The batch dimensions are shared; the storage's others are its own,
            # from operand to result; every other dimension is separate.
            def mapping(t, name):
                rank = len(t.shape)
                if rank == 0:
                    return ()
                batch = tuple(f"b{d}" for d in range(nbatch))
                return batch + tuple(f"{name}{d}" for d in range(nbatch, rank))

            ops = [
                mapping(t, f"x{i}_" if i else "s") for i, t in enumerate(operand_types)
            ]
            res = [
                mapping(t, f"y{i}_" if i else "s") for i, t in enumerate(result_types)
            ]
            return SdyShardingRule(tuple(ops), tuple(res))  # pyright: ignore[reportArgumentType]  (tuples of factor names are what it takes)

        split.def_partition(
            partition=partition,
            infer_sharding_from_operands=infer,
            sharding_rule=sharding_rule,
        )
        return list(split(*args))

    return rule


def on_several_devices(ctx) -> bool:
    """Whether the program being lowered (an MLIR lowering context) is partitioned
    over several devices by XLA, outside any `shard_map`: then a batched access
    must be split (`split_over_devices`). Not when lowered for no devices (an
    export or a `.lower` without them) or inside a `shard_map`, where the values
    are each device's own."""
    from jax._src import sharding_impls

    axis_context = ctx.module_context.axis_context
    if not isinstance(axis_context, sharding_impls.ShardingContext):
        return False
    devices = axis_context.device_assignment
    return devices is not None and len(devices) > 1


def _local_positions(xs, n_arrays: int, nbatch: int) -> list:
    """The operands, the first `nbatch` index operands replaced by the batch
    positions of this device's shard (iotas along the batch dimensions)."""
    xs = list(xs)
    for k in range(nbatch):
        i = n_arrays + k
        xs[i] = lax.broadcasted_iota(xs[i].dtype, xs[i].shape, k)
    return xs


def _storage_batch_spec(storage_shape, nbatch: int) -> tuple:
    """The mesh axes that shard the storage's batch dimensions; raises if a line
    or shift dimension is sharded."""
    from jax.sharding import NamedSharding

    sharding = getattr(storage_shape, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return (None,) * nbatch
    spec = tuple(sharding.spec)
    spec = spec + (None,) * (len(storage_shape.shape) - len(spec))
    if any(s is not None for s in spec[nbatch:]):
        raise ValueError(
            "eqx_shiftbuf: a batch of buffers may be sharded over devices along its "
            f"batch axes only; this one (shape {tuple(storage_shape.shape)}, "
            f"{nbatch} batch axes) has the sharding {sharding.spec}, which splits "
            "the lines or the shift axis of each buffer. Shard the batch axes "
            "only, e.g. PartitionSpec('b') for a batch made by jax.vmap."
        )
    return spec[:nbatch]


def _pad_spec(spec: tuple, ndim: int):
    from jax.sharding import PartitionSpec

    return PartitionSpec(*spec[:ndim], *((None,) * max(0, ndim - len(spec))))


def lowered_without_explicit_shardings(lower_rule: Callable) -> Callable:
    """An MLIR lowering rule, traced with every type local: on operand and result
    types stripped of their mesh, and with no mesh in context, so that the values
    the lowering makes (constants, iotas, loop states) are typed as its operands.

    On a mesh with explicit axes (the default of `jax.make_mesh`), the types of a
    batch sharded over devices carry its sharding, and the lowering's `lax`
    operations are type-checked against it: taking the first element of the
    storage for a run-time zero (`opaque_zero`, `loop_not_unrolled`) slices a
    sharded dimension, which JAX refuses (`ShardingTypeError`). Stripping only
    the sharded types is not enough: the other operands (a fill or an index made
    under `jax.vmap`, replicated) and the values the lowering makes under
    `jax.set_mesh` are typed on the mesh, and an operation that requires equal
    types (`dynamic_update_slice` of a local storage with an update on the mesh)
    refuses them. The lowering is partitioned by `split_over_devices`, each
    device running it on its own elements, so its body needs no sharding in its
    types. Inside a `shard_map` the types are local and kept as they are; a
    program on no explicit mesh is lowered as it is.

    Pinned by `tests/test_sharding.py` (the explicit mesh, and `jax.vmap` of a
    per-example loss under `jax.set_mesh`).
    """

    def rule(ctx, *args, **params):
        if not any(on_explicit_mesh(a) for a in (*ctx.avals_in, *ctx.avals_out)):
            return lower_rule(ctx, *args, **params)
        from jax.sharding import AbstractMesh, use_abstract_mesh

        ctx = ctx.replace(
            avals_in=[_local(a) for a in ctx.avals_in],
            avals_out=[_local(a) for a in ctx.avals_out],
        )
        with use_abstract_mesh(AbstractMesh((), ())):
            return lower_rule(ctx, *args, **params)

    return rule


def on_the_operands_mesh(fn: Callable) -> Callable:
    """`fn` (an operation of the library, traced on its operands), run with the
    mesh of its operands' types in context when there is none.

    On a mesh with explicit axes, the values an operation makes from constants
    (an error code, an index, a fill) have the context's mesh in their type, and
    its operands the mesh they were sharded on. Without `jax.set_mesh`, the
    context has none: a constant selected by a per-example condition under
    `jax.vmap` (the error code of a traced index) is then typed on no mesh, and
    when `jax.vmap` batches a `lax.scan` body that holds it over the sharded
    batch, JAX cannot type it (`ValueError: Resource axis: b of P('b',) is not
    found in mesh: ()`). Plain JAX code fails alike; an operation of this library
    runs as it would under `jax.set_mesh(mesh)`. Inside a `shard_map` (manual
    axes), on an `Auto` mesh, or with a mesh in context, `fn` runs as it is.

    Pinned by `tests/test_sharding.py` (`jax.vmap` of a per-example loss with
    traced indices, on an explicit mesh not set in context).
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        from jax.sharding import get_abstract_mesh, use_abstract_mesh

        if not get_abstract_mesh().empty:
            return fn(*args, **kwargs)
        mesh = next(
            (
                m
                for x in jax.tree.leaves((args, kwargs))
                if isinstance(x, jax.Array)
                and (m := _explicit_mesh(jax.typeof(x))) is not None
            ),
            None,
        )
        if mesh is None:
            return fn(*args, **kwargs)
        with use_abstract_mesh(mesh):
            return fn(*args, **kwargs)

    return wrapped


def explicit_sharding(aval) -> Any:
    """The sharding in the type `aval`, if it has one on a mesh with explicit
    axes (else None): what a value made to have that type must be given."""
    return aval.sharding if _explicitly_sharded(aval) else None


def _explicit_mesh(aval) -> Any:
    """The mesh of `aval`'s type if it has explicit axes and none manual (outside
    a `shard_map`), else None."""
    from jax.sharding import AxisType

    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or getattr(mesh, "manual_axes", ()):
        return None
    types = getattr(mesh, "axis_types", ())
    return mesh if any(t == AxisType.Explicit for t in types) else None


def on_explicit_mesh(aval) -> bool:
    return _explicit_mesh(aval) is not None


def _explicitly_sharded(aval) -> bool:
    if _explicit_mesh(aval) is None:
        return False
    return any(s is not None for s in aval.sharding.spec)


def _local(aval):
    """`aval` with no mesh (a `ShapedArray` of its shape and dtype), if it has an
    explicit one."""
    if not on_explicit_mesh(aval):
        return aval
    from jax.sharding import AbstractMesh, use_abstract_mesh

    with use_abstract_mesh(AbstractMesh((), ())):
        return ShapedArray(aval.shape, aval.dtype, aval.weak_type)


def tokens_per_element(tok: Any, tdim: int | None) -> bool:
    """Whether a batched access keeps the batch's tokens one per element (an
    operand and result of the batched primitive shaped as its batch dimensions),
    rather than reducing them to one scalar token for the whole batch, as it does
    otherwise: `tok` is the token operand under `jax.vmap`, batched along `tdim`.

    Per element when `tok` already is (its unbatched shape is not scalar), or when
    its batch dimension is sharded over devices in its type (a mesh with explicit
    axes, the default of `jax.make_mesh`). There, the scalar token of a batch is a
    `max` over a sharded dimension, which the partitioned program computes with an
    all-reduce across devices, and its JVP and transpose with one more each: 3
    small all-reduces every step of a vmapped insert + delete `lax.scan`'s
    gradient, each a barrier for all devices, which made it 5 times slower on 4
    CPU devices than on one. Kept per element, the tokens are reduced by the
    primitive's own lowering (`tokens_reduced_locally`), which the partitioned
    program runs on each device's own elements (`split_over_devices`): no
    collective. On an `Auto` mesh the types carry no sharding and XLA's
    partitioner keeps the scalar token local; on one device there is nothing to
    split; both keep the scalar token (whose lowering is unchanged).

    Pinned by `tests/test_sharding.py` (no collective in any loop of the
    compiled gradient).
    """
    shape = jnp.shape(tok)
    if len(shape) > (0 if tdim is None else 1):
        return True
    if tdim is None:
        return False
    sharding = getattr(jax.typeof(tok), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or getattr(mesh, "manual_axes", ()):
        return False
    spec = tuple(sharding.spec)  # pyright: ignore[reportOptionalMemberAccess]  (a mesh implies a sharding)
    return tdim < len(spec) and spec[tdim] is not None


def tokens_reduced_locally(impl: Callable) -> Callable:
    """`impl` (a primitive's implementation: operands `(storage, token, ...)`,
    the token its last result) for a token that may be one per batch element
    (`tokens_per_element`): the access waits for the `max` of the tokens, and
    returns its token broadcast back to their shape. A scalar token is passed
    through as it is.

    Inside the lowering, the reduction covers the elements the device edits
    (`split_over_devices` hands each device its own), so the tokens of other
    devices' elements, which order nothing here, need no collective.

    Pinned by `tests/test_sharding.py`, as `tokens_per_element`.
    """

    def wrapped(storage, tok, *rest, **params):
        if jnp.ndim(tok) == 0:
            return impl(storage, tok, *rest, **params)
        out = impl(storage, jnp.max(tok), *rest, **params)
        return (*out[:-1], jnp.broadcast_to(out[-1], jnp.shape(tok)))

    return wrapped
