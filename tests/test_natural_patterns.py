"""The patterns users write without thinking about XLA (`tests/natural.py`): in
place, and equal to the same step in plain `lax`.

Each `(row, mode)` below compiles a scan, so the list is the headline cases only;
`python benchmarks/patterns.py` counts every row under every mode. A program that
both tests use (a row's forward or gradient) is compiled once, for its copies and
its values.
"""

import functools
import math

import jax
import numpy as np
import pytest

import eqx_shiftbuf as esb

from . import natural, reference
from .tape import loop_buffer_work


# On one xdist worker (`--dist loadgroup`): the tests share compiled programs
# (the caches below), which another worker would compile again.
pytestmark = pytest.mark.xdist_group("natural_patterns")


# Steps of every scan: enough for XLA to keep the loop (a copy is per iteration,
# whatever the length).
STEPS = 12


@functools.cache
def _program(row, mode, ops):
    """`(jitted program, its arguments)`: one jitted object per row, mode and
    implementation, shared by the tests that compile it."""
    r = natural.ROWS_BY_NAME[row]
    fn = natural.program(mode, natural.make_loss(r, ops), r.batch_init)
    jit = reference.jit_reference if ops is natural.PLAIN else jax.jit
    return jit(fn), natural.args_for(r, mode, STEPS)


def _assert_matches_plain_lax(row: str, mode: str) -> None:
    """The row's program under `mode` returns plain `lax`'s values (and
    derivatives)."""
    fn, args = _program(row, mode, natural.ESB)
    ref, ref_args = _program(row, mode, natural.PLAIN)
    got, want = fn(*args), ref(*ref_args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)


