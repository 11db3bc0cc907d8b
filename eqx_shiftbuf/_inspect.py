"""Find copies of buffer-sized arrays that run on every iteration of a compiled loop."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


__all__ = ["LoopCopy", "find_loop_copies", "assert_in_place", "loop_copies_in_hlo"]

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1,
}  # fmt: skip

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*\)\s+->\s+.*\s+)?\{\s*$")
_CALLEE = re.compile(
    r"(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_FUSION = re.compile(r"\sfusion\(")
_COPY = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(copy|copy-start)\((.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_INSTR = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPERANDS = re.compile(r"%([\w.\-]+)")
# Frames in these packages are skipped when naming the source line of a copy: the
# user's line that called into them is the useful one.
_LIBRARY_PATHS = ("/jax/", "/jaxlib/", "/equinox/", "/eqx_shiftbuf/")


@dataclasses.dataclass(frozen=True)
class LoopCopy:
    """One copy instruction that runs on every iteration of a compiled loop.

    **Fields:**

    - `computation`: the HLO computation (a loop body, or one it calls) holding it.
    - `instruction`: the HLO instruction name.
    - `shape`: the copied array's shape, as in the HLO (`f32[100,1001]`).
    - `nbytes`: its size in bytes.
    - `op_name`: the JAX op name from the HLO metadata (which primitive, under which
      transformations), or `""`. For a copy XLA inserted (it has no metadata of its
      own), the nearest named op that consumes or produces it, prefixed
      `"(inserted by XLA for) "`; for a write that is not in place, the write's,
      prefixed `"(out-of-place write) "`.
    - `source`: `file:line` of the Python code that produced it (or, for an inserted
      copy, that produced `op_name`'s op), or `""`.
    - `loop`: the `while` body computation the copy runs in, once per iteration:
      `computation` itself, or the innermost loop body that calls it.
    - `loop_source`: `file:line` of that loop (the `lax.scan`, `lax.fori_loop` or
      `esb.scan` call), or `""`.
    - `inserted`: whether XLA inserted the copy: no JAX op produced it directly.
    - `hint`: the likely cause and what to change, or `""`.
    """

    computation: str
    instruction: str
    shape: str
    nbytes: int
    op_name: str
    source: str
    loop: str = ""
    loop_source: str = ""
    inserted: bool = False
    hint: str = ""

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source else ""
        op = f" from {self.op_name}" if self.op_name else ""
        what = "copy" if "out-of-place" not in self.op_name else "rewrite"
        loop = ""
        if self.loop and self.loop != self.computation:
            loop = f" of loop {self.loop!r}"
        if self.loop_source:
            loop += f" (the loop at {self.loop_source})"
        hint = f"\n    hint: {self.hint}" if self.hint else ""
        return (
            f"{what} of {self.shape} ({self.nbytes} bytes) in loop computation "
            f"{self.computation!r}{loop}{op}{where}{hint}"
        )


def _stack_frames(hlo: str) -> dict[int, str]:
    """`stack_frame_id` -> `file:line`, from the module's stack-frame tables."""
    section = None
    files: dict[int, str] = {}
    locations: dict[int, tuple[int, int]] = {}
    parents: dict[int, tuple[int, int]] = {}
    for line in hlo.splitlines():
        word = line.strip()
        if word in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = word
            continue
        if not word or word.startswith(("HloModule", "%", "ENTRY", "}")):
            if word:
                section = None
            continue
        m = re.match(r"^(\d+)\s+(.*)$", word)
        if m is None or section is None:
            continue
        key, rest = int(m.group(1)), m.group(2)
        if section == "FileNames":
            files[key] = rest.strip('"')
        elif section == "FileLocations":
            f = re.search(r"file_name_id=(\d+)", rest)
            n = re.search(r"\bline=(\d+)", rest)
            if f and n:
                locations[key] = (int(f.group(1)), int(n.group(1)))
        elif section == "StackFrames":
            loc = re.search(r"file_location_id=(\d+)", rest)
            par = re.search(r"parent_frame_id=(\d+)", rest)
            if loc:
                parents[key] = (int(loc.group(1)), int(par.group(1)) if par else 0)

    # The text prints each frame's `parent_frame_id` one above the frame it names
    # (`k {... parent_frame_id=k}` is frame k-1's child, and a root prints 1), so a
    # frame seems its own parent. Should a version print it as stored (0 = none),
    # no frame names itself; read it as is then.
    offset = 1 if any(par == key for key, (_, par) in parents.items()) else 0

    def describe(frame: int) -> str:
        chain = []
        seen = set()
        while frame in parents and frame not in seen:
            seen.add(frame)
            loc, parent = parents[frame]
            if loc in locations:
                fid, line = locations[loc]
                chain.append(f"{files.get(fid, '?')}:{line}")
            frame = parent - offset
        for where in chain:  # innermost first: the first frame outside libraries
            if not any(p in where for p in _LIBRARY_PATHS):
                return where
        return chain[0] if chain else ""

    return {frame: describe(frame) for frame in parents}


def _parse(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        stripped = line.strip()
        if current is None:
            m = _COMP.match(stripped)
            if m and not stripped.startswith("HloModule"):
                current = m.group(1)
                comps[current] = []
            continue
        if stripped == "}":
            current = None
            continue
        comps[current].append(stripped)
    return comps


_DUS = re.compile(r"dynamic-update-slice\(([^)]*)\)")
_DS = re.compile(r"dynamic-slice\(([^)]*)\)")


def _out_of_place_write(fused: list[str]) -> bool:
    """Whether a fused computation rooted at `dynamic-update-slice` cannot write its
    operand in place.

    XLA shares the operand's buffer with such a fusion's output only if, inside the
    fusion, the operand is read by nothing but `dynamic-slice`s at the write's own
    indices. Otherwise the fusion writes its whole output, every call, and no
    `copy` instruction shows it (a read of the operand through a static `slice`,
    say: XLA turns a `dynamic-slice` at constant indices into one).
    """
    instrs: dict[str, str] = {}
    root_name = None
    for line in fused:
        m = _INSTR.match(line)
        if m:
            instrs[m.group(1)] = m.group(2)
            if line.startswith("ROOT"):
                root_name = m.group(1)
    if root_name is None:
        return False
    root = instrs[root_name]
    dus = _DUS.search(root)
    if dus is None or not root.split("(", 1)[0].strip().endswith(
        "dynamic-update-slice"
    ):
        return False
    operands = _OPERANDS.findall(dus.group(1))
    if not operands or "parameter(" not in instrs.get(operands[0], ""):
        return False
    target, indices = operands[0], operands[2:]
    for name, text in instrs.items():
        if name == root_name or target not in _OPERANDS.findall(text.split("(", 1)[-1]):
            continue
        ds = _DS.search(text)
        if ds is None or _OPERANDS.findall(ds.group(1)) != [target, *indices]:
            return True
    return False


def _nbytes(shape_text: str) -> tuple[int, str]:
    """Largest array in an HLO shape (a tuple for `copy-start`), and its text."""
    best, text = 0, shape_text
    for m in _ARRAY.finditer(shape_text):
        dtype, dims = m.group(1), m.group(2)
        if dtype not in _BYTES:
            continue
        n = _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        if n > best:
            best, text = n, m.group(0)
    return best, text


def loop_copies_in_hlo(hlo: str, min_bytes: int = 1 << 16) -> list[LoopCopy]:
    """The per-iteration copies of at least `min_bytes` in compiled HLO text.

    **Arguments:**

    - `hlo`: the text of a compiled module (`jax.jit(f).lower(...).compile().as_text()`).
    - `min_bytes`: smaller copies are ignored.

    **Returns:**

    A list of [`eqx_shiftbuf.LoopCopy`][], in program order.
    """
    comps = _parse(hlo)
    calls: dict[str, set[str]] = {c: set() for c in comps}
    whiles: dict[str, str] = {}  # loop body -> the line of its `while` instruction
    for comp, lines in comps.items():
        for line in lines:
            # Not into fusions: a `copy` inside a fused computation is a layout change
            # (a transpose) computed element by element as part of that fusion's
            # output, not a copy of a buffer that XLA had to preserve.
            if not _FUSION.search(line):
                calls[comp].update(_CALLEE.findall(line))
            for body in _BODY.findall(line):
                whiles.setdefault(body, line)
            for group in _BRANCHES.findall(line):
                calls[comp].update(b.strip().lstrip("%") for b in group.split(","))
    # Each computation a loop body calls runs once per iteration of that body: the
    # innermost loop, since a nested loop's body claims its own computations.
    loop_of: dict[str, str] = {}
    for body in whiles:
        stack, seen = [body], set()
        while stack:
            comp = stack.pop()
            if comp in seen or comp not in comps or (comp != body and comp in whiles):
                continue
            seen.add(comp)
            loop_of.setdefault(comp, body)
            stack.extend(calls[comp])
    frames = _stack_frames(hlo)

    def origin(line: str) -> tuple[str, str]:
        op = _OP_NAME.search(line)
        src = _SOURCE.search(line)
        frame = _FRAME_ID.search(line)
        source = f"{src.group(1)}:{src.group(2)}" if src else ""
        if not source and frame:
            source = frames.get(int(frame.group(1)), "")
        return (op.group(1) if op else ""), source

    out = []
    for comp in comps:
        if comp not in loop_of:
            continue
        loop = loop_of[comp]
        loop_source = origin(whiles[loop])[1]
        graph = _Graph(comps[comp])
        for line in comps[comp]:
            m = _INSTR.match(line)
            callee = _CALLEE.search(line) if _FUSION.search(line) else None
            if m is None or callee is None or callee.group(1) not in comps:
                continue
            nbytes, shape = _nbytes(m.group(2).split("fusion(")[0])
            if nbytes >= min_bytes and _out_of_place_write(comps[callee.group(1)]):
                op_name, source = origin(line)
                out.append(
                    LoopCopy(
                        computation=comp,
                        instruction=m.group(1),
                        shape=shape,
                        nbytes=nbytes,
                        op_name=f"(out-of-place write) {op_name}",
                        source=source,
                        loop=loop,
                        loop_source=loop_source,
                        hint=_HINT_OUT_OF_PLACE,
                    )
                )
        for line in comps[comp]:
            m = _COPY.match(line)
            if m is None:
                continue
            nbytes, shape = _nbytes(m.group(2))
            if nbytes < min_bytes:
                continue
            name = m.group(1)
            op_name, source = origin(line)
            inserted = not op_name
            hint = ""
            if inserted:
                op_name, source = _nearest_named_op(graph, name, origin)
                selected = _selected_downstream(graph, name, nbytes, origin)
                hint = _HINT_SELECT if selected else _HINT_INSERTED
            out.append(
                LoopCopy(
                    computation=comp,
                    instruction=name,
                    shape=shape,
                    nbytes=nbytes,
                    op_name=op_name,
                    source=source,
                    loop=loop,
                    loop_source=loop_source,
                    inserted=inserted,
                    hint=hint,
                )
            )
    return out


_HINT_INSERTED = (
    "XLA inserted this copy; no JAX op produced it directly. It keeps the old value "
    "of the buffer alive past a write: a read of the buffer (before the write) that "
    "is used after it, or two edited versions of the buffer selected between "
    "(a `lax.cond`/`select` on the carry, jax#38145: write "
    "the branch with `jnp.where`)."
)
_HINT_SELECT = (
    "XLA inserted this copy; no JAX op produced it directly. The carried buffer "
    "goes through a select between two edited versions of it, so each edit works "
    "on its own copy: a `lax.cond` on the carry (which `vmap` turns into both "
    "branches and a select) or `jnp.where` between two edited buffers (jax#38145; "
    "the README's known limits): select the edit's index and values with `jnp.where` "
    "and edit the buffer once."
)
_HINT_OUT_OF_PLACE = (
    "this write also reads the buffer outside the written window, so XLA writes "
    "a whole new buffer each iteration (often a read at constant indices, which XLA "
    "turns into a static slice: pass the indices as traced arrays)."
)


# The opcode is the first word after a space that opens a parenthesis: not a
# tiled layout's `T(8,128)`, which follows a colon.
_SHAPE_OPCODE = re.compile(r"^(.*?)\s([\w\-]+)\(")
# HLO opcodes and JAX primitives that choose between whole arrays.
_CHOOSERS = ("select", "conditional", "select_n", "cond")


class _Graph:
    """The instructions of one computation, with their operands and users."""

    def __init__(self, lines: list[str]):
        self.lines: dict[str, str] = {}
        for line in lines:
            m = _INSTR.match(line)
            if m:
                self.lines[m.group(1)] = line
        self.operands: dict[str, list[str]] = {}
        self.users: dict[str, list[str]] = {n: [] for n in self.lines}
        for name, line in self.lines.items():
            rhs = line.split("=", 1)[1]
            # Callee names (`calls=%fused_computation`) are not instructions here.
            ops = [o for o in _OPERANDS.findall(rhs) if o in self.lines and o != name]
            self.operands[name] = ops
            for o in dict.fromkeys(ops):
                self.users[o].append(name)

    def opcode(self, name: str) -> tuple[str, str]:
        """`(shape text, opcode)` of an instruction."""
        rhs = _INSTR.match(self.lines[name])
        m = _SHAPE_OPCODE.match(rhs.group(2)) if rhs else None
        return (m.group(1), m.group(2)) if m else ("", "")


def _nearest_named_op(
    graph: _Graph, name: str, origin: Callable[[str], tuple[str, str]]
) -> tuple[str, str]:
    """`(op_name, source)` to attribute a copy with no metadata to, or `("", "")`.

    The nearest named instructions that consume the copy (walking users, through
    unnamed tuples, bitcasts and the like) and that produce its operand (walking
    operands): the write that needed the copy, preferably.
    """

    def nearest(step: Callable[[str], list[str]]) -> list[tuple[str, str]]:
        frontier, seen = [name], {name}
        while frontier:
            level = [o for n in frontier for o in step(n) if o not in seen]
            seen.update(level)
            named = [origin(graph.lines[o]) for o in dict.fromkeys(level)]
            named = [c for c in named if c[0]]
            if named:
                return named
            # Not through the loop's parameter: its other elements are other
            # carried values, unrelated to this one.
            frontier = [o for o in level if graph.opcode(o)[1] != "parameter"]
        return []

    candidates = nearest(graph.users.__getitem__) + nearest(graph.operands.__getitem__)
    # Last: `lax.scan`'s own stacking of per-step outputs, whose cached trace may
    # even carry the source line of another program.
    candidates.sort(key=lambda c: "index_in_dim" in c[0])
    # Prefer the write that needed the copy.
    writes = [c for c in candidates if "update_slice" in c[0] or "scatter" in c[0]]
    if not (writes or candidates):
        return "", ""
    op_name, source = (writes or candidates)[0]
    return f"(inserted by XLA for) {op_name}", source


def _selected_downstream(
    graph: _Graph, name: str, nbytes: int, origin: Callable[[str], tuple[str, str]]
) -> bool:
    """Whether a copy flows into a select or conditional of a buffer of its size."""
    stack, seen = [name], {name}
    while stack:
        for user in graph.users[stack.pop()]:
            if user in seen:
                continue
            seen.add(user)
            stack.append(user)
            shape, opcode = graph.opcode(user)
            # The op itself, or a fusion rooted at one (named after its JAX op).
            primitive = origin(graph.lines[user])[0].rsplit("/", 1)[-1]
            chooses = opcode in _CHOOSERS or primitive in _CHOOSERS
            if chooses and _nbytes(shape)[0] == nbytes:
                return True
    return False


def _traced(x: Any) -> bool:
    # What `eqx.filter_jit` traces (arrays), plus the abstract stand-ins that
    # `jax.jit(...).lower` accepts in their place.
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _jit_traceable(x: Any) -> bool:
    # What `jax.jit` traces: arrays and Python scalars (as weakly typed arrays).
    return eqx.is_array_like(x) or isinstance(x, jax.ShapeDtypeStruct)


def _is_leaf(x: Any) -> bool:
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def _compiled_text(fn: Callable, args: tuple, kwargs: dict) -> str:
    """The optimised HLO of `fn(*args, **kwargs)`, compiled as the user would run it.

    A `jax.jit` object is lowered as it is, so that its own `static_argnums`,
    donation and shardings hold. Anything else is called inside a `jax.jit` of a
    closure. Which arguments that closure traces follows what could run them:

    - a plain function whose arguments `jax.jit` accepts (arrays, Python scalars,
      `jax.ShapeDtypeStruct`s) is traced as `jax.jit(fn)` would trace it, as
      before Equinox support (a Python scalar is a traced, weakly typed array);
    - a function that is itself a pytree (an Equinox module or wrapper:
      `eqx.filter_jit`, `eqx.filter_grad`, `eqx.filter_value_and_grad`, a model,
      a `jax.tree_util.Partial`), or arguments holding leaves `jax.jit` rejects
      (an `eqx.nn.MLP`'s activation function, a string field), are split as
      `eqx.filter_jit` splits them: arrays (and `jax.ShapeDtypeStruct`s) are
      traced, every other leaf is a compile-time constant. The function's own
      array leaves are traced too, not baked in as constants that XLA could fold.

    An `eqx.filter_jit` wrapper is not unwrapped nor lowered through its own
    `.lower` (whose `Compiled` has no `as_text`): calling it inside `jax.jit` traces
    it as a nested jit, which XLA inlines, and relies only on its public call. Its
    donation does not apply then, which only changes copies outside the loops. The
    static leaves need not be hashable: the closure is built per call.
    """
    if isinstance(fn, (jax.stages.Compiled, jax.stages.Lowered)):
        # Already lowered or compiled (with its own shardings, mesh or options):
        # read as it is, not compiled again.
        if args or kwargs:
            raise TypeError(
                "`fn` is already lowered or compiled: pass no arguments with it; "
                f"got {len(args)} positional and {len(kwargs)} keyword arguments."
            )
        compiled = fn.compile() if isinstance(fn, jax.stages.Lowered) else fn
        return str(compiled.as_text())
    if isinstance(fn, jax.stages.Wrapped) and _is_leaf(fn):
        lowered = fn.lower(*args, **kwargs)
    else:
        as_jax_jit = _is_leaf(fn) and all(
            _jit_traceable(x) for x in jax.tree_util.tree_leaves((args, kwargs))
        )
        dynamic, static = eqx.partition(
            (fn, args, kwargs), _jit_traceable if as_jax_jit else _traced
        )

        def call(dynamic):
            f, a, k = eqx.combine(dynamic, static)
            # Non-array outputs (the `None`s and functions of a module's gradient)
            # cannot leave a `jax.jit`; they do not change the compiled loops.
            return eqx.filter(f(*a, **k), eqx.is_array)

        # The name prefixes every op name in the HLO metadata (`jit(<name>)/...`).
        call.__name__ = call.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
        lowered = jax.jit(call).lower(dynamic)
    return str(lowered.compile().as_text())


def find_loop_copies(
    fn: Callable, *args: Any, min_bytes: int = 1 << 16, **kwargs: Any
) -> list[LoopCopy]:
    """Compile `fn(*args, **kwargs)` and list the copies that run on every loop iteration.

    A copy of a loop-carried buffer inside a `while` body (what `lax.scan`,
    `lax.fori_loop` and `esb.scan` compile to), or inside a computation such a body
    calls, means XLA could not update that buffer in place: every iteration pays for
    the whole buffer. This finds `copy` and `copy-start` instructions of at least
    `min_bytes` in loop bodies, after XLA's optimisations, and fusions that write
    such a buffer with `dynamic-update-slice` but cannot do it in place (inside the
    fusion, the buffer is also read other than by a `dynamic-slice` at the write's
    indices), which rewrite the whole buffer with no `copy` to show for it. Those
    are reported with `op_name` starting `"(out-of-place write)"`.

    **Arguments:**

    - `fn`: what you call: a plain function, a `jax.jit` or `eqx.filter_jit` one, an
      `eqx.filter_grad`/`eqx.filter_value_and_grad` wrapper (with or without an
      outer `eqx.filter_jit`), or an Equinox module. A `jax.jit` object is compiled
      as it is (its `static_argnums` hold); anything else inside a `jax.jit`. Or
      what `jax.jit(f).lower(...)` or its `.compile()` returned, with no
      arguments: its program as it is (its shardings and mesh included).
    - `*args`, `**kwargs`: what to call it with: pytrees of arrays or
      `jax.ShapeDtypeStruct`s, which may hold other leaves (an `eqx.nn.MLP`'s
      activation, ints, strings). If they do, or if `fn` is an Equinox module or
      wrapper, they are split as `eqx.filter_jit` splits them: arrays are traced,
      all else (Python scalars included) is a compile-time constant. Otherwise they
      are traced as `jax.jit(fn)` traces them (a Python scalar is a traced array).
      The results may hold non-array leaves too.
    - `min_bytes`: ignore smaller copies (default 64 KiB). Choose it below the size of
      the buffer you care about and above the size of a window.

    **Returns:**

    A list of [`eqx_shiftbuf.LoopCopy`][]: shape, bytes, the JAX op name and source
    line recorded in the HLO metadata. Empty when every loop updates in place.
    """
    return loop_copies_in_hlo(_compiled_text(fn, args, kwargs), min_bytes)


def assert_in_place(
    fn: Callable, *args: Any, min_bytes: int = 1 << 16, **kwargs: Any
) -> None:
    """Raise `AssertionError` if `fn(*args, **kwargs)` copies a buffer in a loop.

    **Arguments:** as for [`eqx_shiftbuf.find_loop_copies`][].

    **Returns:** nothing. The error lists every copy found, one per line.
    """
    copies = find_loop_copies(fn, *args, min_bytes=min_bytes, **kwargs)
    if copies:
        lines = "\n".join(f"  - {c}" for c in copies)
        raise AssertionError(
            f"{len(copies)} per-iteration copies of arrays of at least {min_bytes} "
            f"bytes in the compiled loops of {getattr(fn, '__name__', fn)!r}:\n{lines}"
        )
