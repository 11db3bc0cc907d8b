import os


# The suite checks compiled HLO (copies, collectives) and values, not the speed of
# the machine code: LLVM at -O0 leaves XLA's HLO passes (copy insertion, buffer
# assignment, fusion) as they are and compiles about a third faster, and the suite
# is mostly compiles. Set before JAX starts its backend; subprocesses inherit it.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
).strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402


jax.config.update("jax_enable_x64", True)

hypothesis.settings.register_profile(
    "default", deadline=None, print_blob=True, derandomize=False
)
hypothesis.settings.register_profile("ci", deadline=None, print_blob=True)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=bool(os.environ.get("ESB_FULL_TESTS")),
        help="run every case of every parametrised test, and the tests marked "
        "`full` (also ESB_FULL_TESTS=1); without it, a product of parameters runs "
        "a cover of its values",
    )


def pytest_configure(config):
    if config.getoption("full"):
        # For `tests/tiers.py`, read when the test modules are imported (in each
        # xdist worker too, which parses the same options).
        os.environ["ESB_FULL_TESTS"] = "1"


def _value(value):
    try:
        hash(value)
    except TypeError:
        return id(value)  # the same object in every case of one parametrisation
    return value


def _axes(item) -> list[tuple[str, ...]]:
    """The parameters of `item`, one tuple for each `parametrize` that names them."""
    axes = []
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        axes.append(tuple(names))
    named = {n for axis in axes for n in axis}
    return axes + [(n,) for n in item.callspec.params if n not in named]


# A list of more cases than this (the dtypes of a bit-exact read, the corpus
# bodies, the natural rows by mode) runs every other case in the quick run.
LONG_LIST = 8


def covering_cases(items):
    """The cases of one test function that the quick run keeps: a greedy cover of
    the values of each `parametrize` in a product of them.

    The parameters one `parametrize` names together are one axis (a curated list
    of `(row, mode)` pairs is one axis, each pair a value). A test of one axis
    keeps every case, or every other case of a list longer than `LONG_LIST`; a
    product of axes (edits by layouts by dtypes) keeps about as many cases as its
    longest axis, each value of each axis in at least one case. `--full` runs
    every case. Deterministic (ties go to the first case collected), so every
    xdist worker keeps the same."""
    axes = _axes(items[0])
    if len(axes) == 1 and len(items) > LONG_LIST:
        return {id(item) for item in items[::2]}
    values = [
        {
            (k, tuple(_value(item.callspec.params[n]) for n in axis))
            for k, axis in enumerate(axes)
        }
        for item in items
    ]
    uncovered = set().union(*values)
    kept = []
    while uncovered:
        best = max(range(len(items)), key=lambda i: len(values[i] & uncovered))
        kept.append(best)
        uncovered -= values[best]
    return {id(items[i]) for i in kept}


def pytest_collection_modifyitems(config, items):
    """Without `--full`, leave out the `full` cases and thin products of
    parameters to a cover of their values; then run the `heavy` tests first.

    xdist hands the tests out in collection order (after the `xdist_group`s, which
    go first, the largest first): a 20-second test collected last leaves the other
    worker idle while it runs alone. Every worker collects, and sorts, the same."""
    if not config.getoption("full"):
        marked = [i for i in items if i.get_closest_marker("full") is not None]
        if marked:
            config.hook.pytest_deselected(items=marked)
            items[:] = [i for i in items if i.get_closest_marker("full") is None]
        groups = {}
        for item in items:
            if hasattr(item, "callspec"):
                groups.setdefault(item.nodeid.split("[")[0], []).append(item)
        kept = set()
        for group in groups.values():
            kept |= covering_cases(group)
        dropped = [i for i in items if hasattr(i, "callspec") and id(i) not in kept]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [i for i in items if not hasattr(i, "callspec") or id(i) in kept]
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
