"""Carry leaves the checkpointed scan need not store: buffers reached only by edits.

`esb.scan(kind="checkpointed")` stores carries at checkpoints and its reverse pass
reloads one before every reversed step: O(carry) per step, however small the step's
edits. A `ShiftBuffer`'s storage needs neither. Every buffer primitive is affine in
the storage (`_primitives`: its JVP is the primitive on the tangents, its transpose
needs only the indices), so the reverse pass needs the storage's *values* only
where the step reads them: the windows, popped values and tokens the primitives
return. Those are O(window) a step.

So, for a carry leaf whose every use in the body is as the storage operand of a
buffer primitive, in a chain of such primitives that ends in the leaf's new value,
and whose tape takes no more memory than its stored copies would (`plan`):

- the forward pass runs the body's *recording* form, which also returns, as extra
  per-step outputs (a tape), every other output of those primitives;
- rerun and reversed steps run its *replaying* form, which takes one step's tape
  as extra inputs and uses those values in place of what the primitives return
  (with the primitives' own tangents: `_replayed`), so the storage's values are
  dead code there, and the scan passes zeros for the leaf, which XLA removes.

With the true tape the replaying body computes exactly what the body computes.
Leaves with any other use (a reduction of the whole storage, an edit inside a
`lax.cond` or a `jax.jit`) are stored as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import api_util, core as jcore, linear_util as lu, source_info_util
from jax._src.interpreters import partial_eval as pe
from jax._src.pjit import jit_p
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import ClosedJaxpr, Literal

from ._primitives import (
    accum_p,
    after_p,
    insert_p,
    pop_p,
    read_p,
    read_token,
    rotate_p,
    swap_p,
)
from ._writeonce import NORMAL, TAPED
from ._xla import materialised, opaque_zero


# Primitives whose operand 0 is a buffer's storage and output 0 its new value.
_EDITS = (read_p, accum_p, swap_p, insert_p, pop_p)
# Primitives whose output is a part or a rearrangement of one operand (the one at
# the index given), linear in it, their other operands indices: a value read from
# the storage through them is taped only where something else uses it. (`rev`: a
# delay line read oldest first, `buf.array[::-1]`.) `after_p` returns its token
# (operand 0); its operand 1 only orders an edit after a read.
_PARTS = {
    lax.slice_p: 0,
    lax.dynamic_slice_p: 0,
    lax.gather_p: 0,
    lax.squeeze_p: 0,
    lax.reshape_p: 0,
    lax.transpose_p: 0,
    lax.rev_p: 0,
    rotate_p: 0,
    after_p: 0,
}
_ORDER_ONLY = {after_p: (1,)}


@jax.custom_jvp
def _replayed(value, recorded):
    """`recorded`, what the primitive returned in the forward pass, in place of
    `value`, what it returns now (from a storage that may be a stand-in)."""
    del value
    return recorded


@functools.partial(_replayed.defjvp, symbolic_zeros=True)
def _replayed_jvp(primals, tangents):
    """The tangent of either: of `value` where the storage's tangent is what is
    being differentiated (a reversed step, forward mode), of `recorded` where the
    tape's is (the steps that forward-over-reverse mode reruns, with zeros for the
    storage). Never both at once: the tape has no tangent where the storage has
    one (`_scan._scan_jvp` gives it zeros), and the stand-in storage has none."""
    _, recorded = primals
    ts = [t for t in tangents if type(t) is not SymbolicZero]
    if not ts:
        return recorded, SymbolicZero(jax.typeof(recorded).to_tangent_aval())
    return recorded, functools.reduce(operator.add, ts)


def _replay(value, recorded):
    if jnp.issubdtype(recorded.dtype, jnp.inexact):
        return _replayed(value, recorded)
    return recorded


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which carry leaves are taped (`roles`, with `TAPED`), the body (its
    `jax.jit` calls put in line where one held a buffer access), and its
    variables whose values the tape holds, in the body's order; `waits`: the
    taped parts of the storage read by the user's own operations (`_PARTS`), each
    with the index of the equation of the next edit of that storage, if any."""

    roles: tuple[int, ...]
    jaxpr: ClosedJaxpr
    taped: tuple[Any, ...]
    waits: tuple[tuple[Any, int | None], ...] = ()

    def recording(self) -> tuple[ClosedJaxpr, list]:
        """`(*consts, *carry, *x) -> (*carry, *y, *tape)`, with its new leading
        constants."""
        from ._scan import _trace

        jaxpr = self.jaxpr

        def fn(*args):
            env = _eval(jaxpr, args, {}, waits=self.waits)
            return _outs(jaxpr, env) + [env[v] for v in self.taped]

        return _trace(fn, list(jaxpr.in_avals), "esb.scan (recording)")

    def replaying(self) -> tuple[ClosedJaxpr, list]:
        """`(*consts, *carry, *x, *tape) -> (*carry, *y)`, with its new leading
        constants."""
        from ._scan import _trace

        jaxpr, n = self.jaxpr, len(self.jaxpr.in_avals)

        def fn(*args):
            tape = dict(zip(self.taped, args[n:]))
            return _outs(jaxpr, _eval(jaxpr, args[:n], tape))

        avals = list(jaxpr.in_avals) + [v.aval for v in self.taped]
        return _trace(fn, avals, "esb.scan (replaying)")


