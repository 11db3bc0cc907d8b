"""The detector: `find_loop_copies` and `assert_in_place` on what users call.

Plain functions, `jax.jit`, `eqx.filter_jit`, `eqx.filter_grad` and
`eqx.filter_value_and_grad` wrappers, and arguments that are Equinox modules with
non-array leaves; and the report of a copy that XLA inserted with no metadata.

Each program is a short `lax.scan` over an 8 x 2048 float32 buffer (64 KiB), or a
batch of two such buffers under `vmap`; the detector counts copies of at least one
buffer. Indices are scanned inputs: constant indices would make XLA write the
buffer out of place.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_shiftbuf as esb
from eqx_shiftbuf._inspect import loop_copies_in_hlo


ROWS, COLS, STEPS = 8, 2048, 4
BUFFER_BYTES = ROWS * COLS * 4


def _mlp() -> eqx.nn.MLP:
    # Holds a non-array leaf: its activation function.
    return eqx.nn.MLP(2, "scalar", 4, 1, dtype=jnp.float32, key=jax.random.key(0))


def _xs():
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.integers(0, ROWS, STEPS), jnp.int32)
    cols = jnp.asarray(rng.integers(0, COLS, STEPS), jnp.int32)
    return rows, cols


def _init():
    return jnp.zeros((ROWS, COLS), jnp.float32)


def _in_place_loss(mlp, init, xs):
    """An MLP's output inserted into a `ShiftBuffer`, then a pop: in place."""

    def step(buf, x):
        r, c = x
        v = mlp(jnp.stack([r, c]).astype(jnp.float32))
        buf = buf.insert((r, c), v)
        buf, out = buf.pop((r, (c + 1) % COLS))
        return buf, out

    buf, outs = lax.scan(step, esb.ShiftBuffer.from_array(init), xs)
    return ((buf.array - 0.5) ** 2).mean() + outs.sum()


def _copying_loss(mlp, init, xs):
    """The same with a plain array carry whose old value is read after the write:
    XLA must keep both, so it copies the buffer every iteration."""

    def step(buf, x):
        r, c = x
        v = mlp(jnp.stack([r, c]).astype(jnp.float32))
        new = buf.at[r, c].set(v)
        return new, buf[r, 0] * new[r, 1]

    buf, outs = lax.scan(step, init, xs)
    return ((buf - 0.5) ** 2).mean() + outs.sum()


def _copies(fn: Callable, *args, **kwargs):
    return esb.find_loop_copies(fn, *args, min_bytes=BUFFER_BYTES, **kwargs)


# -- what users call


def test_filter_jit_of_filter_grad_with_an_mlp_argument():
    # The acceptance test: Equinox's jit of Equinox's grad, and a model with
    # a non-array leaf, compile; an in-place body has no copies, a copying one has.
    in_place = _copies(
        eqx.filter_jit(eqx.filter_grad(_in_place_loss)), _mlp(), _init(), _xs()
    )
    copying = _copies(
        eqx.filter_jit(eqx.filter_grad(_copying_loss)), _mlp(), _init(), _xs()
    )
    assert isinstance(in_place, list)
    assert in_place == [], "\n".join(map(str, in_place))
    assert len(copying) >= 1
    assert all(c.shape == f"f32[{ROWS},{COLS}]" for c in copying)


def test_a_lowered_or_compiled_program_is_read_as_it_is():
    # What `jax.jit(f).lower(...)` and `.compile()` return (a program compiled
    # with its own shardings, say): no arguments, and not compiled again.
    mlp = _mlp()
    params, static = eqx.partition(mlp, eqx.is_array)
    loss = lambda p, init, xs: _copying_loss(eqx.combine(p, static), init, xs)
    lowered = jax.jit(jax.grad(loss)).lower(params, _init(), _xs())
    compiled = lowered.compile()
    assert len(_copies(compiled)) >= 1
    assert _copies(lowered) == _copies(compiled)
    in_place = lambda p, init, xs: _in_place_loss(eqx.combine(p, static), init, xs)
    assert _copies(jax.jit(jax.grad(in_place)).lower(params, _init(), _xs())) == []
    with pytest.raises(TypeError, match="already lowered or compiled"):
        _copies(compiled, params)


def test_filter_grad_without_filter_jit():
    copies = _copies(eqx.filter_grad(_copying_loss), _mlp(), _init(), _xs())
    assert len(copies) >= 1


def test_filter_value_and_grad():
    vg = eqx.filter_value_and_grad(_in_place_loss)
    assert _copies(vg, _mlp(), _init(), _xs()) == []
    vg = eqx.filter_jit(eqx.filter_value_and_grad(_copying_loss))
    assert len(_copies(vg, _mlp(), _init(), _xs())) >= 1


def test_filter_jit():
    assert len(_copies(eqx.filter_jit(_copying_loss), _mlp(), _init(), _xs())) >= 1


def test_plain_function_with_a_module_argument():
    assert len(_copies(_copying_loss, _mlp(), _init(), _xs())) >= 1


