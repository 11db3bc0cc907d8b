"""The documentation site builds with no warning, and everything it shows runs.

- `mkdocs build --strict` (in a subprocess, as a reader would run it) passes. A
  full build runs every program a page names in a `<!-- run: ... -->` line (the
  tutorials, `docs/examples/`) and shows what it printed (see `docs/_hooks.py`);
  here the programs run at their small size, in two processes of their own, and a
  check per program tests the values it returns (the claims its page makes).
- Every public name, and every public member of the public classes, has an entry
  in the API reference.
- Every `python` code block of `docs/*.md` runs, in order, one namespace per page,
  with JAX's default 32-bit types (as a reader runs them). Blocks that include a
  file (`--8<--`) show code that the build ran.

Needs the `docs` extra (`pip install -e ".[dev,docs]"`); skipped without it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import equinox as eqx
import jax
import pytest

import eqx_shiftbuf as esb


ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

needs_mkdocs = pytest.mark.skipif(
    not all(
        importlib.util.find_spec(m)
        for m in ("mkdocs", "material", "mkdocstrings", "optax")
    ),
    reason="the docs extra is not installed: pip install -e '.[dev,docs]'",
)


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """`(line, code)` of each ```python block of `page` that is not an include."""
    text = page.read_text()
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        if "--8<--" not in m.group(1):
            blocks.append((text.count("\n", 0, m.start()) + 2, m.group(1)))
    return blocks


def public_members(cls) -> set[str]:
    base = set(dir(eqx.Module if issubclass(cls, eqx.Module) else object))
    names = {n for n in set(dir(cls)) - base if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    return names


@needs_mkdocs
def test_site_builds_strict_with_every_public_name(tmp_path):
    # The programs the pages name run in `test_program_runs`: here the build
    # shows a placeholder.
    site = tmp_path / "site"
    env = dict(
        os.environ,
        ESB_DOCS_SIZE="none",
        NO_MKDOCS_2_WARNING="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
           str(ROOT / "mkdocs.yml"), "-d", str(site)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr

    # The API reference documents every public name and member.
    html = "".join(p.read_text() for p in (site / "api").rglob("*.html"))
    # Not submodules (`eqx_shiftbuf.demo` is an attribute once another test
    # imported it): the public names are those `__init__` exports.
    names = {
        n
        for n in dir(esb)
        if not n.startswith("_") and not isinstance(getattr(esb, n), types.ModuleType)
    }
    missing = sorted(n for n in names if f'id="eqx_shiftbuf.{n}"' not in html)
    for cls in (esb.ShiftBuffer, esb.WriteOnceBuffer, esb.LoopCopy):
        missing += sorted(
            f"{cls.__name__}.{m}"
            for m in public_members(cls)
            if f'id="eqx_shiftbuf.{cls.__name__}.{m}"' not in html
        )
    assert not missing, f"not in the API reference: {missing}"

    # Every `<!-- run: ... -->` was replaced.
    for page in site.rglob("*.html"):
        assert "<!-- run:" not in page.read_text(), page


PROGRAMS = {
    "sorted_rows": "docs/tutorials/sorted_rows.py",
    "streaming_conv": "docs/tutorials/streaming_conv.py",
    "kv_cache": "docs/tutorials/kv_cache.py",
    "stack_rnn": "docs/tutorials/stack_rnn.py",
    "eqx_scan": "docs/tutorials/eqx_scan.py",
    "copying_step": "docs/examples/copying_step.py",
    "layout": "docs/examples/layout.py",
}


def test_every_program_a_page_runs_is_tested():
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"^<!-- run: (\S+) -->$", page.read_text(), re.M))
    assert named == set(PROGRAMS.values())


def _check_sorted_rows(r):
    lax_, lib = r["plain lax"], r["eqx_shiftbuf"]
    assert r["agree"]
    assert lib["fwd_copies"] == 0 and lib["grad_copies"] == 0, lib
    assert lax_["grad_copies"] >= 1, lax_


def _check_eqx_scan(r):
    eq, new = r["equinox"], r["esb.scan"]
    assert new["grad_w_err"] < 1e-5 and new["grad_hs0_err"] < 1e-5, new
    assert eq["grad_w_err"] < 1e-5 and eq["grad_hs0_err"] > 0.1, eq
    assert new["jvp"] == pytest.approx(r["lax.scan"]["jvp"], rel=1e-5)
    assert "custom_vjp" in eq["jvp"], eq["jvp"]
    assert not eq["double_write_err"] < 1, eq  # large, or NaN
    assert "a second write to a buffer position" in new["double_write"], new


def _check_copying_step(r):
    assert len(r["step_unordered"]) >= 1 and r["step_ordered"] == []


def _check_streaming_conv(conv):
    assert conv["buffers_in_params"] == 0 and conv["buffers_in_state"] == 2, conv
    assert conv["state_unchanged"], conv
    assert conv["loss_last"] < conv["loss_first"], conv
    assert conv["stream_vs_whole"] == 0 and conv["stream_vs_reference"] < 1e-4, conv
    assert conv["grad_copies"] == 0, conv  # a delay line is a ring


def _check_kv_cache(kv):
    assert kv["grad_copies"] == 0 and kv["memory_ratio"] < 0.6, kv
    assert kv["accuracy"] > 0.5, kv  # chance is 1 / vocabulary


def _check_stack_rnn(stack):
    for kind in ("pointer", "shift"):
        assert stack[kind]["grad_copies"] == 0, stack
        assert stack[kind]["accuracy"] > 0.5, stack
    # The data-parallel step: `tests/test_sharding.py` runs it on 4 devices.


def _check_layout(layout):
    for name, r in layout["models"].items():
        assert r["memory_ratio"] < 1, (name, r)
    for name, r in layout["delay"].items():
        assert r["copies"] == 0, (name, r)


# The programs in two processes of their own, each program after
# `jax.clear_caches()` as the build's hook runs them (`docs/_hooks.py`): a process
# per program paid JAX's start-up and first compile seven times over. The layout
# example re-runs the tutorials' models to compare layouts: `pytest --full` runs it
# (tests/tiers.py).
PROGRAM_GROUPS = [
    ("stack_rnn", "kv_cache", "sorted_rows", "copying_step"),
    ("streaming_conv", "eqx_scan"),
    ("layout",),
]
PROGRAM_CASES = [
    pytest.param(g, marks=pytest.mark.full) if g == ("layout",) else g
    for g in PROGRAM_GROUPS
]

_RUNNER = """\
import importlib.util, json, pathlib, sys, traceback
import jax
out = pathlib.Path(sys.argv[1])
for name, path in json.loads(sys.argv[2]).items():
    jax.clear_caches()
    try:
        spec = importlib.util.spec_from_file_location("prog_" + name, path)
        m = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = m
        spec.loader.exec_module(m)
        result = json.dumps(m.main(size="small"), default=str)
    except BaseException:
        (out / (name + ".error")).write_text(traceback.format_exc())
    else:
        (out / (name + ".json")).write_text(result)
"""


def test_program_groups_cover_every_program():
    names = [n for group in PROGRAM_GROUPS for n in group]
    assert sorted(names) == sorted(PROGRAMS)


@pytest.mark.heavy
@needs_mkdocs
@pytest.mark.parametrize("names", PROGRAM_CASES, ids="+".join)
def test_program_runs(names, tmp_path):
    """Each program runs at its small size, in a process without this one's state
    (JAX's default 32-bit types, fresh caches), and returns what its page says.
    A failure names the program, and the others are still run and checked."""
    paths = {name: str(ROOT / PROGRAMS[name]) for name in names}
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path), json.dumps(paths)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    failures = {}
    for name in names:
        result, error = tmp_path / f"{name}.json", tmp_path / f"{name}.error"
        if error.exists():
            failures[name] = error.read_text()
        elif not result.exists():  # the process died in or before this program
            failures[name] = f"no result (exit {proc.returncode}):\n{proc.stderr}"
        else:
            try:
                globals()[f"_check_{name}"](json.loads(result.read_text()))
            except AssertionError as e:
                failures[name] = f"{type(e).__name__}: {e}"
    assert not failures, "\n\n".join(f"{n}: {m}" for n, m in failures.items())


def _tutorial(name: str):
    spec = importlib.util.spec_from_file_location(
        f"_test_docs_{name}", DOCS / "tutorials" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (Equinox modules) look it up
    spec.loader.exec_module(module)
    return module


def _buffers(tree) -> int:
    is_buffer = lambda x: isinstance(x, esb.ShiftBuffer)
    return sum(map(is_buffer, jax.tree.leaves(tree, is_leaf=is_buffer)))


@needs_mkdocs
def test_tutorials_train_no_buffer():
    """What each tutorial gives optax (its model's inexact arrays) holds no
    `ShiftBuffer`, and the buffers it uses are ShiftBuffers (so the check is not
    vacuous): in the state (tutorial 2), made by the loss (3), an argument (4).

    Only the pytrees' structure matters: the models are built (and the gradient
    taken) under `eqx.filter_eval_shape`, traced and never compiled or run."""
    conv = _tutorial("streaming_conv")

    def tcn():
        model, state = eqx.nn.make_with_state(conv.TCN)(3, 2, 4, key=jax.random.key(0))
        x = jax.numpy.ones((5, 2))
        grads = eqx.filter_grad(conv.loss)(model, state, x, x)
        return eqx.filter(model, eqx.is_inexact_array), state, grads

    trained, state, grads = eqx.filter_eval_shape(tcn)
    assert _buffers(trained) == 0
    assert _buffers(state) == 2
    assert _buffers(grads) == 0

    kv = _tutorial("kv_cache")

    def decoder():
        model = kv.Decoder(4, 6, 8, key=jax.random.key(0))
        return eqx.filter(model, eqx.is_inexact_array), model.empty_cache(2)

    trained, cache = eqx.filter_eval_shape(decoder)
    assert _buffers(trained) == 0
    assert _buffers(cache) == 1

    rnn = _tutorial("stack_rnn")

    def stack_rnn():
        model = rnn.StackRNN(4, 8, key=jax.random.key(0))
        return eqx.filter(model, eqx.is_inexact_array)

    assert _buffers(eqx.filter_eval_shape(stack_rnn)) == 0
    assert _buffers(rnn.PointerStack.empty(3, 8)) == 1
    assert _buffers(rnn.ShiftStack.empty(3, 8)) == 1


# Pages whose code runs on several devices.
SEVERAL_DEVICES = {"sharding.md"}


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if python_blocks(p)],
    ids=lambda p: str(p.relative_to(DOCS)),
)
def test_code_blocks_run(page, tmp_path):
    if page.name in SEVERAL_DEVICES:
        # JAX has its devices in this process already: run the page in a process
        # of its own, with 4 CPU devices.
        script = tmp_path / "page.py"
        script.write_text("\n\n".join(code for _, code in python_blocks(page)))
        env = dict(
            os.environ,
            XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
            + " --xla_force_host_platform_device_count=4",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    with jax.enable_x64(False):
        for line, code in python_blocks(page):
            # Padded so that a traceback names the page's own line numbers.
            source = "\n" * (line - 1) + code
            exec(compile(source, str(page), "exec"), namespace)