# (row, mode) pairs with 0 per-step copies. A row that copies as plain `lax` does (a
# `lax.cond` on the carry) is not here: see the README's known limits, and its
# alternative `select_stack`.
IN_PLACE = [
    ("pyint", "fwd"),
    ("pyint", "grad"),
    ("pyint", "jvp"),
    ("npint", "grad"),
    ("one_line", "grad"),
    ("one_line", "jvp(vmap)"),
    ("one_d", "grad"),
    ("one_d", "jvp"),
    # Two shifts of one line, nothing read between them: the roll of each is
    # materialised (`_xla.rolled_in_branch`); plain `lax` copies.
    ("one_d_del", "fwd"),
    ("one_d_del", "grad"),
    ("one_d_del", "jvp"),
    ("two_lines", "grad"),
    ("two_lines", "jvp"),
    # A small batch of one-line buffers: its shifts one `select` over the
    # batch, its window one gather (`_primitives._shift_each_line`).
    ("text", "vmap"),
    ("text", "vmap(grad)"),
    ("text", "jvp(vmap)"),
    ("whole_ds", "fwd"),
    ("whole_ds", "jvp"),
    # The two cotangents of the buffer a `dynamic_slice` leaves used twice are
    # added in place (`_xla.fold_cotangent_sum`); plain `lax` copies under grad.
    ("whole_ds", "grad"),
    ("whole_ds", "vmap(grad)"),
    ("whole_read", "grad"),
    # The whole buffer's weighted sum, then an insert: the insert waits for the
    # sum (`_xla.user_reads_before`); plain `lax` copies 2 and 4. Under `grad`
    # the step returns the window, the buffer itself, as a residual, which JAX
    # stacks after the step: a snapshot of it is taken before the insert, which
    # waits for it (`_xla._snapshot_returned`); plain `lax` copies 4 and 3.
    ("whole_read_first", "fwd"),
    ("whole_read_first", "grad"),
    ("whole_read_first", "jvp"),
    ("whole_read_first", "vmap(grad)"),
    # The same with the buffer before the insert as the step's output; under
    # `grad` its cotangent, added to the buffer's after the insert's transpose
    # with no access after it, is folded at the step's return
    # (`_xla._finish`). Plain `lax` copies 2, 1 and 4.
    ("history", "fwd"),
    ("history", "grad"),
    ("history", "jvp"),
    ("history", "vmap(grad)"),
    ("whole_array", "grad"),
    ("whole_array", "vmap(grad)"),
    # `.array` after the step's edits: read through `read_p`, its cotangent
    # accumulated in place, and under `vmap(grad)` an unbatched accumulation
    # broadcast over the batch folded in too (`_xla.fold_cotangent_sum`).
    ("array_slice", "grad"),
    ("array_slice", "vmap(grad)"),
    ("delay_array", "vmap(grad)"),
    ("delay_array_row", "grad"),
    ("delay_array_row", "jvp(vmap)"),
    # A static slice of `.array` read before an insert that does not use it: the
    # insert waits for the slice's sum (`_xla.user_reads_before`).
    ("array_then_insert", "fwd"),
    ("array_then_insert", "grad"),
    ("array_then_insert", "jvp"),
    # A slice of `.array` taken before an insert and used after it: the slice is
    # read as a window the insert waits for, and the value JAX holds for its
    # users is rewired to that window (`_xla.user_slices_materialised`); under
    # `vmap`, a batch of rows is a gather, gathered again behind a barrier.
    # Plain `lax` copies 2-5 a step.
    ("array_row_first", "fwd"),
    ("array_row_first", "jvp"),
    ("array_row_first", "vmap(grad)"),
    ("array_row_first", "jvp(vmap)"),
    ("array_row_sum_first", "jvp"),
    ("array_row_sum_first", "vmap(grad)"),
    ("array_window_first", "grad"),
    ("array_window_first", "vmap(grad)"),
    ("array_window_first", "jvp(vmap)"),
    ("array_block_first", "fwd"),
    ("array_block_first", "grad"),
    # `lax.dynamic_slice(buf.array, ...)` of a 3-D buffer before an insert:
    # under `vmap(grad)` its cotangent is JAX's scatter into zeros the size of
    # the batch of buffers, folded into an accumulation of the windows
    # (`_xla._zeros_around`); at Python-int starts it was written out of place, a
    # copy a step.
    ("array_ds_first", "grad"),
    ("array_ds_first", "vmap(grad)"),
    ("array_ds_pyint", "grad"),
    ("array_ds_pyint", "vmap(grad)"),
    # The same on a ring whose head XLA finds constant 0: it drops the rotation
    # `.array` is, and the slice reads the storage; the insert waits for the
    # users of the rotation too (`_xla.materialise_deferred_reads`).
    ("ring_array_first", "fwd"),
    ("ring_array_first", "grad"),
    ("ring_array_first", "jvp(vmap)"),
    # The whole line of such a ring read, then an insert: under `grad` the window
    # is a residual, which XLA stacked from the storage after the insert; the
    # rotation in a conditional it returns is keyed on the storage too, which XLA
    # cannot fold (`_xla._rekeyed`): a new array, the insert waits for it. Plain
    # `lax` copies 2 a step.
    ("line_read_first", "grad"),
    ("line_read_first", "vmap(grad)"),
    ("stack", "jvp(vmap)"),
    ("stack_scan", "grad"),
    ("select_stack", "grad"),
    ("select_stack", "vmap(grad)"),
    ("ring_taps", "grad"),
    # A line that is the whole buffer is stored as a ring (`_ops.Ring`): a push or
    # pop at either end moves one element.
    ("delay_whole", "fwd"),
    ("delay_whole", "grad"),
    # Its cotangent, weighted along the line, is scatter-added unrotated into
    # the storage's (`_xla.rotated_window`): a gather rotated it back before.
    ("delay_fir", "grad"),
    ("delay_fir", "vmap(grad)"),
    ("delay_1d", "grad"),
    ("delay_1d", "jvp"),
    ("delay_taps", "grad"),
    ("delay_taps", "vmap(grad)"),
    # Two steps a loop trip: the step is one function JAX calls twice, whose taps
    # end it; it is lowered for each call (`_xla.lowered_once_per_call`).
    ("taps_unroll2", "fwd"),
    ("taps_unroll2", "jvp"),
    # Each step under `jax.checkpoint`: the accesses run in the forward pass only,
    # their outputs saved, so the buffer is not saved per step (nor copied by
    # JAX's stacking of it: `_primitives._edit_partial_eval_custom`).
    ("traced_remat", "grad"),
    ("traced_remat", "vmap(grad)"),
    ("taps_remat", "grad"),
    # A whole read before an insert, under `jax.checkpoint`: the read's output,
    # which JAX saves, is returned through a `reduce_precision` to its own type,
    # through which the snapshot and the rotation kept as a new array find it
    # (`_xla._returned_uses`); 2 copies a step before.
    ("first_remat", "grad"),
    ("first_remat", "vmap(grad)"),
    ("line_first_remat", "grad"),
    ("line_first_remat", "vmap(grad)"),
    ("front_stack", "grad"),
    ("front_stack", "jvp"),
    ("front_stack_b", "vmap(grad)"),
    ("front_stack_scan", "grad"),
    ("queue", "grad"),
    ("ring_mix", "grad"),
    ("ring_mix", "jvp(vmap)"),
    # A read of the buffer from before an edit, traced after the edit: lowered
    # before it (`_xla.edits_of`); plain `lax` copies.
    ("read_old", "fwd"),
    ("read_old", "grad"),
    ("read_old", "jvp"),
    # A block written at a Python-int start of a ring, where it may wrap: one
    # scatter, whose transpose gathers the block's cotangent, then scatters zeros
    # there (`_primitives._ring_read_old`); plain `lax` copies.
    ("block_write", "grad"),
    # Lines indexed by two dimensions: the shifts' windows span two lines along
    # both (`_xla.window2_edit`).
    ("lines_3d", "grad"),
    ("lines_3d", "jvp"),
]


