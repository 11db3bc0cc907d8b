"""How much of each check a test run makes.

`pytest` is the quick run that CI makes on every change: every test function, but
of a product of parameters a cover of its values and of a list of more than
`conftest.LONG_LIST` cases every other one (`tests/conftest.py`), not the cases
marked `full`, and an eighth of the examples of each hypothesis test. `pytest
--full` (or `ESB_FULL_TESTS=1`) makes every check: run it before a release and
after a change to the lowering. This is JAX's own split between the cases every
CI run samples (`JAX_NUM_GENERATED_CASES`) and the full product.
"""

import os


FULL = bool(os.environ.get("ESB_FULL_TESTS"))


def examples(n: int) -> int:
    """The hypothesis examples a test of `n` examples draws in this run."""
    return n if FULL else max(2, n // 8)
