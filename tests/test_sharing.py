"""monai_cache.sharing: whether a computed item may go on to the random transforms without a copy."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from monai.data import MetaTensor

from monai_cache.sharing import make_private

pytestmark = pytest.mark.dropin  # the probes depend on how MetaTensor makes its tensors

KEPT_TENSOR = torch.zeros(3)
KEPT_ARRAY = np.zeros(3, np.float32)
KEPT_LIST = [torch.zeros(2)]


def fresh() -> dict:
    """What a chain of MONAI's transforms computes: new tensors, arrays and containers, and immutable leaves."""
    image = MetaTensor(torch.zeros(1, 4, 4), affine=torch.eye(4))
    image.meta["filename_or_obj"] = "a.nii.gz"
    return {
        "image": image,
        "label": torch.ones(1, 4, 4, dtype=torch.uint8),
        "boxes": [np.zeros((2, 4)), (torch.zeros(2), 3)],
        "case": 7, "path": pathlib.Path("a"), "spacing": 1.5, "name": "a", "none": None,
    }  # fmt: skip


def test_a_freshly_computed_item_is_handed_on_as_it_is():
    item = fresh()
    before = {k: id(v) for k, v in item.items()}
    assert make_private(item) is item
    assert {k: id(v) for k, v in item.items()} == before  # nothing copied
    assert make_private({}) == {}


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda: KEPT_TENSOR, id="a kept tensor"),
        pytest.param(lambda: KEPT_TENSOR[:2], id="a view of a kept tensor"),
        pytest.param(lambda: MetaTensor(KEPT_TENSOR), id="a MetaTensor over a kept tensor's memory"),
        pytest.param(lambda: KEPT_ARRAY, id="a kept array"),
        pytest.param(lambda: KEPT_LIST, id="a kept list"),
        pytest.param(lambda: [KEPT_LIST[0]], id="a new list of a kept tensor"),
        pytest.param(lambda: (KEPT_TENSOR, 1), id="a new tuple of a kept tensor"),
        pytest.param(lambda: (torch.as_tensor(KEPT_ARRAY),), id="a tuple of a tensor over an array's memory"),
        pytest.param(lambda: bytearray(3), id="an object of another type"),
    ],
)
def test_what_something_else_holds_is_left_to_the_caller_to_copy(value):
    item = fresh()
    item["extra"] = value()
    extra = item["extra"]
    assert make_private(item) is None
    assert item["extra"] is extra  # left as it was
    del item["extra"], extra
    assert make_private(item) is item  # the rest of the item did not change the answer


@pytest.mark.parametrize("where", ["dict", "list"])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.as_tensor(KEPT_ARRAY), id="a tensor over a kept array's memory"),
        pytest.param(
            lambda: MetaTensor(torch.as_tensor(KEPT_ARRAY), meta={"k": 1}), id="a MetaTensor over a kept array's memory"
        ),
        pytest.param(lambda: KEPT_ARRAY[1:], id="an array that is a view"),
    ],
)
def test_memory_that_cannot_be_vouched_for_is_copied_in_place(make, where):
    item = fresh()
    value = make()
    if where == "dict":
        item["extra"] = value
    else:
        item["boxes"].append(value)
    del value
    assert make_private(item) is item
    copy = item["extra"] if where == "dict" else item["boxes"][-1]
    assert type(copy) is type(make())
    assert copy.dtype == make().dtype and copy.shape == make().shape and np.array_equal(np.asarray(copy), make())
    if isinstance(copy, MetaTensor):
        assert copy.meta["k"] == 1
        assert copy.stride() == make().stride()
    copy += 5  # a random transform writing into its input
    assert not KEPT_ARRAY.any()


def test_the_same_tensor_twice_in_an_item_is_not_told_apart_from_a_kept_one():
    """Counted conservatively: a tensor twice in the item has two holders (the copy the caller makes then keeps
    it once, as a decode does)."""
    item = fresh()
    item["again"] = item["label"]
    assert make_private(item) is None


def test_nesting_deeper_than_eight_levels_is_not_told():
    item: dict = {"leaf": torch.zeros(1)}
    for _ in range(9):
        item = {"nested": item}
    assert make_private(item) is None
    assert make_private(item["nested"]["nested"]) is not None


def test_an_item_that_is_a_tensor_is_checked_for_its_memory():
    """Array transforms return a tensor: as it is when torch allocated its memory and no other tensor holds it, a
    copy over memory torch did not allocate, None for a view of another tensor."""
    fresh_tensor = MetaTensor(torch.zeros(2, 3))
    assert make_private(fresh_tensor) is fresh_tensor
    over_array = MetaTensor(torch.as_tensor(KEPT_ARRAY), meta={"k": 1})
    copy = make_private(over_array)
    assert type(copy) is MetaTensor and copy is not over_array and copy.meta["k"] == 1
    copy += 1
    assert not KEPT_ARRAY.any()
    assert make_private(KEPT_TENSOR[:2]) is None
    assert make_private("a path") == "a path"
    assert make_private(bytearray(2)) is None
