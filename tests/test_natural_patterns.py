"""The patterns users write without thinking about XLA (`tests/natural.py`): in
place, and equal to the same step in plain `lax`.

Each `(row, mode)` below compiles a 100-step scan, so the list is the headline cases
only; `python benchmarks/patterns.py` counts every row under every mode.
"""

import jax
import numpy as np
import pytest

from . import natural


# (row, mode) pairs with 0 per-step copies. Rows that copy as plain `lax` does (a
# `lax.cond` on the carry; a whole-buffer `dynamic_slice` under grad) are not here:
# see the README's known limits, and their alternatives `select_stack` and
# `whole_read`.
IN_PLACE = [
    ("pyint", "fwd"),
    ("pyint", "grad"),
    ("pyint", "jvp"),
    ("npint", "grad"),
    ("one_line", "grad"),
    ("one_line", "jvp(vmap)"),
    ("one_d", "grad"),
    ("one_d", "jvp"),
    ("two_lines", "grad"),
    ("two_lines", "jvp"),
    ("whole_ds", "fwd"),
    ("whole_ds", "jvp"),
    ("whole_read", "grad"),
    ("whole_array", "grad"),
    ("whole_array", "vmap(grad)"),
    ("stack", "jvp(vmap)"),
    ("stack_scan", "grad"),
    ("select_stack", "grad"),
    ("select_stack", "vmap(grad)"),
    ("ring_taps", "grad"),
    # A line that is the whole buffer is stored as a ring (`_ops.Ring`): a push or
    # pop at either end moves one element.
    ("delay_whole", "fwd"),
    ("delay_whole", "grad"),
    ("delay_taps", "grad"),
    ("delay_taps", "vmap(grad)"),
    ("front_stack", "grad"),
    ("front_stack", "jvp"),
    ("front_stack_b", "vmap(grad)"),
    ("front_stack_scan", "grad"),
    ("queue", "grad"),
    ("ring_mix", "grad"),
    ("ring_mix", "jvp(vmap)"),
]


@pytest.mark.parametrize("row, mode", IN_PLACE, ids=[f"{r}-{m}" for r, m in IN_PLACE])
def test_no_per_iteration_copies(row, mode):
    copies = natural.copies(natural.ROWS_BY_NAME[row], natural.ESB, mode, steps=100)
    assert copies == [], "\n".join(map(str, copies))


@pytest.mark.parametrize(
    "row",
    [
        "pyint",
        "one_line",
        "one_d",
        "two_lines",
        "whole_ds",
        "whole_array",
        "delay_whole",
        "delay_taps",
        "ring_taps",
        "front_stack",
        "queue",
        "ring_mix",
        "select_stack",
    ],
)
def test_values_and_gradients_match_plain_lax(row):
    r = natural.ROWS_BY_NAME[row]
    args = natural.args_for(r, "grad", steps=12)
    for mode in ("fwd", "grad"):
        got = jax.jit(natural.program(mode, natural.make_loss(r, natural.ESB)))(*args)
        want = jax.jit(natural.program(mode, natural.make_loss(r, natural.PLAIN)))(
            *args
        )
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-5)