def test_jax_jit_is_compiled_as_it_is():
    # Its own static arguments hold: `scale` stays a Python float.
    seen = []

    def loss(scale, init, xs):
        seen.append(type(scale))
        return _copying_loss(lambda x: scale * x.sum(), init, xs)

    jitted = jax.jit(loss, static_argnums=0)
    assert len(_copies(jitted, 2.0, _init(), _xs())) >= 1
    assert seen == [float]


def test_plain_function_traces_python_scalars_as_jax_jit_does():
    # Backward compatible: with only arrays and scalars, a plain function is
    # traced as `jax.jit(fn)` traces it, scalars included.
    seen = []

    def loss(scale, init, xs):
        seen.append(isinstance(scale, jax.Array))  # a tracer
        return _copying_loss(lambda x: scale * x.sum(), init, xs)

    assert len(_copies(loss, 2.0, _init(), _xs())) >= 1
    assert seen == [True]


class _Model(eqx.Module):
    """A model whose non-array fields are used as Python values in its loop."""

    weight: jax.Array
    activation: Callable
    name: str
    lines: int
    buffered: bool

    def __call__(self, init, xs):
        assert isinstance(self.lines, int) and isinstance(self.name, str)
        if self.buffered:  # a Python bool, which must not be traced
            init = esb.ShiftBuffer.from_array(init)
            buf, outs = lax.scan(lambda b, x: self._insert_pop(b, x), init, xs)
            return buf.array.sum() + outs.sum()
        array, outs = lax.scan(lambda a, x: self._read_after_write(a, x), init, xs)
        return array.sum() + outs.sum()

    def _insert_pop(self, buf, x):
        r, c = x
        v = self.activation(self.weight * c.astype(jnp.float32))
        return buf.insert((r % self.lines, c), v).pop((r, c))

    def _read_after_write(self, array, x):
        r, c = x
        v = self.activation(self.weight * c.astype(jnp.float32))
        new = array.at[r % self.lines, c].set(v)
        return new, array[r, 0] * new[r, 1]


def _model(buffered):
    return _Model(jnp.float32(0.5), jnp.tanh, "model", ROWS, buffered)


def test_module_with_non_array_leaves_as_argument():
    def loss(model, init, xs):
        return model(init, xs)

    assert _copies(loss, _model(buffered=True), _init(), _xs()) == []
    assert len(_copies(loss, _model(buffered=False), _init(), _xs())) >= 1


def test_module_with_non_array_leaves_as_the_function():
    assert _copies(_model(buffered=True), _init(), _xs()) == []
    grad = eqx.filter_grad(lambda m, *a: m(*a))
    assert len(_copies(grad, _model(buffered=False), _init(), _xs())) >= 1


def test_shape_dtype_structs_stand_for_arrays():
    init = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32)
    xs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _xs())
    grad = eqx.filter_jit(eqx.filter_grad(_copying_loss))
    assert len(_copies(grad, _mlp(), init, xs)) >= 1


# -- a copy that XLA inserts, with no metadata of its own


def _cond_edit(buf, xs):
    # A `lax.cond` on the carried buffer: under `vmap` both branches run, each on
    # its own copy of the buffer, and a select keeps one (jax#38145).
    def step(b, x):
        i, v = x
        b = lax.cond(v > 0, lambda b: b.at[i].set(v), lambda b: b.at[i].set(-v), b)
        return b, b[i]

    return lax.scan(step, buf, xs)


def _cond_args():
    xs = (jnp.zeros((2, STEPS), jnp.int32), jnp.ones((2, STEPS), jnp.float32))
    return jnp.zeros((2, ROWS * COLS), jnp.float32), xs


def test_a_copy_xla_inserts_is_attributed():
    copies = esb.find_loop_copies(
        jax.vmap(_cond_edit), *_cond_args(), min_bytes=ROWS * COLS * 4
    )
    assert len(copies) >= 1
    for c in copies:
        assert c.inserted
        assert c.shape == f"f32[2,{ROWS * COLS}]"
        assert c.loop and "test_inspect.py:" in c.loop_source
        assert c.op_name.startswith("(inserted by XLA for) ")
        assert "test_inspect.py:" in c.source
        assert "lax.cond" in c.hint and "jax#38145" in c.hint


def test_assert_in_place_prints_the_attribution_and_the_hint():
    with pytest.raises(AssertionError) as info:
        esb.assert_in_place(
            jax.vmap(_cond_edit), *_cond_args(), min_bytes=ROWS * COLS * 4
        )
    message = str(info.value)
    assert f"copy of f32[2,{ROWS * COLS}]" in message
    assert "(the loop at " in message and "test_inspect.py:" in message
    assert "(inserted by XLA for) " in message
    assert "hint: XLA inserted this copy" in message
    assert "jnp.where" in message


