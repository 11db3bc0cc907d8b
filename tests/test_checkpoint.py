"""A step under `jax.checkpoint` (`lax.scan(jax.checkpoint(step), ...)`, the usual
way to trade a scan's memory for compute) saves no buffer and copies none.

JAX reruns a checkpointed step's primitives in the backward pass from their
operands, so by default it would save the buffer from before every step (a
buffer-sized residual per step) to rerun the step's edits, and XLA copied the buffer
every step: JAX's stacking of that residual reads the buffer unordered with respect
to the step's first edit. The library's accesses are affine in the storage, so the
backward pass needs only what the user computes from their outputs: they run in
the forward pass only, their windows and popped values are saved
(`_primitives._edit_partial_eval_custom`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import lax
from jax._src.ad_checkpoint import saved_residuals

import eqx_shiftbuf as esb

from . import natural, shifts


# (shape, axis): a ring of one line, a buffer of three lines.
SHAPES = [((4096,), 0), ((3, 2000), 1)]
# Steps whose popped value the loss uses non-linearly: the backward pass needs it.
KINDS = ["insert_pop", "pop_insert"]


@pytest.mark.parametrize(
    "shape, axis, kind", [(*SHAPES[0], KINDS[0]), (*SHAPES[1], KINDS[1])], ids=str
)
def test_a_checkpointed_step_copies_nothing(shape, axis, kind):
    s, a, xs = shifts.args(shape, axis)
    # With respect to the parameter too: the popped value's use needs it.
    fn = jax.grad(
        shifts.loss(kind, shape, axis, scan=natural._rematerialised), argnums=(0, 1)
    )
    copies = esb.find_loop_copies(fn, s, a, xs, min_bytes=a.nbytes // 2)
    assert copies == [], "\n".join(map(str, copies))


# `jax.checkpoint`'s policy decides which of the step's values are saved; none
# saves the buffer (`everything_saveable` would save the storage each access
# returns, by default).
POLICIES = {
    "nothing": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "everything": jax.checkpoint_policies.everything_saveable,
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpointed_step_saves_no_buffer(kind, policy):
    shape, axis = SHAPES[1]
    s, a, xs = shifts.args(shape, axis)

    def remat(step, init, xs):  # `natural._rematerialised`, with the policy
        return lax.scan(jax.checkpoint(step, policy=POLICIES[policy]), init, xs)

    loss = shifts.loss(kind, shape, axis, scan=remat)

    def per_step_buffers(loss):
        # The scan's residuals, stacked over the steps, at least a buffer a step
        # (the loss's final term saves the final buffer once, outside the scan).
        saved = saved_residuals(loss, s, a, xs)
        return [
            (aval, why)
            for aval, why in saved
            if aval.shape[:1] == (shifts.STEPS,) and aval.size >= shifts.STEPS * a.size
        ]

    assert per_step_buffers(loss) == []
    # The same step in plain `lax` saves the buffer of every step: the test sees it.
    assert per_step_buffers(
        shifts.loss(kind, shape, axis, natural.PLAIN, scan=natural._rematerialised)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpointed_step_has_the_gradient_of_plain_lax(kind):
    shape, axis = (3, 40), 1
    s, a, xs = shifts.args(shape, axis)
    a = a * np.linspace(0.5, 1.5, a.size, dtype=np.float32).reshape(shape)
    for mode in ("grad", "jvp"):
        got = jax.jit(
            natural.program(
                mode, shifts.loss(kind, shape, axis, scan=natural._rematerialised)
            )
        )
        want = jax.jit(
            natural.program(mode, shifts.loss(kind, shape, axis, natural.PLAIN))
        )
        for g, w in zip(
            jax.tree.leaves(got(s, a, xs)), jax.tree.leaves(want(s, a, xs)), strict=True
        ):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
