"""Exact, in-place buffer editing inside JAX loops, under `grad`, `jvp` and `vmap`."""

from ._buffer import ShiftBuffer as ShiftBuffer
from ._functions import (
    delete as delete,
    dynamic_slice as dynamic_slice,
    dynamic_update_slice as dynamic_update_slice,
    insert as insert,
    pop as pop,
    read as read,
)
from ._inspect import (
    assert_in_place as assert_in_place,
    find_loop_copies as find_loop_copies,
    LoopCopy as LoopCopy,
)
from ._scan import scan as scan
from ._writeonce import WriteOnceBuffer as WriteOnceBuffer


__version__ = "0.1.0"
