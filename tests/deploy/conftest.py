"""Fixtures for the deployment tests: the loaded chart and the value sets rendered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.deploy.helpers import CHART, Render, render

# Two models with different GPU counts, each from another kind of source.
TWO_MODELS: dict[str, Any] = {
    "models": [
        {
            "name": "llama-8b",
            "servedModelName": "meta-llama/Llama-3.1-8B-Instruct",
            "source": {
                "type": "pvc",
                "pvc": {"claimName": "model-weights", "subPath": "Llama-3.1-8B-Instruct"},
            },
            # The claim is ReadWriteOnce: the gateway reads the tokenizer from a small image.
            "tokenizerSource": {
                "type": "image",
                "image": {
                    "repository": "registry.example.com/tokenizers/llama-3.1-8b",
                    "tag": "1",
                    "path": "/model",
                },
            },
            "replicas": 2,
            "gpus": 1,
            "blockSize": 32,
            "kvCacheMemory": 21474836480,  # 20 GiB: must not render as 2.147483648e+10
            "maxModelLen": 8192,
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        },
        {
            "name": "qwen-72b",
            "servedModelName": "Qwen/Qwen2.5-72B-Instruct",
            "source": {
                "type": "image",
                "image": {
                    "repository": "registry.example.com/models/qwen2.5-72b",
                    "tag": "1",
                    "path": "/model",
                    "sizeLimit": "200Gi",
                },
            },
            "replicas": 1,
            "gpus": 4,
            "maxModelLen": 32768,
            "shmSize": "16Gi",
            "tolerations": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}],
        },
    ]
}

EXTERNAL_REDIS_TLS: dict[str, Any] = {
    "redis": {
        "url": "rediss://redis.example.com:6380/0",
        "auth": {"existingSecret": "pagoda-redis", "existingSecretKey": "password"},
        "tls": {"caSecret": "redis-ca", "caKey": "ca.crt"},
    }
}

EVERYTHING_ON: dict[str, Any] = {
    **TWO_MODELS,
    "gateway": {
        "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
        "apiKeys": {"existingSecret": "pagoda-api-keys"},
    },
    "keda": {"enabled": True, "threshold": 3},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "networkPolicy": {
        "enabled": True,
        "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
    },
    "otel": {"endpoint": "http://otel-collector.observability:4317", "protocol": "grpc"},
}

THREE_ROUTERS: dict[str, Any] = {"router": {"replicas": 3}}

# The other sources: a node directory, a claim the chart creates, and a CPU-only engine.
OTHER_SOURCES: dict[str, Any] = {
    "models": [
        {
            "name": "local",
            "source": {"type": "hostPath", "hostPath": {"path": "/mnt/models/tiny"}},
            "gpus": 0,
        },
        {
            "name": "shared",
            "source": {
                "type": "pvc",
                "pvc": {"create": {"size": "100Gi", "storageClassName": "nfs"}, "subPath": "m"},
            },
        },
    ],
    "gateway": {"apiKeys": {"keys": ["sk-one", "sk-two"]}},
    "grafanaDashboards": {"enabled": True},
}

# Scale to zero: KEDA on with no replica floor, the gateway holding requests meanwhile, engines
# given an explicit --shutdown-timeout, the router annotating pods' deletion cost.
SCALE_TO_ZERO: dict[str, Any] = {
    "keda": {"enabled": True, "minReplicaCount": 0, "maxReplicaCount": 8, "cooldownPeriod": 120},
    "serviceMonitor": {"enabled": True},
    # With the NetworkPolicy (on by default), Prometheus must be named to scrape.
    "networkPolicy": {"metricsFrom": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}]},
    "gateway": {"engineWait": {"timeoutSeconds": 240, "maxRequests": 64}},
    "engine": {"shutdownTimeoutSeconds": 120},
    "router": {"deletionCost": {"intervalSeconds": 5, "windowSeconds": 600}},
}

# Speculative decoding: prompt lookup on a CPU engine, a draft model from an image.
SPECULATIVE: dict[str, Any] = {
    "models": [
        {
            "name": "lookup",
            "source": {"type": "builtin"},
            "gpus": 0,
            "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 4, "disable_by_batch_size": 8},
        },
        {
            "name": "drafted",
            "source": {"type": "pvc", "pvc": {"claimName": "weights", "subPath": "llama-70b"}},
            "gpus": 2,
            "speculativeConfig": {"method": "draft_model", "num_speculative_tokens": 3},
            "draftSource": {
                "type": "image",
                "image": {"repository": "registry.example.com/models/llama-1b", "tag": "1",
                          "path": "/model"},
            },
        },
    ]
}

# Multi-LoRA: adapters from the model's own claim (runtime loading on, admin keys in their own
# Secret) and, on a CPU engine of the builtin model, from a volume of their own.
LORA: dict[str, Any] = {
    "gateway": {"apiKeys": {"keys": ["sk-user"]}, "adminApiKeys": {"keys": ["sk-admin"]}},
    "models": [
        {
            "name": "tuned",
            "servedModelName": "meta-llama/Llama-3.1-8B-Instruct",
            "source": {"type": "pvc", "pvc": {"claimName": "weights", "subPath": "llama-8b"}},
            "gpus": 1,
            "lora": {
                "modules": [{"name": "sql", "path": "adapters/sql"},
                            {"name": "chat-v2", "path": "adapters/chat/v2/"}],
                "maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 8, "runtimeLoading": True,
            },
        },
        {
            "name": "small",
            "source": {"type": "builtin"},
            "gpus": 0,
            "lora": {
                "modules": [{"name": "summarize", "path": "summarize"}],
                "source": {"type": "image",
                           "image": {"repository": "registry.example.com/adapters/smol",
                                     "tag": "3", "path": "/adapters"}},
            },
        },
    ],
}

KV_TIERS: dict[str, Any] = {
    "models": [
        {"name": "chat", "source": {"type": "builtin"}, "kvOffloadingSize": 2},
        {"name": "plain", "source": {"type": "builtin"}},
    ],
    "kvStore": {"enabled": True, "maxmemory": "2gb"},
    "networkPolicy": {"enabled": True},
}

# The Gateway API Inference Extension: a pool per model (one tokenizer from an image, one
# from a claim) behind a Gateway in another namespace; API keys on (the engine pods' OpenAI
# front enforces them too).
GATEWAY_API: dict[str, Any] = {
    **TWO_MODELS,
    "gateway": {"apiKeys": {"keys": ["sk-pool-1", "sk-pool-2"]}},
    "gatewayAPI": {"enabled": True, "failureMode": "FailOpen",
                   "gateway": {"name": "inference-gateway", "namespace": "gateways"},
                   "gatewayFrom": [{"namespaceSelector": {"matchLabels": {
                       "kubernetes.io/metadata.name": "gateways"}}}]},
    "flowControl": {"enabled": True, "sheddablePriority": 1, "shedAfterSeconds": 2},
}

# Prefill/decode on separate engines for one model (with the KV tiers too), one aggregated
# model beside it; KEDA per role, the NetworkPolicy on.
DISAGGREGATED: dict[str, Any] = {
    "models": [
        {"name": "chat", "source": {"type": "builtin"}, "gpus": 0, "kvOffloadingSize": 1,
         "resources": {"requests": {"cpu": "1", "memory": "2Gi"}},
         "disaggregation": {
             "transferPort": 7200,
             "prefill": {"replicas": 1, "resources": {"requests": {"cpu": "4"}},
                         "maxNumBatchedTokens": 8192},
             "decode": {"replicas": 2, "maxNumSeqs": 64, "keda": {"maxReplicaCount": 8}},
             "autoscaling": {"promptTokensPerSecond": 3000, "runningRequests": 24,
                             "kvUsage": 0.7}}},
        {"name": "plain", "source": {"type": "builtin"}, "gpus": 0},
    ],
    "keda": {"enabled": True},
    "networkPolicy": {"enabled": True},
}

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "two-models": TWO_MODELS,
    "external-redis-tls": EXTERNAL_REDIS_TLS,
    "everything-on": EVERYTHING_ON,
    "three-routers": THREE_ROUTERS,
    "other-sources": OTHER_SOURCES,
    "scale-to-zero": SCALE_TO_ZERO,
    "speculative": SPECULATIVE,
    "lora": LORA,
    "kv-tiers": KV_TIERS,
    "gateway-api": GATEWAY_API,
    "disaggregated": DISAGGREGATED,
}


@pytest.fixture(scope="session")
def chart() -> Any:
    helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
    loaded = helm.Chart.load(str(CHART))
    yield loaded
    loaded.close()


@pytest.fixture(scope="session")
def rendered(chart: Any) -> Callable[[str], Render]:
    """rendered(scenario name) -> Render, each scenario rendered once per session."""
    cache: dict[str, Render] = {}

    def get(name: str) -> Render:
        if name not in cache:
            cache[name] = render(chart, SCENARIOS[name])
        return cache[name]

    return get


@pytest.fixture(params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest, rendered: Callable[[str], Render]) -> Render:
    return rendered(request.param)
