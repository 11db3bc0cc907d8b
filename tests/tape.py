"""What a checkpointed `esb.scan`'s reverse pass does with a buffer.

`esb.scan` decides per buffer whether to record its reads instead of storing it
(`eqx_shiftbuf/_tape.py`): a test of the recorded path asserts it was taken
(`taped_leaves`), since a small buffer, or a large record, is stored; a buffer no
step edits is not stored either (`unstored_leaves`).
`loop_bodies` lists the instructions of compiled loop bodies, `loop_instructions`
those and their callees', and `loop_buffer_work` the buffer-sized work among them.
"""

from __future__ import annotations

import math
import re

import jax

from eqx_shiftbuf import _inspect
from eqx_shiftbuf._writeonce import BUFFER, TAPED


def _roles(fn, *args) -> tuple[int, ...]:
    # Of the one `esb_scan` equation in `fn`'s derivative that stores carries.
    eqns = [
        e
        for e in jax.make_jaxpr(fn)(*args).eqns
        if e.primitive.name == "esb_scan" and e.params["save"]
    ]
    assert len(eqns) == 1, eqns
    return eqns[0].params["roles"]


def taped_leaves(fn, *args) -> list[int]:
    """The flat carry leaves that the checkpointed scan in `fn`'s derivative
    records instead of storing."""
    return [k for k, r in enumerate(_roles(fn, *args)) if r == TAPED]


def unstored_leaves(fn, *args) -> list[int]:
    """The flat carry leaves that the checkpointed scan in `fn`'s derivative does
    not store: recorded (`taped_leaves`), or returned unchanged by every step."""
    return [k for k, r in enumerate(_roles(fn, *args)) if r in (TAPED, BUFFER)]


def _computations(fn, *args) -> tuple[dict[str, list[str]], list[str]]:
    """`(computations, loop bodies)`: the instructions of each computation of
    `fn`'s compiled program, by name, and the names of its `while` bodies."""
    return _computations_in(jax.jit(fn).lower(*args).compile().as_text())


def _computations_in(hlo: str) -> tuple[dict[str, list[str]], list[str]]:
    """`_computations` of the optimised HLO text `hlo`, the bodies in its order."""
    comps = _inspect._parse(hlo)
    bodies = {b for t in comps.values() for b in _inspect._BODY.findall(" ".join(t))}
    return comps, [name for name in comps if name in bodies]


def loop_bodies(fn, *args) -> dict[str, list[str]]:
    """The instructions of each `while` body of `fn`'s compiled program, by name."""
    comps, names = _computations(fn, *args)
    return {b: comps[b] for b in names}


def loop_instructions(fn, *args) -> list[str]:
    """The instructions of the `while` bodies of `fn`'s compiled program and of
    every computation they call (fusions, nested loops)."""
    comps, names = _computations(fn, *args)
    todo, seen, out = list(names), set(names), []
    while todo:
        for line in comps[todo.pop()]:
            out.append(line)
            for callee in re.findall(r"calls=%([\w.\-]+)", line):
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    return out


def _elements(hlo_shape: str) -> int | None:
    """The number of elements of an array of HLO shape `hlo_shape` (`"f32[64,8]"`),
    None for a tuple or token."""
    m = _inspect._ARRAY.fullmatch(hlo_shape)
    if m is None:
        return None
    return math.prod(int(d) for d in m.group(2).split(",") if d)


def loop_buffer_work(fn, args, shape: str | int) -> list[str]:
    """The instructions of the compiled loop bodies of `fn` that make an array of
    HLO shape `shape` (`"f32[64,8]"`), or of `shape` elements of any type and
    shape, other than by updating one in place: copies, broadcasts, and fusions
    whose root is not a `dynamic-update-slice` or a scatter (a full-size add,
    say)."""
    found = []
    for body in loop_bodies(fn, *args).values():
        for line in body:
            m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? ([\w-]+)\(", line)
            if m is None:
                continue
            if m.group(2) != shape and _elements(m.group(2)) != shape:
                continue
            name, op = m.group(1), m.group(3)
            # (A scatter writes into its operand, as a `dynamic-update-slice`
            # does; where it cannot, XLA copies the operand first, a copy.)
            in_place = op == "fusion" and (
                "dynamic-update-slice" in name or name.startswith("wrapped_scatter")
            )
            if not in_place and op not in ("parameter", "get-tuple-element", "bitcast"):
                found.append(line.strip()[:120])
    return found


# HLO instructions that XLA:CPU runs as no kernel of their own.
_NOT_KERNELS = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")


def loop_kernels(fn, *args) -> list[int]:
    """The kernels (thunks) of each `while` body of `fn`'s compiled program, in HLO
    order: every instruction but those in `_NOT_KERNELS`.

    XLA:CPU runs a loop body of at most 8 kernels in line and a longer one through
    its dataflow executor, at about 0.5 us more a trip
    (`benchmarks/experiments/thunk_threshold.py`)."""
    return loop_kernels_in(jax.jit(fn).lower(*args).compile().as_text())


def loop_kernels_in(hlo: str) -> list[int]:
    """`loop_kernels` of the optimised HLO text `hlo` (`compiled.as_text()`)."""
    comps, names = _computations_in(hlo)
    return [
        sum(1 for line in comps[b] if _opcode(line) not in (None, *_NOT_KERNELS))
        for b in names
    ]


def _opcode(line: str) -> str | None:
    """The opcode of an HLO instruction line, past its shape, which may be a tuple
    (`(s32[], f32[8]{0}, /*index=2*/...)`: a `while`, a `conditional`)."""
    m = re.match(r"\s*(?:ROOT )?%\S+ = ", line)
    if m is None:
        return None
    rest, depth = line[m.end() :], 0
    for k, ch in enumerate(rest):  # skip the shape, balanced brackets and all
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            op = re.match(r"([\w-]+)\(", rest[k + 1 :])
            return op.group(1) if op else None
    return None