@pytest.mark.parametrize("row, mode", IN_PLACE, ids=[f"{r}-{m}" for r, m in IN_PLACE])
def test_no_per_iteration_copies(row, mode):
    fn, args = _program(row, mode, natural.ESB)
    min_bytes = natural.min_bytes(natural.ROWS_BY_NAME[row])
    copies = esb.find_loop_copies(fn, *args, min_bytes=min_bytes)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize(
    "row",
    [
        "pyint",
        "one_line",
        "one_d",
        "one_d_del",
        "text",
        "two_lines",
        "whole_ds",
        "whole_array",
        "whole_read_first",
        "history",
        "array_slice",
        "array_dslice",
        "delay_array",
        "delay_array_row",
        "array_then_insert",
        "array_row_first",
        "array_row_sum_first",
        "array_window_first",
        "array_block_first",
        "array_ds_first",
        "array_ds_pyint",
        "ring_array_first",
        "line_read_first",
        "delay_whole",
        "delay_fir",
        "delay_1d",
        "delay_taps",
        "ring_taps",
        "front_stack",
        "queue",
        "ring_mix",
        "select_stack",
        "block_write",
        "lines_3d",
        "read_old",
        "traced_remat",
        "first_remat",
        "line_first_remat",
    ],
)
def test_values_and_gradients_match_plain_lax(row):
    for mode in ("fwd", "grad"):
        _assert_matches_plain_lax(row, mode)


@pytest.mark.parametrize(
    "row, mode",
    [
        ("array_row_first", "vmap(grad)"),
        ("array_row_first", "jvp(vmap)"),
        ("array_row_sum_first", "vmap(grad)"),
        ("array_window_first", "jvp(vmap)"),
        ("ring_array_first", "jvp(vmap)"),
        ("array_dslice", "vmap(grad)"),
        ("array_ds_first", "vmap(grad)"),
        ("array_ds_pyint", "vmap(grad)"),
    ],
)
def test_a_slice_of_array_read_before_an_insert_has_plain_lax_values_under_vmap(
    row, mode
):
    """Under `vmap`, a batch of rows of `.array` is a gather, which the insert
    after it gathers again behind a barrier and rewires
    (`_xla.user_slices_materialised`): the values and derivatives are plain
    `lax`'s."""
    _assert_matches_plain_lax(row, mode)


@pytest.mark.parametrize(
    "row, mode",
    [
        ("array_slice", "grad"),
        ("array_slice", "vmap(grad)"),
        ("array_dslice", "grad"),
        ("array_dslice", "vmap(grad)"),
        ("array_ds_first", "vmap(grad)"),
        ("array_ds_pyint", "vmap(grad)"),
        ("delay_array", "grad"),
        ("delay_array", "vmap(grad)"),
    ],
)
def test_a_slice_of_array_is_not_made_buffer_sized_in_the_gradient(row, mode):
    """`buf.array[:8, :16]`'s cotangent is accumulated as the slice's, not padded
    with zeros to the whole buffer and added every step, nor is `buf.array[r,
    :16]`'s written into zeros the buffer's size (`_xla.unpadded_window`), nor,
    on a ring, is the padded cotangent of `buf.array[:4]` rotated back whole
    (`_xla.rotated_window`). Under `vmap` with a batch of `r`, the slice is a
    gather, whose cotangent JAX scatters into a batch of zeros: the scatter is
    folded into an accumulation of each element's window
    (`_xla._zeros_around`). (On a ring, `delay_array_row`, it is still rotated
    back whole: README, known limits.)"""
    r = natural.ROWS_BY_NAME[row]
    fn, args = _program(row, mode, natural.ESB)
    size = math.prod(r.shape) * (natural.BATCH if "vmap" in mode else 1)
    work = loop_buffer_work(fn, args, size)
    assert work == [], work


# Under `vmap`, a step of these rows edits each batch element's buffer through
# windows: no instruction of the loop makes an array the size of the batch of
# buffers except by updating one in place. All but `two_lines` did, every step:
# a read of each element's whole line (a pop's line, a delete's ordered read,
# `.array`) in a loop of its own filled a batch of zeros that size (forward
# 1.3-2.7x plain `lax`'s where the buffer is one line).
VMAP_WINDOWED = [
    "one_line",
    "one_d",
    "one_d_del",
    "two_lines",
    "array_then_insert",
    "whole_array",
]


@pytest.mark.parametrize("row", VMAP_WINDOWED)
def test_no_buffer_sized_work_per_step_under_vmap(row):
    fn, args = _program(row, "vmap", natural.ESB)
    r = natural.ROWS_BY_NAME[row]
    assert loop_buffer_work(fn, args, natural.BATCH * math.prod(r.shape)) == []
    ref, ref_args = _program(row, "vmap", natural.PLAIN)
    np.testing.assert_allclose(fn(*args), ref(*ref_args), rtol=2e-5, atol=1e-5)
