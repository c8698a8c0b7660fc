from __future__ import annotations

import dataclasses

import pytest

from services.router.config import PolicyName, RouterConfig, build_parser


def test_every_field_is_one_flag() -> None:
    flags = {a.dest: a.option_strings for a in build_parser()._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    assert set(flags) == fields
    assert all(opts == ["--" + dest.replace("_", "-")] for dest, opts in flags.items())


def test_from_args() -> None:
    config = RouterConfig.from_args(
        ["--port", "9000", "--engines", "http://a:1, http://b:2", "--policy", "round-robin",
         "--hot-spot-ratio", "3.5", "--redis-url", "rediss://:pw@redis:6380/0"]
    )  # fmt: skip
    assert config.port == 9000
    assert config.engines == ("http://a:1", "http://b:2")
    assert config.policy is PolicyName.ROUND_ROBIN
    assert config.hot_spot_ratio == 3.5
    assert RouterConfig.from_args([]) == RouterConfig()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 70000},
        {"redis_url": "http://redis"},
        {"engines": ("not-a-url",)},
        {"engines": ("http://a:1",), "k8s_service": "svc"},
        {"policy": "random"},
        {"hot_spot_ratio": 0.5},
        {"provisional_ttl_s": 0},
        {"redis_namespace": "a:b"},
        {"log_level": "loud"},
    ],
)
def test_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)
