"""Which carry leaves a checkpointed `esb.scan` records instead of storing.

`esb.scan` decides per buffer (`eqx_shiftbuf/_tape.py`): a test of the recorded
path asserts it was taken, since a small buffer, or a large record, is stored.
"""

from __future__ import annotations

import jax

from eqx_shiftbuf._writeonce import TAPED


def taped_leaves(fn, *args) -> list[int]:
    """The flat carry leaves that the checkpointed scan in `fn`'s derivative (its
    one `esb_scan` equation that stores carries) records instead of storing."""
    eqns = [
        e
        for e in jax.make_jaxpr(fn)(*args).eqns
        if e.primitive.name == "esb_scan" and e.params["save"]
    ]
    assert len(eqns) == 1, eqns
    return [k for k, r in enumerate(eqns[0].params["roles"]) if r == TAPED]
