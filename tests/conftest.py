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


def pytest_collection_modifyitems(config, items):
    """Run the `heavy` tests first.

    xdist hands the tests out in collection order (after the `xdist_group`s, which
    go first, the largest first): a 20-second test collected last leaves the other
    worker idle while it runs alone. Every worker collects, and sorts, the same."""
    del config
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
