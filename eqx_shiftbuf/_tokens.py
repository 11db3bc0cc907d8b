"""Trace-time record of the pending read token of each storage value.

A read of a buffer must be ordered before the next write to it (DESIGN.md rule 5).
The primitives do this with a token: each read returns an opaque run-time zero that
the next access adds to its loop's trip count. The token travels beside the storage
value without changing the public API: this module maps a storage value (a tracer,
or any array) to `(its replacement, token)`, where the replacement is the storage
output of the last read. Entries hold the key only weakly, so a finished trace
leaves nothing behind.
"""

from __future__ import annotations

import weakref
from typing import Any


_pending: dict[int, tuple[weakref.ReferenceType, Any, Any]] = {}


def record(storage: Any, tok: Any, replacement: Any = None) -> None:
    """Say that `storage` (or `replacement`, if given) has a pending read token."""
    try:
        ref = weakref.ref(storage, lambda _, k=id(storage), d=_pending: d.pop(k, None))
    except TypeError:  # not weak-referenceable (a Python scalar, say): nothing to order
        return
    _pending[id(storage)] = (ref, storage if replacement is None else replacement, tok)


def resolve(storage: Any, tok: Any) -> tuple[Any, Any]:
    """The storage value to use for the next access on `storage`, and its token.

    The recorded token, if any, is added to `tok`.
    """
    entry = _pending.get(id(storage))
    if entry is None or entry[0]() is not storage:
        return storage, tok
    _, replacement, pending = entry
    return replacement, pending if tok is None else tok + pending


def same_trace(a: Any, b: Any) -> bool:
    """Whether `a` and `b` are tracers of one and the same trace."""
    ta = getattr(a, "_trace", None)
    return ta is not None and ta is getattr(b, "_trace", None)


# Storage values that are the output of a straight-line write (see
# `_primitives._shift`): the next batched shift or accumulation of such a value (or
# one that cannot use a 2-line window) reads its lines in a loop first.
_written: dict[int, weakref.ReferenceType] = {}


def mark_written(storage: Any) -> None:
    """Say that `storage` is the output of a straight-line write."""
    try:
        ref = weakref.ref(storage, lambda _, k=id(storage), d=_written: d.pop(k, None))
    except TypeError:
        return
    _written[id(storage)] = ref


def written(storage: Any) -> bool:
    """Whether `storage` is the output of a straight-line write of this process."""
    ref = _written.get(id(storage))
    return ref is not None and ref() is storage
