"""``python -m services.serve --prefill-engines N --decode-engines M``: N producer and M
consumer engines with the P/D connector (``--pd-transport``: over TCP or through a KV store);
the two flags go together and leave the engines' --kv-transfer-config to serve."""

from __future__ import annotations

import json

import pytest

from services.serve import args_from, engine_roles, pd_flags


def test_prefill_and_decode_engines_get_their_roles() -> None:
    config, rest = args_from(["--prefill-engines", "1", "--decode-engines", "2",
                              "--num-blocks", "64"])
    assert rest == ["--num-blocks", "64"] and config.pd
    assert engine_roles(config) == ["kv_producer", "kv_consumer", "kv_consumer"]
    flag, value = pd_flags("kv_producer")
    assert flag == "--kv-transfer-config" and json.loads(value) == {
        "kv_connector": "PagodaPDConnector", "kv_role": "kv_producer"}
    plain, _ = args_from(["--engines", "2"])
    assert engine_roles(plain) == [None, None] and pd_flags(None) == []


def test_the_store_transport() -> None:
    config, _ = args_from(["--prefill-engines", "1", "--decode-engines", "1",
                           "--pd-transport", "store"])
    assert config.pd_transport == "store"
    flag, value = pd_flags("kv_consumer", "store", "redis://127.0.0.1:7000/0")
    assert flag == "--kv-transfer-config" and json.loads(value) == {
        "kv_connector": "PagodaStorePDConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_store_url": "redis://127.0.0.1:7000/0"}}


def test_bad_combinations_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--prefill-engines", "1"],
                 ["--prefill-engines", "1", "--decode-engines", "1", "--kv-transfer-config",
                  "{}"],
                 ["--prefill-engines", "1", "--decode-engines", "1", "--pd-transport", "nfs"]):
        with pytest.raises(SystemExit) as exit_info:
            args_from(argv)
        assert exit_info.value.code == 2, argv
    assert "kv-transfer-config" in capsys.readouterr().err


def test_streamed_kv_is_the_gateways_flag_on_by_default() -> None:
    config, rest = args_from(["--prefill-engines", "1", "--decode-engines", "1"])
    assert config.pd_stream_kv and rest == []
    config, rest = args_from(["--prefill-engines", "1", "--decode-engines", "1",
                              "--pd-stream-kv=false"])
    assert not config.pd_stream_kv and rest == []  # not an engine flag
