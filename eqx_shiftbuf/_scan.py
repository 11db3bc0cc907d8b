"""`esb.scan`: `lax.scan` with an optimal checkpointed reverse pass and forward mode.

`kind="checkpointed"` binds `scan_p`, a primitive holding the body's jaxpr (traced
once). Its rules:

- evaluation: `lax.scan` of the body;
- JVP: the primal outputs from `scan_p(save=True)`, which also stores the carries
  the schedule asks for (`_schedule.py`), and the tangents from `scan_lin_p`, which
  is linear in the tangents and whose only residuals are the scan's inputs and
  those stored carries. Evaluated (forward mode) it runs `lax.scan` of the body's
  JVP;
- transpose of `scan_lin_p`: the binomial reverse pass, a loop over reversals that
  each load a stored carry, rerun the steps the schedule says (storing some), and
  apply the body's VJP to the step after them.

Carry leaves have roles (`_writeonce`): `NORMAL` leaves are stored at checkpoints;
`BUFFER` leaves (write-once buffers named in `buffers=`, and their records of writes)
are not: the JVP hands their final values to `scan_lin_p`, and rerun steps see
those, as in Equinox; `CHECKING` leaves (the checked mode's write count and
phase) are zero in reruns, which turns the checks off. A `NORMAL` leaf the body
returns unchanged is made a `BUFFER` (`_unchanged_as_buffers`). The JVP makes a `NORMAL` leaf
`TAPED` where it is a `ShiftBuffer`'s storage that the step only edits and reads
through the buffer primitives (`_tape`): not stored either, its reads are recorded
by the forward pass and replayed in reruns, where the leaf is zero.

`jax.custom_vjp` would have been shorter but cannot be differentiated in forward
mode (Equinox's checkpointed loops have that limit, equinox#927); a primitive pair
with a JVP and a transpose gives both modes. Forward mode over a derivative
(Hessian-vector products) differentiates the implementations; reverse over reverse
is not supported (the reverse pass is a `while` loop).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax._src import ad_util, api_util, core as jcore, linear_util as lu
from jax._src.interpreters import batching as batching_internal, partial_eval as pe
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun, Primitive
from jax.interpreters import ad, batching, mlir

from . import _tape
from ._primitives import read_p
from ._schedule import schedule
from ._writeonce import BUFFER, NORMAL, wrap, WriteOnceBuffer
from ._xla import after


# ---------------------------------------------------------------------------
# Tracing a flat function once into a jaxpr whose constants are leading inputs.


def _trace(fn: Callable, avals: Sequence[Any], name: str) -> tuple[ClosedJaxpr, list]:
    """Trace `fn(*flat) -> list` at `avals`; return (jaxpr over (*consts, *flat),
    consts). Closed-over tracers of outer transformations become consts, so they
    are operands of the primitive and every transformation sees them."""
    dbg = api_util.debug_info(name, fn, tuple(avals), {})
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(fn, debug_info=dbg), avals
    )
    closed = pe.close_jaxpr(pe.convert_constvars_jaxpr(jaxpr))
    return closed, list(consts)


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _aval(x: Any) -> Any:
    return jcore.typeof(x)


def _stacked(length: int, aval: Any) -> Any:
    # `unmapped_aval`, not a new `ShapedArray` of the shape: the type keeps the
    # value's sharding (unsharded along the new axis) and its `shard_map` varying
    # axes. On a mesh with explicit axes JAX checks shardings as types, and a
    # stack of unsharded type mixed with sharded carries fails to trace (or, where
    # JAX can resolve it, reshards).
    return jcore.unmapped_aval(length, 0, aval)


def _zeros(aval: Any) -> jax.Array:
    """Zeros of the type `aval`, its sharding and varying axes included (unlike
    `jnp.zeros(aval.shape, aval.dtype)`, an unsharded, invariant value)."""
    return ad_util.zeros_like_aval(aval.update(weak_type=False))


def _float0_zeros(aval: Any) -> np.ndarray:
    return np.zeros(aval.shape, jax.dtypes.float0)


# ---------------------------------------------------------------------------
# Parameters shared by both primitives. `jaxpr`: (*consts, *carry, *x) ->
# (*carry, *y). The operands of `scan_p` are (*consts, *init, *xs).


def _pick(seq: Sequence, mask: Sequence[bool]) -> list:
    return [s for s, m in zip(seq, mask) if m]


def _fill(full: Sequence, mask: Sequence[bool], parts: Sequence) -> list:
    it = iter(parts)
    return [next(it) if m else f for f, m in zip(full, mask)]


def _normal(roles: Sequence[int]) -> list[bool]:
    return [r == NORMAL for r in roles]


def _split(seq: Sequence, *sizes: int) -> list[list]:
    out, i = [], 0
    for n in sizes:
        out.append(list(seq[i : i + n]))
        i += n
    out.append(list(seq[i:]))
    return out


def _body(jaxpr: ClosedJaxpr, num_carry: int):
    fun = jaxpr_as_fun(jaxpr)

    def body(consts, carry, x):
        out = fun(*consts, *carry, *x)
        return list(out[:num_carry]), list(out[num_carry:])

    return body


def _carries_body(jaxpr: ClosedJaxpr, num_carry: int, used: Sequence[bool]):
    """`body(consts, carry, x) -> carries`: the step's carries where `used`, from
    the step with everything else removed (`pe.dce_jaxpr`).

    A step rerun only for the carries it stores must not compute its outputs:
    XLA would remove them as dead code, but an edit waits for the user's reads of
    its buffer before it (`_xla.user_reads_before`), which keeps them. Rerun
    whole, a read of the whole buffer summed before an insert
    (`whole_read_first` in `tests/natural.py`) summed the buffer in every rerun
    step: its gradient under `esb.scan` was 6.0x its forward, against 3.9x for
    the same read after the insert."""
    outs = list(used) + [False] * (len(jaxpr.out_avals) - num_carry)
    dced, _ = pe.dce_jaxpr(jaxpr.jaxpr, outs, instantiate=True)
    fun = jaxpr_as_fun(ClosedJaxpr(dced, jaxpr.consts))

    def body(consts, carry, x):
        return list(fun(*consts, *carry, *x))

    return body


def _out_avals(jaxpr: ClosedJaxpr, num_carry: int, length: int) -> list:
    avals = jaxpr.out_avals
    return list(avals[:num_carry]) + [_stacked(length, a) for a in avals[num_carry:]]


def _primal_scan(consts, init, xs, *, jaxpr, num_carry, length, unroll):
    body = _body(jaxpr, num_carry)
    carry, ys = lax.scan(
        lambda c, x: body(consts, c, x),
        list(init),
        list(xs),
        length=length,
        unroll=unroll,
    )
    return list(carry) + list(ys)


def _store(slot, snaps, stored):
    """`snaps` with `stored` (one value per store) in slot `slot` when `slot >= 0`;
    a `cond` keeps the other steps from touching the store. Call it last in a loop
    iteration (see `_scan_impl`).

    One `cond` per store: XLA drops a store the reverse pass never reads (a buffer
    that the steps only shift and overwrite), but it kept one written by the same
    conditional as a `ShiftBuffer`'s error record, and so stored the whole buffer
    every step (the insert-then-delete gradient with `checkpoints="all"`).
    """
    return [
        lax.cond(slot >= 0, lambda s, c: s.at[slot].set(c), lambda s, c: s, si, ci)
        for si, ci in zip(snaps, stored)
    ]


# ---------------------------------------------------------------------------
# scan_p


def _unchanged_as_buffers(jaxpr: ClosedJaxpr, num_consts: int, roles) -> tuple:
    """`roles`, with each `NORMAL` carry leaf that the body returns unchanged (a
    read-only carry: a table, a buffer the step only reads, through `read` too)
    made a `BUFFER`.

    Its value is the same at every step, so a rerun step may see its final value,
    as a buffer's: it need not be stored. Stored, the reverse pass's rerun steps
    wrote it back into the checkpoints it was loaded from, a `dynamic_update_slice`
    of the stack of checkpoints whose update is a slice of that stack, and XLA
    copied the whole stack twice a reversed step (a (64, 256) carry only read:
    2 copies of its 3 checkpoints a step; `lax.scan` 0)."""
    inner = jaxpr.jaxpr
    carry_in = inner.invars[num_consts : num_consts + len(roles)]
    # A read returns its storage as it was (`buf, w = buf.read()`).
    same = {v: v for v in carry_in}
    for eqn in inner.eqns:
        v = eqn.invars[0] if eqn.invars else None
        if eqn.primitive is read_p and isinstance(v, jcore.Var) and v in same:
            same[eqn.outvars[0]] = same[v]
    return tuple(
        BUFFER
        if r == NORMAL and isinstance(out, jcore.Var) and same.get(out) is v
        else r
        for r, v, out in zip(roles, carry_in, inner.outvars)
    )


scan_p = Primitive("esb_scan")
scan_p.multiple_results = True


def _scan_impl(
    *args, jaxpr, num_consts, num_carry, length, checkpoints, unroll, save, roles
):
    consts, init, xs = _split(args, num_consts, num_carry)
    if not save:
        return _primal_scan(
            consts,
            init,
            xs,
            jaxpr=jaxpr,
            num_carry=num_carry,
            length=length,
            unroll=unroll,
        )
    body = _body(jaxpr, num_carry)
    sched = schedule(length, checkpoints)
    # Step k stores the carry it *returns* (the one before step k + 1) where the
    # schedule says so; the initial carry goes in slot 0 before the loop. Storing at
    # the end of an iteration matters: the next iteration edits that carry in place,
    # and the loop boundary orders the store's read before those writes. Stored at
    # the start of the step instead, XLA could not order the store before the
    # step's edits and copied the carry every step (corpus bodies that read their
    # buffer).
    after = np.append(sched.primal_slot[1:], -1).astype(np.int32)
    slots = jnp.asarray(after)
    normal = _normal(roles)
    assert sched.primal_slot[0] == 0
    snaps0 = [
        _zeros(_stacked(sched.checkpoints, _aval(c))).at[0].set(c)
        for c in _pick(init, normal)
    ]

    def step(state, x):
        k, carry, snaps = state
        carry, y = body(consts, carry, x)
        snaps = _store(slots[k], snaps, _pick(carry, normal))
        return (k + 1, carry, snaps), y

    # The step number is carried, not scanned over: an `arange` input would be a
    # length-sized temporary.
    (_, carry, snaps), ys = lax.scan(
        step, (jnp.int32(0), list(init), snaps0), list(xs), length=length, unroll=unroll
    )
    return list(carry) + list(ys) + list(snaps)


def _scan_abstract_eval(
    *args, jaxpr, num_consts, num_carry, length, checkpoints, unroll, save, roles
):
    out = _out_avals(jaxpr, num_carry, length)
    if save:
        slots = schedule(length, checkpoints).checkpoints  # as `_scan_impl` stores
        init = _pick(args[num_consts : num_consts + num_carry], _normal(roles))
        out += [_stacked(slots, a) for a in init]
    return out, jaxpr.effects


scan_p.def_impl(_scan_impl)
scan_p.def_effectful_abstract_eval(_scan_abstract_eval)


def _scan_dce(used_outputs: list[bool], eqn):
    """JAX's dead-code elimination of `scan_p`: the per-step outputs nothing uses
    are removed from the step (every carry and stored carry is kept).

    Under `grad` the forward pass's outputs (the loss) are not used, but a step
    that reads its buffer and sums it before an edit computed the sum every step
    anyway: the edit waits for the user's reads before it
    (`_xla.user_reads_before`), which keeps them from XLA's own dead-code
    elimination."""
    jaxpr, num_carry = eqn.params["jaxpr"], eqn.params["num_carry"]
    num_ys = len(jaxpr.out_avals) - num_carry
    used_ys = used_outputs[num_carry : num_carry + num_ys]
    if all(used_ys):
        return [True] * len(eqn.invars), eqn
    dced, _ = pe.dce_jaxpr(jaxpr.jaxpr, [True] * num_carry + used_ys, instantiate=True)
    keep = (
        [True] * num_carry + used_ys + [True] * (len(eqn.outvars) - num_carry - num_ys)
    )
    new = ClosedJaxpr(dced, jaxpr.consts)
    outvars = [v for v, k in zip(eqn.outvars, keep, strict=True) if k]
    new_eqn = pe.new_jaxpr_eqn(
        eqn.invars,
        outvars,
        scan_p,
        dict(eqn.params, jaxpr=new),
        new.effects,
        eqn.source_info,
        eqn.ctx,
    )
    return [True] * len(eqn.invars), new_eqn


pe.dce_rules[scan_p] = _scan_dce
mlir.register_lowering(scan_p, mlir.lower_fun(_scan_impl, multiple_results=True))


def _scan_jvp(
    primals,
    tangents,
    *,
    jaxpr,
    num_consts,
    num_carry,
    length,
    checkpoints,
    unroll,
    save,
    roles,
):
    if save:
        # Only met by forward mode over a derivative (e.g. Hessian-vector products,
        # forward over reverse): differentiate the implementation, uncheckpointed.
        return _jvp_of_impl(
            _scan_impl,
            primals,
            tangents,
            jaxpr=jaxpr,
            num_consts=num_consts,
            num_carry=num_carry,
            length=length,
            checkpoints=checkpoints,
            unroll=unroll,
            save=save,
            roles=roles,
        )
    params = dict(
        jaxpr=jaxpr,
        num_consts=num_consts,
        num_carry=num_carry,
        length=length,
        checkpoints=checkpoints,
        unroll=unroll,
        roles=roles,
    )
    out_avals = _out_avals(jaxpr, num_carry, length)
    if all(type(t) is ad.Zero for t in tangents):
        out = scan_p.bind(*primals, save=False, **params)
        return out, [ad.Zero(a.to_tangent_aval()) for a in out_avals]
    tangents = list(tangents)
    plan = _tape.plan(jaxpr, num_consts, roles, length=length, checkpoints=checkpoints)
    if plan is None:
        outs = scan_p.bind(*primals, save=True, **params)
        lin_jaxpr, lin_extra, num_tape = jaxpr, [], 0
    else:
        # Buffers reached only by edits are not stored: the forward pass records
        # what their accesses return, and rerun steps replay it (`_tape`).
        rec, rec_extra = plan.recording()
        lin_jaxpr, lin_extra = plan.replaying()
        num_tape = len(plan.taped)
        params["roles"] = plan.roles
        outs = scan_p.bind(
            *rec_extra,
            *primals,
            save=True,
            **{**params, "jaxpr": rec, "num_consts": len(rec_extra) + num_consts},
        )
    n_out = len(out_avals)
    primal_out = outs[:n_out]
    tapes, snaps = outs[n_out : n_out + num_tape], outs[n_out + num_tape :]
    # Buffers are not stored: rerun steps see their final values.
    finals = [c for c, r in zip(primal_out[:num_carry], roles) if r == BUFFER]
    # The tape is a per-step input of the rerun steps, after the `xs`; constants
    # made by tracing the replaying body (if any) come before the scan's own.
    lin_primals = [*lin_extra, *primals, *tapes]
    tangents = [ad.Zero(_aval(e).to_tangent_aval()) for e in lin_extra] + tangents
    tangents += [ad.Zero(_aval(t).to_tangent_aval()) for t in tapes]
    in_avals = [_aval(p) for p in lin_primals]
    tangents_in = [
        ad.instantiate_zeros(t) for t, a in zip(tangents, in_avals) if _inexact(a)
    ]
    params.update(jaxpr=lin_jaxpr, num_consts=len(lin_extra) + num_consts)
    tangent_out = scan_lin_p.bind(*lin_primals, *snaps, *finals, *tangents_in, **params)
    tangent_out = iter(tangent_out)
    out_tangents = [
        next(tangent_out) if _inexact(a) else ad.Zero(a.to_tangent_aval())
        for a in out_avals
    ]
    return primal_out, out_tangents


ad.primitive_jvps[scan_p] = _scan_jvp


# ---------------------------------------------------------------------------
# scan_lin_p: operands (*consts, *init, *xs, *snaps, *tangents of the inexact
# ones among consts, init, xs). Outputs: tangents of the inexact outputs.


scan_lin_p = Primitive("esb_scan_lin")
scan_lin_p.multiple_results = True


def _lin_split(args, num_in, roles):
    """(primals, stored carries, final buffers, tangents) of `scan_lin_p`."""
    num_snaps = sum(r == NORMAL for r in roles)
    num_finals = sum(r == BUFFER for r in roles)
    primals, snaps, finals, tangents = _split(args, num_in, num_snaps, num_finals)
    return primals, snaps, finals, tangents


def _full_tangents(primals, tangents):
    it = iter(tangents)
    return [
        next(it) if _inexact(_aval(p)) else _float0_zeros(_aval(p)) for p in primals
    ]


def _lin_impl(*args, jaxpr, num_consts, num_carry, length, checkpoints, unroll, roles):
    num_in = len(jaxpr.in_avals)
    primals, _, _, tangents = _lin_split(args, num_in, roles)
    tfull = _full_tangents(primals, tangents)
    consts, init, xs = _split(primals, num_consts, num_carry)
    tconsts, tinit, txs = _split(tfull, num_consts, num_carry)
    body = _body(jaxpr, num_carry)

    def step(state, inp):
        carry, tcarry = state
        x, tx = inp
        (carry, y), (tcarry, ty) = jax.jvp(
            lambda k, c, xx: body(k, c, xx), (consts, carry, x), (tconsts, tcarry, tx)
        )
        return (carry, tcarry), ty

    (carry, tcarry), tys = lax.scan(
        step, (init, tinit), (xs, txs), length=length, unroll=unroll
    )
    out = list(tcarry) + list(tys)
    out_avals = _out_avals(jaxpr, num_carry, length)
    return [t for t, a in zip(out, out_avals) if _inexact(a)]


def _lin_abstract_eval(
    *args, jaxpr, num_consts, num_carry, length, checkpoints, unroll, roles
):
    out_avals = _out_avals(jaxpr, num_carry, length)
    return [a for a in out_avals if _inexact(a)], jaxpr.effects


scan_lin_p.def_impl(_lin_impl)
scan_lin_p.def_effectful_abstract_eval(_lin_abstract_eval)
mlir.register_lowering(scan_lin_p, mlir.lower_fun(_lin_impl, multiple_results=True))


def _jvp_of_impl(impl, primals, tangents, **params):
    """Forward mode of a primitive through its implementation (plain `lax.scan`s)."""
    tangents = [
        ad.instantiate_zeros(t) if _inexact(_aval(p)) else _float0_zeros(_aval(p))
        for p, t in zip(primals, tangents)
    ]
    out, tout = jax.jvp(lambda *a: impl(*a, **params), list(primals), tangents)
    tout = [
        t if _inexact(_aval(o)) else ad.Zero(_aval(o).to_tangent_aval())
        for o, t in zip(out, tout)
    ]
    return out, tout


def _lin_jvp(primals, tangents, **params):
    # A second derivative through the checkpointed scan: differentiate the
    # implementation (a `lax.scan` of the body's JVP), without checkpointing.
    return _jvp_of_impl(_lin_impl, primals, tangents, **params)


ad.primitive_jvps[scan_lin_p] = _lin_jvp


def _lin_transpose(
    cts, *args, jaxpr, num_consts, num_carry, length, checkpoints, unroll, roles
):
    num_in = len(jaxpr.in_avals)
    primals, snaps, finals, tangents = _lin_split(args, num_in, roles)
    assert not any(ad.is_undefined_primal(x) for x in primals + snaps + finals)
    consts, _, xs = _split(primals, num_consts, num_carry)
    in_avals = [_aval(p) for p in primals]
    # Which inputs need a cotangent: inexact, with an undefined (linear) tangent.
    tangent_iter = iter(tangents)
    needed = []
    for a in in_avals:
        if _inexact(a):
            needed.append(ad.is_undefined_primal(next(tangent_iter)))
        else:
            needed.append(False)
    need_consts, _, need_xs = _split(needed, num_consts, num_carry)
    out_avals = _out_avals(jaxpr, num_carry, length)
    cts = iter(cts)
    ct_out = [
        ad.instantiate_zeros(next(cts)) if _inexact(a) else None for a in out_avals
    ]
    ct_carry_out, ct_ys = ct_out[:num_carry], ct_out[num_carry:]
    ct_consts, ct_init, ct_xs = _reverse_pass(
        jaxpr=jaxpr,
        num_carry=num_carry,
        length=length,
        checkpoints=checkpoints,
        consts=consts,
        xs=xs,
        snaps=snaps,
        finals=finals,
        roles=roles,
        ct_carry=ct_carry_out,
        ct_ys=ct_ys,
        need_consts=need_consts,
        need_xs=need_xs,
    )
    result = [None] * (len(primals) + len(snaps) + len(finals))
    for ct, need, a in zip(ct_consts + ct_init + ct_xs, needed, in_avals):
        if _inexact(a):
            result.append(ct if need else None)
    return result


ad.primitive_transposes[scan_lin_p] = _lin_transpose


def _reverse_pass(
    *,
    jaxpr,
    num_carry,
    length,
    checkpoints,
    consts,
    xs,
    snaps,
    finals,
    roles,
    ct_carry,
    ct_ys,
    need_consts,
    need_xs,
):
    """The binomial reverse pass. Returns cotangents of (consts, init, xs), with
    `None` where not inexact or not needed."""
    body = _body(jaxpr, num_carry)
    sched = schedule(length, checkpoints)
    carry_avals = list(jaxpr.in_avals[len(consts) : len(consts) + num_carry])
    x_avals = list(jaxpr.in_avals[len(consts) + num_carry :])
    y_avals = list(jaxpr.out_avals[num_carry:])
    diff_carry = [_inexact(a) for a in carry_avals]
    diff_y = [_inexact(a) for a in y_avals]
    diff_consts = list(need_consts)
    diff_xs = list(need_xs)

    restore = jnp.asarray(sched.restore)
    begin = jnp.asarray(sched.begin)
    end = jnp.asarray(sched.end)
    reverse = jnp.asarray(sched.reverse)
    adv_step = jnp.asarray(sched.advance_step) if sched.recomputed else None
    adv_slot = jnp.asarray(sched.advance_slot) if sched.recomputed else None

    def x_at(i):
        return [lax.dynamic_index_in_dim(x, i, keepdims=False) for x in xs]

    pick, fill, normal = _pick, _fill, _normal(roles)
    rerun = _carries_body(jaxpr, num_carry, normal)

    def with_finals(stored):
        # A rerun step sees the stored leaves, the buffers' final values, and the
        # checked mode's phase zero: off (the final buffers are all written). A
        # taped leaf is zero too: what the step reads of it is replayed.
        it_s, it_f = iter(stored), iter(finals)
        out = []
        for r, a in zip(roles, carry_avals):
            if r == NORMAL:
                out.append(next(it_s))
            elif r == BUFFER:
                out.append(next(it_f))
            else:
                out.append(_zeros(a))
        return out

    # Whether a rerun step ever stores what it computed (not with one checkpoint:
    # every reversed step reruns from the first).
    stores = sched.recomputed and bool((sched.advance_slot >= 0).any())

    def advance(state):
        assert adv_step is not None and adv_slot is not None
        g, stored, snaps = state
        k = adv_step[g]
        # What the step wrote into buffers is dropped, and its outputs: only what
        # it stores is computed (`_carries_body`).
        stored = rerun(consts, with_finals(stored), x_at(k))
        snaps = _store(adv_slot[g], snaps, stored)
        return g + 1, stored, snaps

    def reversal(j, state):
        snaps, ct_c, ct_k, ct_x = state
        stored = [
            lax.dynamic_index_in_dim(s, restore[j], keepdims=False) for s in snaps
        ]
        if adv_step is not None:
            # Without stores, the stack stays out of the loop (an empty list):
            # carried through a `cond` that might write it, while `stored` (read
            # from it) is live, XLA copied it twice a reversed step.
            state = (begin[j], stored, snaps if stores else [])
            _, stored, kept = lax.while_loop(lambda s: s[0] < end[j], advance, state)
            snaps = kept if stores else snaps
        carry = with_finals(stored)
        i = reverse[j]
        x = x_at(i)

        def f(dk, dc, dx):
            c_out, y = body(
                fill(consts, diff_consts, dk),
                fill(carry, diff_carry, dc),
                fill(x, diff_xs, dx),
            )
            return pick(c_out, diff_carry), pick(y, diff_y)

        _, vjp_fn = jax.vjp(
            f, pick(consts, diff_consts), pick(carry, diff_carry), pick(x, diff_xs)
        )
        ct_y_i = [
            lax.dynamic_index_in_dim(c, i, keepdims=False) for c in pick(ct_ys, diff_y)
        ]
        dk, dc, dx = vjp_fn((ct_c, ct_y_i))
        ct_k = [a + b for a, b in zip(ct_k, dk)]
        ct_x = [lax.dynamic_update_index_in_dim(a, b, i, 0) for a, b in zip(ct_x, dx)]
        return snaps, list(dc), ct_k, ct_x

    ct_c0 = pick(ct_carry, diff_carry)
    ct_k0 = [_zeros(a) for a in pick(jaxpr.in_avals[: len(consts)], diff_consts)]
    ct_x0 = [_zeros(_stacked(length, a)) for a in pick(x_avals, diff_xs)]
    _, ct_c, ct_k, ct_x = lax.fori_loop(
        0, length, reversal, (list(snaps), ct_c0, ct_k0, ct_x0)
    )
    ct_consts = fill([None] * len(consts), diff_consts, ct_k)
    ct_init = fill([None] * num_carry, diff_carry, ct_c)
    ct_xs = fill([None] * len(xs), diff_xs, ct_x)
    return ct_consts, ct_init, ct_xs


# ---------------------------------------------------------------------------
# Batching: the body is vmapped; consts and xs batched only when they are (consts
# at 0, xs at 1: after the scanned axis), the carry where it is or the body makes
# it so (at 0; `esb_scan_lin`: all of it).


def _batch_body(jaxpr, num_consts, num_carry, size, batched, args):
    """The body vmapped over the batch of `args` (the operands, placed by
    `_place`; `batched`: which are), a batched carry batched in the results too:
    traced at their types, so that a batch sharded over devices (its sharding in
    its type, on a mesh with explicit axes) is traced sharded, as `jax.vmap`
    traces a function of it, and the results have its sharding."""
    num_in = len(jaxpr.in_avals)
    fun = jaxpr_as_fun(jaxpr)
    in_axes = [0 if b else None for b in batched]
    carry_axes = in_axes[num_consts : num_consts + num_carry]
    kinds = _kinds(num_in, num_consts, num_carry)
    in_avals = [
        a if ax is None else _batched_aval(x, kind)
        for a, ax, x, kind in zip(jaxpr.in_avals, in_axes, args, kinds)
    ]
    assert len(in_avals) == num_in
    num_y = len(jaxpr.out_avals) - num_carry
    batched = jax.vmap(
        lambda *a: list(fun(*a)),
        in_axes=in_axes,
        out_axes=carry_axes + [0] * num_y,
        axis_size=size,
    )
    new, extra = _trace(batched, in_avals, "esb.scan (vmapped body)")
    return new, extra


def _batched_aval(x, kind):
    """The type of one step's batched operand, from `x` as `_place` placed it (a
    per-step input, kind "x", less its scanned axis): its sharding included, as
    `lax.scan` traces its body. Not weakly typed: a batched operand is an array."""
    t = _aval(x)
    if kind == "x":
        t = jcore.mapped_aval(t.shape[0], 0, t)
    return t.update(weak_type=False)


def _place(x, d, kind, batched, size):
    """Move `x`'s batch axis (`d`, or None) where the batched body expects it, only
    when `batched`: the carry ("i") and consts ("c") at 0, broadcast if `x` is
    unbatched (a carry the body batches), xs ("x") at 1 (after the scanned axis)."""
    if not batched:
        return x
    return _move(x, d, 1 if kind == "x" else 0, size)


def _with_batched_carries(jaxpr, num_consts, num_carry, size, batched) -> list[bool]:
    """`batched` (of every operand), with the carries the batched body carries
    batched: those batched on entry, and those the body makes batched from
    batched operands, to a fixed point (as `lax.scan`'s batching rule).

    A carry the body only reads, or computes from unbatched operands, stays
    unbatched: broadcast to the batch, a buffer the step reads whole was one
    batch's worth of memory, and its final value, which the reverse pass feeds
    to the loop that reruns steps from a checkpoint, was copied on every one of
    its trips under `jax.vmap(jax.grad(...))` (`lax.scan`: none).
    """
    cb, carry_b, xb = _split(list(batched), num_consts, num_carry)
    axis = batching_internal.AxisData(None, size, None, None)
    while True:
        _, out_b = batching_internal.batch_jaxpr(jaxpr, axis, cb + carry_b + xb, False)
        new = [a or b for a, b in zip(carry_b, out_b[:num_carry])]
        if new == carry_b:
            return cb + carry_b + xb
        carry_b = new


def _kinds(num_in, num_consts, num_carry):
    return (
        ["c"] * num_consts
        + ["i"] * num_carry
        + ["x"] * (num_in - num_consts - num_carry)
    )


def _move(x, d, to, size):
    if d is None:
        x = jnp.broadcast_to(
            jnp.expand_dims(x, to), (*x.shape[:to], size, *x.shape[to:])
        )
        return x
    return jnp.moveaxis(x, d, to)


def _axis_size(args, dims):
    for x, d in zip(args, dims):
        if d is not None:
            return x.shape[d]
    raise AssertionError


def _scan_batch(
    args,
    dims,
    *,
    jaxpr,
    num_consts,
    num_carry,
    length,
    checkpoints,
    unroll,
    save,
    roles,
):
    size = _axis_size(args, dims)
    batched = [d is not None for d in dims]
    batched = _with_batched_carries(jaxpr, num_consts, num_carry, size, batched)
    carry_b = batched[num_consts : num_consts + num_carry]
    kinds = _kinds(len(args), num_consts, num_carry)
    args = [_place(*a, size) for a in zip(args, dims, kinds, batched)]
    new, extra = _batch_body(jaxpr, num_consts, num_carry, size, batched, args)
    out = scan_p.bind(
        *extra,
        *args,
        jaxpr=new,
        num_consts=len(extra) + num_consts,
        num_carry=num_carry,
        length=length,
        checkpoints=checkpoints,
        unroll=unroll,
        save=save,
        roles=roles,
    )
    num_y = len(jaxpr.out_avals) - num_carry
    # A carry's stored values (`save`, one per `NORMAL` carry) are batched as it is.
    snaps_b = _pick(carry_b, _normal(roles)) if save else []
    out_dims = (
        [0 if b else None for b in carry_b]
        + [1] * num_y
        + [1 if b else None for b in snaps_b]
    )
    return out, out_dims


batching.primitive_batchers[scan_p] = _scan_batch


def _lin_batch(
    args, dims, *, jaxpr, num_consts, num_carry, length, checkpoints, unroll, roles
):
    size = _axis_size(args, dims)
    num_in = len(jaxpr.in_avals)
    primals, snaps, finals, tangents = _lin_split(args, num_in, roles)
    pdims, sdims, fdims, tdims = _lin_split(dims, num_in, roles)
    inexact = [_inexact(_aval(p)) for p in primals]
    # A primal is batched if it or its tangent is; every carry is.
    tdim_full = _fill([None] * len(primals), inexact, tdims)
    batched = [(pd is not None) or (td is not None) for pd, td in zip(pdims, tdim_full)]
    cb, _, xb = _split(batched, num_consts, num_carry)
    batched = cb + [True] * num_carry + xb
    kinds = _kinds(num_in, num_consts, num_carry)
    primals = [_place(*a, size) for a in zip(primals, pdims, kinds, batched)]
    new, extra = _batch_body(jaxpr, num_consts, num_carry, size, batched, primals)
    # Tangents exist for the inexact primals only, and go where their primal goes.
    tangent_kinds = _pick(list(zip(kinds, batched)), inexact)
    tangents = [
        _place(t, d, k, b, size) for t, d, (k, b) in zip(tangents, tdims, tangent_kinds)
    ]
    snaps = [_move(s, d, 1, size) for s, d in zip(snaps, sdims)]
    finals = [_move(f, d, 0, size) for f, d in zip(finals, fdims)]
    extra_tangents = [jnp.zeros_like(e) for e in extra if _inexact(_aval(e))]
    out = scan_lin_p.bind(
        *extra,
        *primals,
        *snaps,
        *finals,
        *extra_tangents,
        *tangents,
        jaxpr=new,
        num_consts=len(extra) + num_consts,
        num_carry=num_carry,
        length=length,
        checkpoints=checkpoints,
        unroll=unroll,
        roles=roles,
    )
    out_avals = _out_avals(jaxpr, num_carry, length)
    out_dims = [
        0 if k < num_carry else 1 for k, a in enumerate(out_avals) if _inexact(a)
    ]
    return out, out_dims


batching.primitive_batchers[scan_lin_p] = _lin_batch


# ---------------------------------------------------------------------------
# The public function.


def _default_checkpoints(length: int) -> int:
    # Equinox's default (checkpointed.py): the least c with length < (c+1)(c+2)/2,
    # about sqrt(2 * length): O(sqrt(length)) memory, each step rerun at most about
    # twice.
    return int(np.floor(-1.5 + np.sqrt(2 * length + 0.25))) + 1


def scan(
    f: Callable,
    init: Any,
    xs: Any = None,
    length: int | None = None,
    *,
    reverse: bool = False,
    unroll: int | bool = 1,
    kind: Literal["lax", "checkpointed"] = "checkpointed",
    checkpoints: int | Literal["all"] | None = None,
    buffers: Callable | None = None,
    check: bool = False,
) -> tuple[Any, Any]:
    """Scan a function over leading array axes, as `jax.lax.scan`, with a
    checkpointed reverse pass.

    **Arguments:**

    - `f`, `init`, `xs`, `length`, `reverse`, `unroll`: as in `jax.lax.scan`. `f` is
      traced once.
    - `kind`: `"lax"` is `jax.lax.scan` (reverse mode stores every step's residuals).
      `"checkpointed"` (default) stores `checkpoints` carries in the forward pass and,
      in reverse mode, reruns steps from them on the optimal offline (binomial)
      schedule for this length and number of slots; forward mode (`jax.jvp`) works
      too.
    - `checkpoints`: how many carries to store for the reverse pass, the initial one
      included: an int >= 1, `"all"` (every step: nothing is rerun), or `None`, the
      least `c` with `length < (c+1)(c+2)/2` (about `sqrt(2 * length)`, as
      `equinox.internal.scan`), for which every step is rerun at most twice.
      A [`eqx_shiftbuf.ShiftBuffer`][] in the carry that the step only edits and
      reads windows of (its methods, or the free functions) is not stored: the
      forward pass records what its accesses return, O(window) a step, and the
      reverse pass replays that, so no step loads or stores the whole buffer.
      This is chosen per buffer when the record takes no more memory than storing
      the buffer at the checkpoints; a buffer also used otherwise (`buf.array`)
      is stored. A stored buffer is copied at every store and at every reversed
      step; when the step's edits are cheap and it reads the whole buffer, fewer
      checkpoints than the default are faster (see `docs/layout.md`).
    - `buffers`: as in `equinox.internal.scan`: a function from `init` to the array
      leaves (one, or a sequence) of the carry that are *write-once* buffers: each
      position written at most once, and read only after it is written (or never
      written). The body sees each as a
      [`eqx_shiftbuf.WriteOnceBuffer`][] (`buf[i]`, `buf.at[i].set(v, pred=p)`,
      `esb.dynamic_slice`, `esb.dynamic_update_slice`), under both kinds. With
      `kind="checkpointed"` they are not stored at checkpoints: rerun steps read
      their final values. Writes and reads are in place; the gradient with respect
      to the initial contents is exact (zero where written).
    - `check`: with `buffers`, raise through `equinox.error_if`, when the program
      runs, on a *second write* to an element of a buffer (during the scan), and
      on a *read before write* (after the scan, before its results can be used): a
      read of an element that a later write writes, later in the same step or in a
      later step. The reverse pass reruns steps against the final buffer, so such
      a read would be replayed with the written value and the gradient would be
      silently wrong. Reading an element no write writes is allowed. Accesses
      count wherever they are in the step (`lax.cond`, `lax.switch`, nested loops
      and `esb.scan`s, `jax.checkpoint`, `jax.vmap`). Writes thread a record of
      which write wrote each element; after the scan the steps run once more,
      without gradient, from the initial carry with each buffer at its final
      contents and record, and there each read checks that no later write writes
      its window. See [`eqx_shiftbuf.WriteOnceBuffer`][] for the details. Off by
      default: it costs two int32 arrays the size of each buffer, a check per
      access, and that second run of the steps; `check=False` adds nothing.

    **Returns:**

    `(carry, ys)`, as `jax.lax.scan`.
    """
    if kind not in ("lax", "checkpointed"):
        raise ValueError(f"`kind` must be 'lax' or 'checkpointed'; got {kind!r}.")
    # Buffers handed in already wrapped (by an outer scan) are returned wrapped.
    outer = [_is_wob(n) for n in jtu.tree_leaves(init, is_leaf=_is_wob)]
    if buffers is not None:
        init = _wrap_buffers(init, buffers, check)
    unwrap = functools.partial(_unwrap_buffers, keep=outer)
    top, _ = jtu.tree_flatten(init, is_leaf=_is_wob)
    # The buffers this scan checks: its own, not an outer scan's (whose steps and
    # replay belong to that scan).
    checked = [
        _is_wob(n) and not o and n._writes is not None for n, o in zip(top, outer)
    ]
    if kind == "lax" and not any(checked):
        carry, ys = lax.scan(f, init, xs, length, reverse=reverse, unroll=unroll)
        return unwrap(carry), ys
    roles = []
    for node in top:
        roles.extend(node._roles() if _is_wob(node) else [NORMAL])
    init_flat, init_tree = jtu.tree_flatten(init)
    assert len(roles) == len(init_flat)
    xs_flat, xs_tree = jtu.tree_flatten(xs)
    init_flat = [jnp.asarray(c) for c in init_flat]
    xs_flat = [jnp.asarray(x) for x in xs_flat]
    if any(x.ndim == 0 for x in xs_flat):
        raise ValueError(
            "esb.scan: every leaf of `xs` needs a leading axis to scan over."
        )
    lengths: set[int] = {int(x.shape[0]) for x in xs_flat}
    if length is not None:
        lengths.add(int(length))
    if len(lengths) > 1:
        raise ValueError(
            f"esb.scan: `xs` leading axes and `length` must agree; got {sorted(lengths)}."
        )
    if not lengths:
        raise ValueError("esb.scan: give `length` when `xs` is None.")
    (length,) = lengths
    if checkpoints is None:
        slots = _default_checkpoints(length)
    elif checkpoints == "all":
        slots = max(length, 1)
    elif (
        isinstance(checkpoints, int)
        and not isinstance(checkpoints, bool)
        and checkpoints >= 1
    ):
        slots = checkpoints
    else:
        raise ValueError(
            f"`checkpoints` must be None, 'all' or an int >= 1; got {checkpoints!r}."
        )
    slots = min(slots, max(length, 1))

    carry_avals = [_aval(c) for c in init_flat]
    # A step's inputs have the types of the `xs` less their scanned axis, sharding
    # included, as `lax.scan` traces its body (`core.mapped_aval`). Typed as plain
    # unsharded arrays they broke a body that vmaps over a carry sharded on an
    # explicit mesh together with per-step inputs: `jax.vmap` requires the mapped
    # axes of its inputs to be sharded alike ("Mapped away dimension of inputs
    # passed to vmap should be sharded the same ... b vs None").
    x_avals = [
        jcore.mapped_aval(length, 0, _aval(x)).update(weak_type=False) for x in xs_flat
    ]
    out_tree_box = []
    promote: dict[int, Any] = {}

    def flat_body(*args):
        carry, x = args[: len(carry_avals)], args[len(carry_avals) :]
        carry = jtu.tree_unflatten(init_tree, carry)
        x = jtu.tree_unflatten(xs_tree, x)
        out = f(carry, x)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"esb.scan: `f` must return a pair (carry, y); got {out!r}."
            )
        new_carry, y = out
        c_flat, c_tree = jtu.tree_flatten(new_carry)
        if c_tree != init_tree:
            raise TypeError(
                f"esb.scan: `f` must return a carry with the structure of `init`; "
                f"expected {init_tree}, got {c_tree}."
            )
        c_flat = [jnp.asarray(c) for c in c_flat]
        for k, (c, a) in enumerate(zip(c_flat, carry_avals)):
            if c.shape == a.shape and c.dtype != a.dtype and a.weak_type:
                # A weakly typed init (a Python scalar) takes the body's dtype, as
                # in `lax.scan` (which also traces twice then).
                promote[k] = c.dtype
            elif c.shape != a.shape or c.dtype != a.dtype:
                raise TypeError(
                    "esb.scan: `f` must return a carry with the shapes and dtypes of "
                    f"`init`; expected {a.str_short()}, got "
                    f"{jcore.ShapedArray(c.shape, c.dtype).str_short()}."
                )
        y_flat, y_tree = jtu.tree_flatten(y)
        out_tree_box.append(y_tree)
        return [*c_flat, *[jnp.asarray(v) for v in y_flat]]

    jaxpr, consts = _trace(flat_body, carry_avals + x_avals, "esb.scan")
    if promote:
        init_flat = [
            lax.convert_element_type(c, promote[k]) if k in promote else c
            for k, c in enumerate(init_flat)
        ]
        carry_avals = [_aval(c) for c in init_flat]
        out_tree_box.clear()
        promote.clear()
        jaxpr, consts = _trace(flat_body, carry_avals + x_avals, "esb.scan")
    (y_tree,) = out_tree_box
    num_carry = len(init_flat)
    if length == 0:
        ys = [_zeros(_stacked(0, a)) for a in jaxpr.out_avals[num_carry:]]
        carry = jtu.tree_unflatten(init_tree, init_flat)
        return unwrap(carry), jtu.tree_unflatten(y_tree, ys)
    if reverse:
        xs_flat = [jnp.flip(x, 0) for x in xs_flat]
    unroll = int(unroll) if not isinstance(unroll, bool) else (length if unroll else 1)
    if kind == "lax":  # checked: the same steps as `scan_p`, without checkpoints
        out = _primal_scan(
            consts,
            init_flat,
            xs_flat,
            jaxpr=jaxpr,
            num_carry=num_carry,
            length=length,
            unroll=unroll,
        )
    else:
        out = scan_p.bind(
            *consts,
            *init_flat,
            *xs_flat,
            jaxpr=jaxpr,
            num_consts=len(consts),
            num_carry=num_carry,
            length=length,
            checkpoints=slots,
            unroll=unroll,
            save=False,
            roles=_unchanged_as_buffers(jaxpr, len(consts), roles),
        )
    if any(checked):
        tok = _replay(
            jaxpr,
            consts,
            init_tree,
            init_flat,
            out[:num_carry],
            xs_flat,
            checked,
            length=length,
            unroll=unroll,
        )
        out = [after(o, tok) if o.size else o for o in out]
    carry, ys = out[:num_carry], out[num_carry:]
    if reverse:
        ys = [jnp.flip(y, 0) for y in ys]
    carry = jtu.tree_unflatten(init_tree, carry)
    return unwrap(carry), jtu.tree_unflatten(y_tree, ys)


def _is_wob(x: Any) -> bool:
    return isinstance(x, WriteOnceBuffer)


def _replay(
    jaxpr, consts, init_tree, init, final, xs, checked, *, length, unroll
) -> jax.Array:
    """The checked mode's read-before-write check: an int32 zero, raising first.

    Runs the steps again from the initial carry `init`, with each buffer this scan
    checks at its `final` contents and record of writes, in the REPLAY phase (see
    `WriteOnceBuffer`): what the reverse pass reruns steps against. A read's check
    is an `error_if` on the value it returns. The zero returned depends on every
    value the steps return (each step's `ys`, and the last carry, which the loop
    computes every step), so no check on a read whose value is used is dead code
    once the scan's outputs depend on the zero. No gradient flows through it.
    """
    starts, tree = jtu.tree_flatten(
        jtu.tree_unflatten(init_tree, init), is_leaf=_is_wob
    )
    ends = jtu.tree_leaves(jtu.tree_unflatten(init_tree, final), is_leaf=_is_wob)
    nodes = [e._replaying() if c else s for s, e, c in zip(starts, ends, checked)]
    carry0 = jtu.tree_leaves(jtu.tree_unflatten(tree, nodes))
    body = _body(jaxpr, len(carry0))
    consts, carry0, xs = jax.tree.map(lax.stop_gradient, (consts, carry0, xs))

    def step(state, x):
        carry, tok = state
        carry, ys = body(consts, carry, x)
        for y in ys:
            tok = tok + _depends(y)
        return (carry, tok), None

    (carry, tok), _ = lax.scan(
        step, (carry0, jnp.int32(0)), xs, length=length, unroll=unroll
    )
    for c in carry:
        tok = tok + _depends(c)
    return tok


def _depends(x: jax.Array) -> jax.Array:
    """An int32 zero that XLA cannot fold, computed from every element of `x`."""
    if x.size == 0:
        return jnp.int32(0)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.real(x)
    return (jnp.max(x).astype(jnp.float32) > jnp.inf).astype(jnp.int32)


def _wrap_buffers(init: Any, buffers: Callable, check: bool) -> Any:
    """`init` with the leaves `buffers(init)` names wrapped as write-once buffers."""
    nodes = buffers(init)
    # One node or a sequence of nodes, told apart as Equinox does: by identity with
    # the value `buffers` returned (equinox/internal/_loop/loop.py).
    is_leaf = lambda node: node is nodes
    return eqx.tree_at(
        buffers, init, replace_fn=lambda x: wrap(x, check), is_leaf=is_leaf
    )


def _unwrap_buffers(carry: Any, keep: Sequence[bool]) -> Any:
    nodes, tree = jtu.tree_flatten(carry, is_leaf=_is_wob)
    nodes = [n.array if _is_wob(n) and not k else n for n, k in zip(nodes, keep)]
    return jtu.tree_unflatten(tree, nodes)
