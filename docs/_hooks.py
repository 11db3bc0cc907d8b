"""MkDocs hook: run the documentation's example programs at build time.

A page that contains the line

    <!-- run: docs/tutorials/sorted_rows.py -->

gets, in its place, what that file's `main(size)` printed, in a text block, with
a note saying which size ran and on what. So every number shown in the site comes
from a run of the code shown next to it, in this build.

- `ESB_DOCS_SIZE` (environment): the size passed to `main`, "full" (default: the
  realistic sizes, a few minutes in all) or "small"; or "none": run nothing, and
  show a placeholder (what the tests build: they run each program on its own).
- `ESB_DOCS_RESULTS` (environment, optional): a folder; the value each `main`
  returns is written there as JSON (`<file stem>.json`), for tests to check.

Each file runs once per build, in this process (after `jax.clear_caches()`), with
the repository root first on `sys.path` (so the checkout's `eqx_shiftbuf` is the
one documented and run).
An exception in a program fails the build.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import pathlib
import re
import sys
import time


_RUN = re.compile(r"^<!-- run: (\S+) -->$", re.M)
_outputs: dict[str, str] = {}


def _root(config) -> pathlib.Path:
    return pathlib.Path(config.config_file_path).resolve().parent


def _run(path: str, root: pathlib.Path) -> str:
    if path in _outputs:
        return _outputs[path]
    size = os.environ.get("ESB_DOCS_SIZE", "full")
    if size == "none":
        return f"*(`{path}` prints its results here in a full build.)*\n"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    file = root / path
    name = "_esb_docs_" + re.sub(r"\W", "_", path)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    # Registered, as an import would: dataclasses (Equinox modules) look it up.
    sys.modules[name] = module
    import jax

    # As in a process of its own: JAX caches traces of inner `jit`s (the scan's
    # output stacking, say) by shape, with the source lines of the program that
    # traced them first, and `find_loop_copies` would name those lines.
    jax.clear_caches()
    buf = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        spec.loader.exec_module(module)
        result = module.main(size=size)
    seconds = time.perf_counter() - start
    results = os.environ.get("ESB_DOCS_RESULTS")
    if results:
        out = pathlib.Path(results) / f"{file.stem}.json"
        out.write_text(json.dumps(result, indent=1, default=str))

    # Paths in the output (source lines named by find_loop_copies) are shown
    # relative to the repository.
    text = buf.getvalue().replace(str(root) + os.sep, "").rstrip()
    note = (
        f"Printed by `python {path} --size {size}` when this site was built "
        f"({seconds:.0f} s; jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs)."
    )
    _outputs[path] = f"```text\n{text}\n```\n\n<small>{note}</small>\n"
    return _outputs[path]


# Files outside docs/ that pages show: (path in the site, path in the repository).
_EXTRA_FILES = [("benchmarks/grad_vs_rows.png", "benchmarks/grad_vs_rows.png")]


def on_files(files, config):
    from mkdocs.structure.files import File

    root = _root(config)
    for uri, path in _EXTRA_FILES:
        files.append(File.generated(config, uri, abs_src_path=str(root / path)))
    return files


def on_pre_build(config):
    _outputs.clear()  # `mkdocs serve` reruns the programs on each rebuild


def on_page_markdown(markdown, page, config, files):
    root = _root(config)
    return _RUN.sub(lambda m: _run(m.group(1), root), markdown)
