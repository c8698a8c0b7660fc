"""A model's ``kvTransferConfig`` becomes the engine's --kv-transfer-config, which the engine
reads back as the config the chart meant; the schema refuses a role vLLM does not have."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.deploy.helpers import flag, render
from tests.deploy.test_chart import engine

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")

TRANSFER = {"kv_connector": "PagodaTiersConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offloading_size": 2}}


def _values(transfer: dict[str, Any]) -> dict[str, Any]:
    return {"models": [{"name": "chat", "source": {"type": "builtin"},
                        "kvTransferConfig": transfer},
                       {"name": "plain", "source": {"type": "builtin"}}]}


def test_kv_transfer_config_renders_as_the_engine_flag(chart: Any) -> None:
    r = render(chart, _values(TRANSFER))
    chat, plain = r.container(engine("chat")), r.container(engine("plain"))
    assert json.loads(flag(chat, "kv-transfer-config")) == TRANSFER
    assert flag(plain, "kv-transfer-config") is None  # per model
    from services.engine.serving.server_config import configs_from_args

    config, _ = configs_from_args([a for a in chat["args"] if a.startswith("--kv-transfer")])
    assert config.kv_offloading_size == 2
    assert [s.kv_connector for s in config.kv_connector_specs()] == ["PagodaTiersConnector"]


def test_the_schema_refuses_an_unknown_role(chart: Any) -> None:
    with pytest.raises(helm.HelmError, match="kv_role"):
        render(chart, _values({**TRANSFER, "kv_role": "producer"}))
