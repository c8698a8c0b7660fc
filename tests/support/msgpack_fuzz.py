"""Shared pieces of the internal-API fuzz tests (engine ``/internal/generate``, router
``/route``): hypothesis strategies for msgpack bodies and the error-shape check."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = 200
ERROR_KEYS = {"message", "type", "param", "code"}

FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example])


def msgpack_values(interesting: list[Any], max_binary: int) -> st.SearchStrategy[Any]:
    """Any msgpack-encodable structure, leaning on the ``interesting`` edge values."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
        st.binary(max_size=max_binary), st.sampled_from(interesting),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=6),
            st.dictionaries(st.one_of(st.text(max_size=12), st.binary(max_size=4)), inner,
                            max_size=6),
        ),
        max_leaves=24,
    )


@st.composite
def flipped_frames(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """``valid`` packed, with some bytes overwritten, then maybe cut short."""
    frame = bytearray(msgpack.packb(valid))
    for _ in range(draw(st.integers(1, 4))):
        frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    return bytes(frame[: draw(st.integers(0, len(frame)))])


def check_error(status: int, body: Any, expect_param: Any = ...,
                expect_status: int = 400) -> None:
    """An error in the shared JSON shape, naming ``expect_param`` when given."""
    assert status == expect_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == "invalid_request_error", err
    assert err["param"] is None or isinstance(err["param"], str), err
    if expect_param is not ...:
        assert err["param"] == expect_param, err


def report(name: str, seen: Counter[int]) -> None:
    print(f"{name}: {sum(seen.values())} bodies posted, by status {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= EXAMPLES // 2  # the fuzzing really ran
