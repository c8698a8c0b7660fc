"""services.common.cli: a config dataclass's fields as flags, one to one; and the three services'
command lines built with it (every field a flag, today's spellings accepted)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from enum import StrEnum

import pytest

from services.common import cli
from services.common.cli import flag


class Color(StrEnum):
    RED = "red"
    DARK_BLUE = "dark-blue"


@dataclass(frozen=True, slots=True)
class Pair:
    key: str
    value: int

    @classmethod
    def parse(cls, text: str) -> Pair:
        key, sep, value = text.partition("=")
        if not sep or not value.isdigit():
            raise ValueError(f"expected KEY=INT, got {text!r}")
        return cls(key, int(value))


@dataclass(frozen=True, slots=True)
class Sample:
    name: str = flag("x", help="a name")
    count: int = flag(3, help="how many")
    ratio: float = flag(0.5, help="a ratio")
    enabled: bool = flag(True, help="on or off")
    limit: int | None = flag(None, help="optional limit")
    color: Color = flag(Color.RED, help="a color")
    urls: tuple[str, ...] = flag((), help="comma separated", metavar="URL")
    sizes: list[int] = flag(default_factory=list, help="comma separated ints")
    pairs: tuple[Pair, ...] = flag((), name="pair", repeat=True, parse=Pair.parse, help="repeat")

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


PROG = "sample"


def parse(*argv: str) -> Sample:
    return cli.config_from_args(Sample, list(argv), prog=PROG, description="a sample")


def parser() -> argparse.ArgumentParser:
    return cli.build_parser(Sample, prog=PROG, description="a sample")


def test_nothing_given_is_the_dataclass_defaults() -> None:
    assert parse() == Sample()
    assert vars(parser().parse_args([])) == {}  # defaults come from the dataclass only


def test_each_type_reads_from_its_flag() -> None:
    config = parse(
        "--name", "y", "--count=7", "--ratio", "1e-3", "--limit", "9", "--color", "dark-blue",
        "--urls", "http://a:1, http://b:2,", "--sizes", "1,2", "--pair", "a=1", "--pair=b=2",
    )  # fmt: skip
    assert config == Sample(
        name="y", count=7, ratio=0.001, limit=9, color=Color.DARK_BLUE,
        urls=("http://a:1", "http://b:2"), sizes=[1, 2], pairs=(Pair("a", 1), Pair("b", 2)),
    )  # fmt: skip
    assert isinstance(config.color, Color)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--enabled"], True),
        (["--enabled", "false"], False),
        (["--enabled=false"], False),
        (["--enabled=0"], False),
        (["--enabled", "no", "--count", "1"], False),
        (["--enabled", "True"], True),
        (["--enabled=on"], True),
    ],
)
def test_bool_spellings(argv: list[str], expected: bool) -> None:
    assert parse(*argv).enabled is expected


def test_a_repeated_flag_starts_empty_each_parse() -> None:
    assert parse("--pair", "a=1").pairs == (Pair("a", 1),)
    assert parse("--pair", "b=2").pairs == (Pair("b", 2),)
    assert parse().pairs == ()


def test_every_field_is_one_flag_with_its_help(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping of the help texts
    p = parser()
    options = {a.dest: a.option_strings for a in p._actions if a.dest != "help"}
    assert options == {
        f.name: ["--pair" if f.name == "pairs" else "--" + f.name.replace("_", "-")]
        for f in dataclasses.fields(Sample)
    }
    text = p.format_help()
    for f in dataclasses.fields(Sample):
        assert f.metadata["pagoda.cli"].help in text
    assert "(default: 3)" in text and "(default: dark-blue)" not in text
    assert "(default: red)" in text and "(default: true)" in text
    assert "--color {red,dark-blue}" in text and "--urls URL,..." in text
    assert "--pair PAIR" in text


def run_failing(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: sample")
    return err.splitlines()[-1]


def test_unknown_flag_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "unrecognized arguments: --seed" in run_failing(capsys, "--seed", "1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "many"], "argument --count: invalid int value: 'many'"),
        (["--ratio", "x"], "argument --ratio: invalid float value: 'x'"),
        (["--limit", "1.5"], "argument --limit: invalid int value: '1.5'"),
        (["--enabled", "maybe"], "argument --enabled: expected true or false, got 'maybe'"),
        (["--color", "green"], "argument --color: invalid choice: 'green' (choose from red, "),
        (["--sizes", "1,a"], "argument --sizes: invalid item 'a' in '1,a'"),
        (["--pair", "a"], "argument --pair: expected KEY=INT, got 'a'"),
        (["--count", "-1"], "sample: error: --count must be >= 0, got -1"),  # __post_init__
    ],
)
def test_a_bad_value_is_an_argparse_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in run_failing(capsys, *argv)


def test_fields_need_help_and_a_reader() -> None:
    @dataclass
    class NoHelp:
        port: int = 1

    with pytest.raises(TypeError, match=r"NoHelp.port: declare it with cli.flag"):
        cli.build_parser(NoHelp, prog="p", description="d")

    @dataclass
    class Unreadable:
        pair: Pair = flag(Pair("a", 1), help="no parse=")

    with pytest.raises(TypeError, match=r"Unreadable.pair: no reader"):
        cli.build_parser(Unreadable, prog="p", description="d")


def test_several_classes_share_one_command_line() -> None:
    @dataclass
    class Other:
        port: int = flag(1, help="a port")

    p = cli.build_parser(Sample, Other, prog=PROG, description="d")
    ns = p.parse_args(["--count", "2", "--port", "5"])
    assert cli.from_namespace(Sample, ns, p) == Sample(count=2)
    assert cli.from_namespace(Other, ns, p) == Other(port=5)
    assert cli.from_namespace(Other, ns, p, port=6) == Other(port=6)  # overrides win

    @dataclass
    class Clash:
        count: int = flag(1, help="the same flag again")

    with pytest.raises(argparse.ArgumentError):
        cli.build_parser(Sample, Clash, prog=PROG, description="d")


# -- the services --------------------------------------------------------------------------


def _service_parsers() -> list[tuple[argparse.ArgumentParser, list[type]]]:
    from services.engine.config import EngineConfig
    from services.engine.serving import server_config
    from services.gateway.config import GatewayConfig
    from services.gateway.config import build_parser as gateway_parser
    from services.router.config import RouterConfig
    from services.router.config import build_parser as router_parser

    return [
        (router_parser(), [RouterConfig]),
        (gateway_parser(), [GatewayConfig]),
        (server_config.build_parser(), [EngineConfig, server_config.ServerConfig]),
    ]


def test_services_have_one_flag_per_field_and_help_lists_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping of the help texts
    renamed = {"api_keys": "--api-key", "models": "--model",  # the gateway's repeatable flags
               "admin_api_keys": "--admin-api-key"}
    for p, classes in _service_parsers():
        fields = [f for cls in classes for f in dataclasses.fields(cls)]
        options = {a.dest: a.option_strings for a in p._actions if a.dest != "help"}
        assert options == {
            f.name: [renamed.get(f.name, "--" + f.name.replace("_", "-"))] for f in fields
        }
        text = p.format_help()
        for f in fields:
            assert options[f.name][0] in text and f.metadata["pagoda.cli"].help in text


def test_services_accept_todays_command_lines() -> None:
    """The spellings the chart, the images, serve.py and the tests pass (see their args)."""
    from services.engine.serving.server_config import configs_from_args
    from services.gateway.config import GatewayConfig, ModelSpec
    from services.router.config import PolicyName, RouterConfig

    engine, server = configs_from_args([
        "--host=0.0.0.0", "--port=8300", "--model=/models/m", "--served-model-name=m",
        "--block-size=32", "--kv-cache-memory=1073741824", "--max-model-len=4096",
        "--max-num-seqs=8", "--max-num-batched-tokens=512", "--dtype=bfloat16",
        "--enable-prefix-caching=false", "--device=cpu", "--redis-url=redis://r:6379/0",
        "--engine-id=pod-1", "--advertise-url=http://10.0.0.1:8300", "--shutdown-timeout=60",
        "--heartbeat-interval-s", "0.2", "--heartbeat-ttl-s", "3", "--num-blocks", "256",
        "--debug-step-delay-s", "0.05", "--log-level", "warning",
    ])  # fmt: skip
    assert engine.enable_prefix_caching is False and engine.kv_cache_memory == 1 << 30
    assert (engine.model, engine.served_model_name, engine.num_blocks) == ("/models/m", "m", 256)
    assert server.engine_id == "pod-1" and server.heartbeat_interval_s == 0.2
    assert server.resolved_url() == "http://10.0.0.1:8300"
    assert not hasattr(engine, "seed")

    router = RouterConfig.from_args([
        "--host=0.0.0.0", "--port=8100", "--redis-url=redis://r:6379/0", "--k8s-service=eng",
        "--k8s-namespace=llm", "--k8s-port-name=http", "--policy=least-loaded",
        "--load-weight=0.3", "--hot-spot-ratio", "3", "--log-level", "DEBUG",
    ])  # fmt: skip
    assert router.policy is PolicyName.LEAST_LOADED and router.k8s_service == "eng"
    assert RouterConfig.from_args(["--engines", "http://a:1,http://b:2"]).engines == (
        "http://a:1", "http://b:2",
    )  # fmt: skip

    gateway = GatewayConfig.from_args(
        ["--host", "0.0.0.0", "--port", "8000", "--router-url=http://r1:8100,http://r2:8100",
         "--model", "SmolLM2-135M-Instruct=/opt/pagoda/models/SmolLM2-135M-Instruct",
         "--model=m2=/models/two", "--request-timeout=600", "--max-retries=2",
         "--shutdown-grace=30", "--engines-refresh", "0.5", "--api-key", "k"],
        environ={},
    )  # fmt: skip
    assert gateway.models[1] == ModelSpec("m2", "/models/two") and gateway.api_keys == ("k",)
    assert gateway.router_urls == ("http://r1:8100", "http://r2:8100")


@pytest.mark.parametrize(
    "argv",
    [["--port", "70000"], ["--heartbeat-interval-s", "0"], ["--log-level", "loud"],
     ["--shutdown-timeout", "-1"]],
)  # fmt: skip
def test_engine_server_values_are_checked(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    from services.engine.serving.server_config import configs_from_args

    with pytest.raises(SystemExit):
        configs_from_args(argv)
    assert f"error: {argv[0]} must" in capsys.readouterr().err


def test_a_bad_hash_algorithm_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    """Not at the first request (which would make every request a 500): the config refuses it,
    naming the field, and the engine server's command line exits 2 naming the flag."""
    from services.engine.config import EngineConfig
    from services.engine.serving.server_config import configs_from_args
    from services.protocol.block_hash import HashAlgorithm

    with pytest.raises(ValueError, match="hash_algorithm must be one of xxh3_128, sha256"):
        EngineConfig(hash_algorithm="bogus")
    assert EngineConfig(hash_algorithm="sha256").hash_algorithm is HashAlgorithm.SHA256
    with pytest.raises(SystemExit) as exit_info:
        configs_from_args(["--hash-algorithm", "bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--hash-algorithm" in err and "'bogus'" in err and "xxh3_128, sha256" in err
    engine, _ = configs_from_args(["--hash-algorithm=sha256"])
    assert engine.hash_algorithm is HashAlgorithm.SHA256


# -- positional arguments and pass-through (the batch job, services.serve) -----------------


@dataclass(frozen=True, slots=True)
class Job:
    source: str = flag(help="what to read", positional=True)
    target: str | None = flag(None, help="where to write", positional=True)
    count: int = flag(1, help="how many")


def test_positional_fields_are_arguments_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    def job(*argv: str) -> Job:
        return cli.config_from_args(Job, list(argv), prog="job", description="d")

    assert job("in", "--count", "2") == Job("in", None, 2)
    assert job("--count=3", "in", "out") == Job("in", "out", 3)
    with pytest.raises(SystemExit) as exc:
        job()
    assert exc.value.code == 2
    assert "the following arguments are required: source" in capsys.readouterr().err


def test_config_and_rest_hands_on_what_it_does_not_know() -> None:
    config, rest = cli.config_and_rest(
        Sample, ["--count", "2", "--seed", "1", "--name=z", "--other=x", "--enabled"],
        prog=PROG, description="d",
    )  # fmt: skip
    assert config == Sample(count=2, name="z", enabled=True)
    assert rest == ["--seed", "1", "--other=x"]
    config, rest = cli.config_and_rest(Sample, ["--cou", "3"], prog=PROG, description="d")
    assert (config, rest) == (Sample(), ["--cou", "3"])  # never an abbreviation of --count


def test_serve_reads_make_serve_and_passes_engine_flags_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.router.config import PolicyName
    from services.serve import ServeConfig, args_from

    # The Makefile's `make serve PORT=8000 ENGINES=2 MODEL=/m`.
    assert args_from(["--port", "8000", "--engines", "2", "--model", "/m"]) == (
        ServeConfig(port=8000, engines=2, model="/m"), [],
    )  # fmt: skip
    config, engine_flags = args_from([
        "--max-num-seqs", "8", "--policy", "round-robin", "--enforce-eager", "--api-key", "a",
        "--num-blocks=64", "--api-key=b", "--dtype", "bfloat16",
    ])  # fmt: skip
    assert config == ServeConfig(policy=PolicyName.ROUND_ROBIN, dtype="bfloat16",
                                 api_keys=("a", "b"))
    assert engine_flags == ["--max-num-seqs", "8", "--enforce-eager", "--num-blocks=64"]
    # `make serve SPECULATIVE_CONFIG='{...}'`: vLLM's JSON reaches every engine whole
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert args_from(["--speculative-config", spec]) == (ServeConfig(),
                                                        ["--speculative-config", spec])
    for argv, message in ((["--engine-id=x"], "serve sets --engine-id"),
                          (["--engines", "0"], "--engines must be >= 1"),
                          (["--policy", "random"], "invalid choice: 'random'")):
        with pytest.raises(SystemExit) as exc:
            args_from(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_serve_has_one_flag_per_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.serve import ServeConfig, args_from

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        args_from(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(ServeConfig):
        renamed = {"api_keys": "--api-key", "admin_api_keys": "--admin-api-key"}
        name = renamed.get(f.name, "--" + f.name.replace("_", "-"))
        assert name in text and f.metadata["pagoda.cli"].help in text
    assert "Any other flag is passed to every engine" in text


def test_batch_takes_its_files_and_the_engine_flags() -> None:
    from pathlib import Path

    from services.engine.batch import BatchFiles, args_from
    from services.engine.config import EngineConfig

    files, engine = args_from(["in.jsonl", "out.jsonl", "--model", "/m", "--dtype", "float32",
                               "--block-size", "32", "--max-num-seqs", "4", "--num-blocks=9"])
    assert files == BatchFiles(Path("in.jsonl"), Path("out.jsonl"))
    assert engine == EngineConfig(model="/m", dtype="float32", block_size=32, max_num_seqs=4,
                                  num_blocks=9)