# A compiled loop, written by hand, whose body copies the carried buffer into a
# tuple for an inner loop (a library edit inside a `lax.cond` branch) and selects
# between the edited and the old buffer: the copy has no metadata, and neither do
# its operand and its direct user. The stack frames print parents one above the
# frame they name, as XLA does: frame 3 (library) is called from frame 2 (user).
_HLO = """\
HloModule jit_run, entry_computation_layout={(f32[2,4096]{1,0})->f32[2,4096]{1,0}}

FileNames
1 "/home/user/model.py"
2 "/site-packages/eqx_shiftbuf/_ops.py"

FunctionNames
1 "run"
2 "step"
3 "pop"

FileLocations
1 {file_name_id=1 function_name_id=1 line=30 end_line=30 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=12 end_line=12 column=1 end_column=9}
3 {file_name_id=2 function_name_id=3 line=800 end_line=800 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=3}

%inner_body (p: (s32[], f32[2,4096])) -> (s32[], f32[2,4096]) {
  ROOT %p = (s32[], f32[2,4096]{1,0}) parameter(0)
}

%inner_cond (q: (s32[], f32[2,4096])) -> pred[] {
  %q = (s32[], f32[2,4096]{1,0}) parameter(0)
  ROOT %f = pred[] constant(false)
}

%body (arg: (s64[], f32[2,4096], f32[2])) -> (s64[], f32[2,4096], f32[2]) {
  %arg = (s64[], f32[2,4096]{1,0}, f32[2]{0}) parameter(0)
  %i = s64[] get-tuple-element(%arg), index=0
  %buf = f32[2,4096]{1,0} get-tuple-element(%arg), index=1
  %v = f32[2]{0} get-tuple-element(%arg), index=2
  %neg = f32[2]{0} negate(%v), metadata={op_name="jit(run)/while/body/neg" stack_frame_id=2}
  %copy.1 = f32[2,4096]{1,0} copy(%buf)
  %zero = s32[] constant(0)
  %tuple.1 = (s32[], f32[2,4096]{1,0}) tuple(%zero, %copy.1)
  %while.1 = (s32[], f32[2,4096]{1,0}) while(%tuple.1), condition=%inner_cond, body=%inner_body, metadata={op_name="jit(run)/while/body/closed_call/while" stack_frame_id=3}
  %edited = f32[2,4096]{1,0} get-tuple-element(%while.1), index=1
  %pred = pred[2,4096]{1,0} constant({...})
  %select.1 = f32[2,4096]{1,0} select(%pred, %edited, %buf), metadata={op_name="jit(run)/while/body/closed_call/select_n" stack_frame_id=2}
  %one = s64[] constant(1)
  %next = s64[] add(%i, %one), metadata={op_name="jit(run)/while/body/add" stack_frame_id=2}
  ROOT %out = (s64[], f32[2,4096]{1,0}, f32[2]{0}) tuple(%next, %select.1, %neg)
}

%cond (c: (s64[], f32[2,4096], f32[2])) -> pred[] {
  %c = (s64[], f32[2,4096]{1,0}, f32[2]{0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (x: f32[2,4096]) -> f32[2,4096] {
  %x = f32[2,4096]{1,0} parameter(0)
  %n = s64[] constant(0)
  %w = f32[2]{0} constant({1, 2})
  %init = (s64[], f32[2,4096]{1,0}, f32[2]{0}) tuple(%n, %x, %w)
  %loop = (s64[], f32[2,4096]{1,0}, f32[2]{0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(run)/while" stack_frame_id=1}
  ROOT %res = f32[2,4096]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_an_inserted_copy_is_named_after_the_nearest_named_op():
    # Through its unnamed user (a tuple) to the inner loop that consumes it; not
    # through the loop's parameter to an unrelated carried value (`neg`).
    [copy] = loop_copies_in_hlo(_HLO, min_bytes=2 * 4096 * 4)
    assert copy.instruction == "copy.1"
    assert copy.inserted
    assert copy.op_name == "(inserted by XLA for) jit(run)/while/body/closed_call/while"
    assert copy.loop == copy.computation == "body"


def test_source_lines_skip_library_frames_up_the_stack():
    [copy] = loop_copies_in_hlo(_HLO, min_bytes=2 * 4096 * 4)
    assert copy.source == "/home/user/model.py:12"
    assert copy.loop_source == "/home/user/model.py:30"


def test_a_copy_selected_between_gets_the_cond_hint():
    [copy] = loop_copies_in_hlo(_HLO, min_bytes=2 * 4096 * 4)
    assert "select between two edited versions" in copy.hint
    assert "lax.cond" in copy.hint and "jax#38145" in copy.hint
    assert "\n    hint: " in str(copy)


def test_a_copy_not_selected_between_gets_the_generic_hint():
    select = 'select(%pred, %edited, %buf), metadata={op_name="jit(run)/while/body/closed_call/select_n"'
    add = 'add(%edited, %buf), metadata={op_name="jit(run)/while/body/closed_call/add"'
    assert select in _HLO
    hlo = _HLO.replace(select, add)
    [copy] = loop_copies_in_hlo(hlo, min_bytes=2 * 4096 * 4)
    assert "select between two edited versions" not in copy.hint
    assert "read of the buffer" in copy.hint
