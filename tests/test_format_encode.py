"""``encode_header`` writes a header by column (each kind's text once, one join of every entry's
pieces, the layout's records by ``by_columns``): byte for byte what ``json.dumps`` of one object of
every entry writes (``_encode_by_object``, the reference), with the same layout and the same
errors, on names that need escapes, shared and unshared shape objects, more distinct shapes than
the per-object cache takes, and dimensions that are not plain ints. That the reference is what
safetensors writes is test_format_header.py's and test_plan.py's golden tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.format import dtypes as dt
from ckptctl.format import encode as H
from ckptctl.format.header import TensorInfo, layout_order
from ckptctl.format.tensor import TensorSpec, by_columns

_names = st.text(st.sampled_from('ab."\\\n\x00\x1f\u00e9\u4e2d\U0001f600 '), min_size=0, max_size=6)
_dtypes = st.sampled_from([d.name for d in dt.DTYPES])
_shapes = st.lists(st.integers(1, 5), max_size=3).map(tuple)
_metadata = st.one_of(st.none(), st.dictionaries(_names, _names, max_size=3))


def _both(specs: list[TensorSpec], metadata, extra_pad: int = 0):
    ordered = layout_order(specs)
    return H._encode(ordered, metadata, extra_pad), H._encode_by_object(ordered, metadata, extra_pad)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_names, st.tuples(_dtypes, _shapes), max_size=12), _metadata,
       st.sampled_from([0, 8, 4096]), st.booleans())
def test_the_columns_write_the_bytes_json_dumps_writes(tensors, metadata, extra_pad, share):
    """Every name (quotes, backslashes, control characters, non-ASCII), dtype (sub-byte ones
    too) and shape; shape objects shared between specs of one kind or each its own."""
    pool: dict[tuple, tuple] = {}
    specs = [TensorSpec(n, d, pool.setdefault(s, s) if share else tuple(list(s))) for n, (d, s) in tensors.items()]
    (blob, infos), (ref_blob, ref_infos) = _both(specs, metadata, extra_pad)
    assert blob == ref_blob
    assert infos == ref_infos


def test_more_shapes_than_the_object_cache_takes_are_looked_up_by_value() -> None:
    specs = [TensorSpec(f"t{i}", "F32" if i % 2 else "BF16", (i % 5000 + 1, 2)) for i in range(H._KINDS_BY_ID * 2)]
    (blob, infos), (ref_blob, ref_infos) = _both(specs, {"format": "pt"})
    assert blob == ref_blob and infos == ref_infos


def test_a_dimension_that_is_not_an_int_is_written_as_json_dumps_writes_it() -> None:
    """``True == 1`` as a key: among many distinct shapes, the reference writes such a header."""
    specs = [TensorSpec(f"t{i}", "U8", (i + 1,)) for i in range(H._KINDS_BY_ID + 1)]
    specs.append(TensorSpec("odd", "U8", (True, 2)))
    (blob, _), (ref_blob, _) = _both(specs, None)
    assert blob == ref_blob and b'"odd":{"dtype":"U8","shape":[true,2]' in blob


@pytest.mark.parametrize("specs, message", [
    ([TensorSpec("a", "F32", (1,)), TensorSpec("a", "F16", (1,))], "duplicate tensor name 'a'"),
    ([TensorSpec("__metadata__", "F32", (1,))], "cannot be named '__metadata__'"),
])
def test_the_same_names_are_refused(specs, message) -> None:
    for encode in (H._encode, H._encode_by_object):
        with pytest.raises(ValueError, match=message):
            encode(layout_order(specs), None, 0)


def test_a_spec_like_record_with_a_list_shape_is_written_as_a_spec() -> None:
    class Loose:
        def __init__(self, name, dtype, shape):
            self.name, self.dtype, self.shape = name, dtype, shape

        @property
        def nbytes(self):
            return TensorSpec(self.name, self.dtype, tuple(self.shape)).nbytes

    specs = [Loose("b", "F32", [2, 3]), Loose("a", "I8", [4])]
    (blob, infos), (ref_blob, ref_infos) = _both(specs, {"format": "pt"})  # type: ignore[arg-type]
    assert blob == ref_blob and infos == ref_infos
    assert all(type(i.spec) is TensorSpec for i in infos)


def test_layout_order_is_rank_then_name() -> None:
    specs = [TensorSpec(n, d, (1,)) for n, d in [("b", "F32"), ("a", "BF16"), ("c", "F32"), ("a2", "F64"), ("z", "U8")]]
    assert layout_order(specs) == sorted(specs, key=lambda s: (-dt.RANK[s.dtype], s.name))


def test_by_columns_makes_what_the_constructor_makes() -> None:
    specs = [TensorSpec("a", "F32", (1,)), TensorSpec("b", "U8", (2, 2))]
    made = by_columns(TensorInfo, specs, [0, 4], [4, 8])
    assert made == [TensorInfo(specs[0], 0, 4), TensorInfo(specs[1], 4, 8)]
    assert hash(made[1]) == hash(TensorInfo(specs[1], 4, 8))
    with pytest.raises(TypeError):
        by_columns(TensorInfo, specs, [0], [4, 8])  # columns of two lengths
    with pytest.raises(TypeError):
        by_columns(TensorInfo, specs, [0, 4])  # a column short
