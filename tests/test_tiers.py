"""The quick run's choice of cases (`tests/conftest.py`): every value of every
`parametrize` in some case, every case of a single list."""

import pytest

from .conftest import covering_cases, LONG_LIST


class _Callspec:
    def __init__(self, params):
        self.params = params


class _Item:
    """What `covering_cases` reads of a collected test: its parameters, and the
    `parametrize` marks that named them."""

    def __init__(self, marks, params):
        self._marks = [pytest.mark.parametrize(*m).mark for m in marks]
        self.callspec = _Callspec(params)

    def iter_markers(self, name):
        return iter(self._marks if name == "parametrize" else [])


def _kept(items):
    ids = covering_cases(items)
    return [i.callspec.params for i in items if id(i) in ids]


def test_a_product_keeps_each_value_of_each_axis_in_about_its_longest_axis():
    ops, layouts = ["insert", "delete", "pop"], [((7,), 0), ((2, 5), 1)]
    marks = [("op", ops), ("shape, axis", layouts)]
    items = [
        _Item(marks, {"op": op, "shape": shape, "axis": axis})
        for op in ops
        for shape, axis in layouts
    ]
    kept = _kept(items)
    assert len(kept) == len(ops)
    assert {k["op"] for k in kept} == set(ops)
    assert {(k["shape"], k["axis"]) for k in kept} == set(layouts)


def test_a_list_of_tuples_of_parameters_keeps_every_case():
    pairs = [("a", "fwd"), ("a", "grad"), ("b", "fwd"), ("b", "jvp")]
    marks = [("row, mode", pairs)]
    items = [_Item(marks, {"row": r, "mode": m}) for r, m in pairs]
    assert len(_kept(items)) == len(pairs)


def test_the_choice_does_not_depend_on_object_identity_of_equal_values():
    # Each worker collects its own objects: equal values are one value.
    marks = [("n", [1, 2]), ("s", [("x",), ("y",)])]
    items = [_Item(marks, {"n": n, "s": tuple([s])}) for n in (1, 2) for s in "xy"]
    assert _kept(items) == [{"n": 1, "s": ("x",)}, {"n": 2, "s": ("y",)}]


def test_a_long_list_keeps_every_other_case_from_the_first():
    n = LONG_LIST + 3
    items = [_Item([("k", list(range(n)))], {"k": k}) for k in range(n)]
    assert [k["k"] for k in _kept(items)] == list(range(0, n, 2))
