"""space_to_dict / space_from_dict: exact round trips, strict JSON, untrusted input."""
import json
import warnings

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import ProtocolError, decode, encode, space_from_dict, space_to_dict

S = gym.spaces
BOX_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64, np.float16, np.float32, np.float64]


@st.composite
def boxes(draw, *, sampleable: bool = True) -> S.Box:
    """Random Boxes of every dtype; bounds stay modest so that ``sample()`` works."""
    dtype = np.dtype(draw(st.sampled_from(BOX_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if dtype.kind == "b":
        low, high = np.zeros(shape, dtype), np.ones(shape, dtype)
    elif dtype.kind == "f":
        low = np.asarray(rng.uniform(-50, 0, shape))
        high = np.asarray(low + rng.uniform(0.5, 50, shape))
        if draw(st.booleans()):
            low[rng.random(shape) < 0.5] = -np.inf
            high[rng.random(shape) < 0.5] = np.inf
        if draw(st.booleans()):                    # uniform bounds are stored as one number
            low, high = np.full(shape, low.flat[0]), np.full(shape, high.flat[0])
        low, high = low.astype(dtype), high.astype(dtype)
    else:
        info = np.iinfo(dtype)
        lo = max(int(info.min), -100) if sampleable else int(info.min)
        low = np.asarray(rng.integers(lo, 1, shape, endpoint=True)).astype(dtype)
        high = np.asarray(low.astype(object) + rng.integers(0, 100, shape, endpoint=True)).astype(dtype)
        if not sampleable:
            high[...] = info.max
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return S.Box(low=low, high=high, shape=shape, dtype=dtype)


def leaf_spaces(sampleable: bool = True):
    return st.one_of(
        boxes(sampleable=sampleable),
        st.builds(lambda n, start: S.Discrete(n, start=start), st.integers(1, 10), st.integers(-5, 5)),
        st.builds(lambda nvec: S.MultiDiscrete(nvec), st.lists(st.integers(1, 6), min_size=1, max_size=4)),
        st.builds(lambda a, b: S.MultiDiscrete(np.arange(1, a * b + 1).reshape(a, b), start=-np.ones((a, b), int)),
                  st.integers(1, 3), st.integers(1, 3)),
        st.builds(S.MultiBinary, st.integers(1, 5)),
        st.builds(lambda a, b: S.MultiBinary([a, b]), st.integers(1, 3), st.integers(1, 3)),
    )


def nested_spaces(sampleable: bool = True):
    """Random spaces, nested Dict/Tuple up to a few levels deep."""
    keys = st.text("abcdefgh_", min_size=1, max_size=6)
    return st.recursive(
        leaf_spaces(sampleable),
        lambda children: st.one_of(
            st.dictionaries(keys, children, min_size=1, max_size=3).map(S.Dict),
            st.lists(children, min_size=1, max_size=3).map(S.Tuple),
        ),
        max_leaves=6,
    )


def assert_same_space(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, S.Box):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.low.dtype == b.low.dtype and np.array_equal(a.low, b.low)
        assert np.array_equal(a.high, b.high)
    elif isinstance(a, S.Discrete):
        assert (a.n, a.start, a.dtype) == (b.n, b.start, b.dtype)
    elif isinstance(a, S.MultiDiscrete):
        assert np.array_equal(a.nvec, b.nvec) and np.array_equal(a.start, b.start)
        assert a.shape == b.shape and a.dtype == b.dtype
    elif isinstance(a, S.MultiBinary):
        assert a.shape == b.shape
    elif isinstance(a, S.Dict):
        assert list(a.spaces) == list(b.spaces)
        for k in a.spaces:
            assert_same_space(a[k], b[k])
    elif isinstance(a, S.Tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_space(x, y)
    else:
        raise AssertionError(type(a))
    assert a == b


EXAMPLES = [
    S.Box(-1.0, 1.0, (3,), np.float32),
    S.Box(np.array([-np.inf, 0.0]), np.array([np.inf, 1.0]), dtype=np.float64),
    S.Box(0, 255, (84, 84, 4), np.uint8),
    S.Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (2,), np.int64),
    S.Box(0, np.iinfo(np.uint64).max, (2,), np.uint64),
    S.Box(-2, 2, (), np.float16),
    S.Box(0, 1, (2, 2), np.bool_),
    S.Discrete(2),
    S.Discrete(7, start=-3),
    S.MultiDiscrete([3, 4, 5]),
    S.MultiDiscrete([[2, 3], [4, 5]], start=[[0, 1], [-1, 2]]),
    S.MultiBinary(6),
    S.MultiBinary([2, 3]),
    S.Dict({"pos": S.Box(-1, 1, (3,)), "cam": S.Tuple([S.Box(0, 255, (8, 8, 3), np.uint8), S.Discrete(3)])}),
    S.Tuple([S.Discrete(2), S.Dict({"a": S.MultiBinary(2), "b": S.Tuple([S.MultiDiscrete([2, 2])])})]),
]


@pytest.mark.parametrize("space", EXAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip_examples(space):
    d = space_to_dict(space)
    text = json.dumps(d, allow_nan=False)            # strict JSON: no NaN/Infinity literals
    assert_same_space(space_from_dict(json.loads(text)), space)
    assert_same_space(space_from_dict(decode(encode(d))), space)   # and over the codec


def test_uniform_bounds_are_compact():
    d = space_to_dict(S.Box(0, 255, (84, 84, 4), np.uint8))
    assert d == {"type": "Box", "shape": [84, 84, 4], "dtype": "uint8", "low": 0, "high": 255}
    d = space_to_dict(S.Box(np.array([-np.inf, 0], np.float32), np.array([np.inf, 1], np.float32)))
    assert d["low"] == ["-inf", 0.0] and d["high"] == ["inf", 1.0]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(nested_spaces(sampleable=False))
def test_round_trip_random_spaces(space):
    d = space_to_dict(space)
    assert_same_space(space_from_dict(json.loads(json.dumps(d, allow_nan=False))), space)


def test_unknown_space_type_names_supported_types():
    with pytest.raises(ProtocolError, match="Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple"):
        space_to_dict(S.Text(5))
    with pytest.raises(ProtocolError, match="Text.*supported: Box"):
        space_to_dict(S.Dict({"t": S.Text(5)}))
    with pytest.raises(ProtocolError, match="supported: Box"):
        space_from_dict({"type": "Graph"})


BOX = {"type": "Box", "shape": [2], "dtype": "float32", "low": -1.0, "high": 1.0}


@pytest.mark.parametrize("bad, message", [
    ("Box", "must be a dict"),
    ({}, "unsupported space type None"),
    ({**BOX, "dtype": "object"}, "dtype 'object'"),
    ({**BOX, "dtype": "complex64"}, "dtype"),
    ({**BOX, "shape": [-1]}, "bad shape"),
    ({**BOX, "shape": "2"}, "wrong type"),
    ({**BOX, "shape": [1 << 20, 1 << 20]}, "exceeds"),
    ({k: v for k, v in BOX.items() if k != "low"}, "lacks 'low'"),
    ({**BOX, "low": [0.0, 1.0, 2.0]}, "3 values for shape"),
    ({**BOX, "low": "zero"}, "bad value"),
    ({**BOX, "low": [0.0, None]}, "bad value"),
    ({**BOX, "dtype": "int32", "low": "-inf"}, "bad value"),
    ({"type": "Discrete", "n": 0, "start": 0}, "invalid space description"),
    ({"type": "Discrete", "n": True, "start": 0}, "wrong type"),
    ({"type": "Discrete", "n": 2.5, "start": 0}, "wrong type"),
    ({"type": "MultiDiscrete", "nvec": [2, 2], "start": [0], "shape": [2]}, "list of 2 ints"),
    ({"type": "MultiBinary", "n": [2, -3]}, "bad shape"),
    ({"type": "Dict", "spaces": {"a": {"type": "Nope"}}}, "unsupported space type 'Nope'"),
    ({"type": "Tuple", "spaces": "ab"}, "wrong type"),
])
def test_space_from_dict_rejects_bad_input(bad, message):
    with pytest.raises(ProtocolError, match=message):
        space_from_dict(bad)


def test_space_from_dict_rejects_too_many_spaces():
    leaf = {"type": "Discrete", "n": 2, "start": 0}
    wide = {"type": "Tuple", "spaces": [{"type": "Tuple", "spaces": [leaf] * 100}] * 100}
    with pytest.raises(ProtocolError, match="more than 4096 spaces"):
        space_from_dict(wide)


def test_space_from_dict_rejects_deep_nesting():
    d = {"type": "Discrete", "n": 2, "start": 0}
    for _ in range(40):
        d = {"type": "Tuple", "spaces": [d]}
    with pytest.raises(ProtocolError, match="deeper"):
        space_from_dict(d)
