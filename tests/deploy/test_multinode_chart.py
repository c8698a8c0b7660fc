"""A model with `multiNode` renders a LeaderWorkerSet instead of its Deployment: validated
against the LWS CRD's published schema (v0.10.0, vendored under crds/), the leader serving
and joining the router, the workers joining with the same engine flags (read back by the
engine's own parser, with the environment LWS gives each pod), KEDA scaling the groups, and
the group's pods open to each other under the NetworkPolicy."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.engine.serving.server_config import configs_from_args
from tests.deploy.helpers import RELEASE, flag, render

jsonschema = pytest.importorskip("jsonschema")

CRD = Path(__file__).parent / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets-v0.10.0.yaml.gz"
NAME = f"{RELEASE}-pagoda-engine-big"
GROUP = {"size": 2, "tensorParallel": 2, "pipelineParallel": 1}
VALUES: dict[str, Any] = {
    "models": [
        {"name": "small", "source": {"type": "builtin"}, "gpus": 0},
        {"name": "big", "gpus": 1, "multiNode": GROUP,
         "source": {"type": "pvc", "pvc": {"claimName": "weights", "subPath": "big"}},
         "maxModelLen": 4096, "keda": {"enabled": True, "minReplicaCount": 1}},
    ],
    "networkPolicy": {"enabled": True},
}


@pytest.fixture(scope="module")
def lws_schema() -> dict[str, Any]:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return container


def test_a_multinode_model_renders_a_valid_leaderworkerset(chart, lws_schema) -> None:
    r = render(chart, VALUES)
    assert NAME not in r.names("Deployment") and f"{RELEASE}-pagoda-engine-small" in r.names(
        "Deployment")
    lws = r.get("LeaderWorkerSet", NAME)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    jsonschema.Draft7Validator(lws_schema).validate(lws)
    spec = lws["spec"]
    assert "replicas" not in spec  # KEDA owns the number of groups
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once joined
    template = spec["leaderWorkerTemplate"]
    assert (template["size"], template["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    leader, worker = _container(template["leaderTemplate"]), _container(template["workerTemplate"])
    assert flag(leader, "tensor-parallel-size") == "2" and flag(leader, "redis-url")
    assert flag(worker, "redis-url") is None and flag(worker, "engine-id") is None
    shared = [a for a in leader["args"] if a in worker["args"]]
    assert shared == worker["args"]  # every worker flag is the leader's
    for c in (leader, worker):
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert {m["name"] for m in c["volumeMounts"]} >= {"model", "dshm"}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    scaled = r.get("ScaledObject", NAME)["spec"]["scaleTargetRef"]
    assert scaled == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                      "name": NAME}
    # The engines' Services (the router discovers through them) select leaders, not workers.
    selector = r.get("Service", NAME)["spec"]["selector"]
    labels = template["workerTemplate"]["metadata"]["labels"]
    assert selector.items() <= template["leaderTemplate"]["metadata"]["labels"].items()
    assert not selector.items() <= labels.items()
    group = r.get("NetworkPolicy", f"{NAME}-group")["spec"]
    assert group["podSelector"]["matchLabels"] == {"leaderworkerset.sigs.k8s.io/name": NAME}


def test_the_engine_reads_each_pods_flags_and_lws_environment(chart) -> None:
    template = render(chart, VALUES).get("LeaderWorkerSet", NAME)["spec"]["leaderWorkerTemplate"]
    lws = {"LWS_LEADER_ADDRESS": "big-0.big.llm", "LWS_GROUP_SIZE": "2"}
    for pod, index in (("leaderTemplate", 0), ("workerTemplate", 1)):
        args = [a.replace("$(POD_NAME)", "p").replace("$(POD_IP)", "10.0.0.1")
                for a in _container(template[pod])["args"]]
        engine, _ = configs_from_args(args, env={**lws, "LWS_WORKER_INDEX": str(index)})
        assert (engine.nnodes, engine.node_rank, engine.tensor_parallel_size) == (2, index, 2)
        assert engine.master_addr == "big-0.big.llm" and engine.max_model_len == 4096


def test_pipeline_stages_across_pods(chart) -> None:
    """pipelineParallel 2 x tensorParallel 2 over 4 CPU pods: every pod gets both flags, and
    each reads its place (a rank of 4) from the LWS environment."""
    values = {**VALUES, "models": [{**VALUES["models"][1], "gpus": 0,
                                    "multiNode": {"size": 4, "pipelineParallel": 2}}]}
    template = render(chart, values).get("LeaderWorkerSet", NAME)["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 4
    lws = {"LWS_LEADER_ADDRESS": "big-0.big.llm", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3"}
    args = [a.replace("$(POD_NAME)", "p").replace("$(POD_IP)", "10.0.0.1")
            for a in _container(template["workerTemplate"])["args"]]
    engine, _ = configs_from_args(args, env=lws)
    assert (engine.pipeline_parallel_size, engine.tensor_parallel_size, engine.node_rank) == (
        2, 2, 3)


def test_a_pipeline_stage_of_several_ranks_per_pod(chart, lws_schema) -> None:
    """pipelineParallel 2 x tensorParallel 2 over 2 CPU pods: a stage of 2 ranks in each pod
    (the engine reads 4 ranks, 2 per pod, from each pod's flags and LWS environment)."""
    group = {"size": 2, "pipelineParallel": 2, "tensorParallel": 2}
    values = {**VALUES, "models": [{**VALUES["models"][1], "gpus": 0, "multiNode": group}]}
    lws = render(chart, values).get("LeaderWorkerSet", NAME)
    jsonschema.Draft7Validator(lws_schema).validate(lws)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    env = {"LWS_LEADER_ADDRESS": "big-0.big.llm", "LWS_GROUP_SIZE": "2"}
    for pod, index in (("leaderTemplate", 0), ("workerTemplate", 1)):
        container = _container(template[pod])
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        args = [a.replace("$(POD_NAME)", "p").replace("$(POD_IP)", "10.0.0.1")
                for a in container["args"]]
        engine, _ = configs_from_args(args, env={**env, "LWS_WORKER_INDEX": str(index)})
        assert (engine.world_size, engine.ranks_per_node, engine.node_rank) == (4, 2, index)


@pytest.mark.parametrize(("group", "gpus", "message"), [
    ({"size": 2, "tensorParallel": 4}, 1, r"\(1 x 4\) ranks do not fit size \(2\) pods"),
    ({"size": 4, "pipelineParallel": 2, "tensorParallel": 3}, 0,
     r"\(2 x 3\) ranks do not fit size \(4\)"),
    ({"size": 2, "pipelineParallel": 2}, 1, "runs on the CPU only"),
    ({"size": 2, "pipelineParallel": 2, "tensorParallel": 2}, 2, "runs on the CPU only"),
    ({"size": 2, "tensorParallel": 2}, 2, "gpus must be 0 or 1 with this multiNode"),
])
def test_what_a_group_cannot_do_yet_is_refused(chart, group, gpus, message) -> None:
    values = {**VALUES, "models": [{**VALUES["models"][1], "gpus": gpus, "multiNode": group}]}
    with pytest.raises(Exception, match=message):
        render(chart, values)


def test_leader_and_workers_hold_the_internal_credential(chart) -> None:
    """Both templates mount the internal token Secret and pass its file: the join handshake
    and the leader's routes check it, so a group whose pods lacked it would never form."""
    r = render(chart, VALUES)
    template = r.get("LeaderWorkerSet", NAME)["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        container = _container(pod)
        path = flag(container, "internal-token-file")
        assert path and path.startswith("/etc/pagoda/internal-auth/")
        mount = {m["name"]: m for m in container["volumeMounts"]}["internal-auth"]
        assert path.startswith(mount["mountPath"]) and mount["readOnly"]
        volume = {v["name"]: v for v in pod["spec"]["volumes"]}["internal-auth"]
        assert volume["secret"]["secretName"]