def _keepable(aval) -> bool:
    """Whether `_kept` takes a value of type `aval`: a real or bool array that is
    not empty (`materialised` reads bit patterns, which a complex dtype has no
    unsigned type as wide for), and whose type carries no sharding (on a mesh with
    explicit axes, `opaque_zero`'s slice of one element of a sharded dimension
    fails to trace)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", ())
    return (
        aval.size > 0
        and not jnp.issubdtype(aval.dtype, jnp.complexfloating)
        and all(p is None for p in spec)
    )


@jax.custom_jvp
def _kept(x):
    """`x`, computed once, in a kernel of its own (`materialised`).

    The recording body outputs what the user's own operations read of the storage
    (`buf.array[:2, :8]`) as the tape, which `lax.scan` stacks after the step. A
    slice is cheap, so XLA fused it into that stacking, which then read the storage
    after the step's insert had written it in place: 2 copies of the buffer a step
    (`array_then_insert` in `tests/natural.py`, under `jax.grad` of `esb.scan`).
    Computed once, and waited for by the next edit (`_eval`), it is read before.
    """
    return materialised(x, opaque_zero(x))


@_kept.defjvp
def _kept_jvp(primals, tangents):
    # (`materialised` reads bits, which carry no tangent.)
    return _kept(*primals), tangents[0]


def _inlined(jaxpr: ClosedJaxpr) -> ClosedJaxpr:
    """`jaxpr` with the bodies of its `jax.jit` calls in line (same inputs and
    outputs): a method of a `ShiftBuffer` called inside a jitted function (an
    `eqx.filter_jit` model) is then an access of the body itself."""

    def fn(*args):
        return _outs(jaxpr, _eval(jaxpr, args, {}, inline=True))

    avals = list(jaxpr.in_avals)
    dbg = api_util.debug_info("esb.scan (inlined)", fn, tuple(avals), {})
    new, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fn, debug_info=dbg), avals)
    return ClosedJaxpr(new, consts)


def _eval(
    jaxpr: ClosedJaxpr, args: Sequence, tape: dict, inline=False, waits=()
) -> dict:
    """`jax.core.eval_jaxpr`, with the variables in `tape` replaced by its values;
    with `inline`, the bodies of `jax.jit` calls evaluated in line; with `waits`
    (`Plan.waits`), those variables computed once (`_kept`), and the edits given
    waiting for them through their tokens (operand 1)."""
    env: dict = dict(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
    env.update(zip(jaxpr.jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    # (Where no edit follows, the stacking reads the storage before the next
    # step's edits: computed apart, `delay_array`'s slice of its rotated ring took
    # the gradient from 1.0 to 1.5 ms.)
    kept = {v for v, i in waits if i is not None and _keepable(v.aval)}
    waited: dict = {}
    for v, i in waits:
        if v in kept:
            waited.setdefault(i, []).append(v)
    for i, eqn in enumerate(jaxpr.jaxpr.eqns):
        if inline and eqn.primitive is jit_p:
            callee = eqn.params["jaxpr"]
            inner = _eval(callee, list(map(read, eqn.invars)), {}, inline=True)
            env.update(zip(eqn.outvars, _outs(callee, inner)))
            continue
        params = eqn.primitive.get_bind_params(eqn.params)
        operands = list(map(read, eqn.invars))
        for v in waited.get(i, ()):
            operands[1] = read_token(operands[1], env[v])  # (as a read's token)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (
            source_info_util.user_context(
                eqn.source_info.traceback, name_stack=name_stack
            ),
            eqn.ctx.manager,
        ):
            ans = eqn.primitive.bind(*operands, **params)
        ans = ans if eqn.primitive.multiple_results else [ans]
        for v, a in zip(eqn.outvars, ans):
            if isinstance(v, jcore.DropVar):
                continue
            env[v] = _replay(a, tape[v]) if v in tape else _kept(a) if v in kept else a
    return env


def _outs(jaxpr: ClosedJaxpr, env: dict) -> list:
    return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.jaxpr.outvars]


_CALL = "call"


def _chain(jaxpr, k: int, num_consts: int, used: set):
    """`(taped, waits)`: the variables `_replaying` must tape for carry leaf `k`,
    and `Plan.waits` for them; None if the leaf has a use other than as the
    storage of a chain of buffer primitives that ends in its new value, or read by
    `_PARTS`; `_CALL` if it is an operand of a `jax.jit` call (whose body
    `_inlined` puts in line).

    What the accesses return (windows, popped values, tokens) and what the storage
    itself is read as (`.array`, a rotation of a ring), are taped where something
    uses them, except where that use takes a part of them (`_PARTS`): then the
    part is taped, by the same rule. So a step that slices `buf.array[:8, :16]`
    tapes 128 values a step, not the buffer (which, larger than its copies at
    the checkpoints, would not be taped, and the buffer would be stored)."""
    inner = jaxpr.jaxpr
    storage = {inner.invars[num_consts + k]}
    read: set = set()  # values read from the storage, taped only if used whole
    taped: list = []
    edits: list[int] = []  # the equations that edit the storage, in order
    parts: dict = {}  # values the user's own operations read: their equations

    def tape(v):
        if v in used and v not in taped:
            taped.append(v)

    for i, eqn in enumerate(inner.eqns):
        ins = [v if isinstance(v, jcore.Var) else None for v in eqn.invars]
        touched = [v is not None and v in storage for v in ins]
        from_read = [v is not None and v in read for v in ins]
        if not any(touched) and not any(from_read):
            continue
        if eqn.primitive is jit_p:
            return _CALL
        if any(touched) and (any(touched[1:]) or not touched[0]):
            return None
        part = _PARTS.get(eqn.primitive)
        skip = _ORDER_ONLY.get(eqn.primitive, ())
        if touched[0] and eqn.primitive in _EDITS:
            new = eqn.outvars[0]
            if not isinstance(new, jcore.DropVar):
                storage.add(new)
            edits.append(i)
            read.update(v for v in eqn.outvars[1:] if not isinstance(v, jcore.DropVar))
            part = None
        elif touched[0] or (part is not None and from_read[part]):
            if part != 0 and touched[0]:
                return None
            got = [v for v in eqn.outvars if not isinstance(v, jcore.DropVar)]
            read.update(got)
            if eqn.primitive is not after_p:  # (a token, not a part)
                parts.update((v, i) for v in got)
        else:
            part = None
        for j, (v, r) in enumerate(zip(ins, from_read)):
            if r and j != part and j not in skip:
                tape(v)
    outs = inner.outvars
    if not (isinstance(outs[k], jcore.Var) and outs[k] in storage):
        return None
    if any(
        isinstance(v, jcore.Var) and v in storage for j, v in enumerate(outs) if j != k
    ):
        return None
    for v in outs:
        if isinstance(v, jcore.Var) and v in read:
            tape(v)
    waits = [
        (v, next((e for e in edits if e > parts[v]), None)) for v in taped if v in parts
    ]
    return taped, waits


def _bytes(avals) -> int:
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)


def plan(
    jaxpr: ClosedJaxpr,
    num_consts: int,
    roles: Sequence[int],
    *,
    length: int,
    checkpoints: int,
):
    """The `Plan` for a scan body of `length` steps with `checkpoints` slots and
    carry leaves of `roles`, or None when no carry leaf is taped.

    Only `NORMAL` leaves (stored at checkpoints) are candidates, and a leaf is taped
    only where its tape (`length` steps of what its accesses return) takes no more
    memory than storing it at the checkpoints would: a step that reads a large part
    of its buffer (an attention over a whole cache) is better served by storing the
    buffer. The tape is faster wherever it is taken: a step's tape is smaller than
    the buffer, which every reversed step would otherwise reload."""
    chains = _chains(jaxpr, num_consts, roles)
    if _CALL in chains:
        jaxpr = _inlined(jaxpr)
        chains = _chains(jaxpr, num_consts, roles)
    inner = jaxpr.jaxpr
    new_roles, taped, waits = list(roles), [], []
    for k, chain in enumerate(chains):
        if chain is None or chain is _CALL:
            continue
        stored = checkpoints * _bytes([inner.invars[num_consts + k].aval])
        if length * _bytes(v.aval for v in chain[0]) <= stored:
            new_roles[k] = TAPED
            taped += chain[0]
            waits += chain[1]
    if not any(r == TAPED for r in new_roles):
        return None
    # In the body's order, once each (two leaves' chains cannot share a variable).
    order = {v: i for i, v in enumerate(v for e in inner.eqns for v in e.outvars)}
    taped = tuple(sorted(set(taped), key=order.__getitem__))
    return Plan(tuple(new_roles), jaxpr, taped, tuple(waits))


def _chains(jaxpr: ClosedJaxpr, num_consts: int, roles) -> list:
    """`_chain` of each `NORMAL` carry leaf (None for the others)."""
    inner = jaxpr.jaxpr
    used = {v for e in inner.eqns for v in e.invars if isinstance(v, jcore.Var)}
    used |= {v for v in inner.outvars if isinstance(v, jcore.Var)}
    return [
        _chain(jaxpr, k, num_consts, used) if r == NORMAL else None
        for k, r in enumerate(roles)
    ]
