"""Engine configuration: one validated dataclass; the server's CLI flags map onto it one to one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, TypeVar

import torch

from services.common.cli import flag, json_object
from services.common.default_model import default_model_dir, is_converted
from services.common.model_files import ModelFiles
from services.engine.cpu_ops.isa import has_amx
from services.engine.kv_connector.config import DEFAULT_TIMEOUT_S, KVTransferConfig
from services.engine.kv_connector.registry import TIERS
from services.engine.kv_offload.secret import load_store_secret
from services.engine.lora.request import LoRAModule
from services.engine.quantization import SCHEMES
from services.engine.scheduler import SchedulingPolicy
from services.protocol.block_hash import HashAlgorithm

E = TypeVar("E", bound=Enum)

# The tier flags PagodaTiersConnector's kv_connector_extra_config may set, and their types.
_NUMBER = (int, float)
_TIER_KEYS = {"kv_offloading_size": _NUMBER, "kv_store_url": str, "kv_store_timeout_s": _NUMBER}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- --speculative-config -----------------------------------------------------------------------
# vLLM's JSON object, read and checked once, at start. Keys (vLLM's names): ``method``
# (``ngram``: prompt lookup; ``draft_model``: a smaller model of the target's tokenizer, served
# inside the same engine), ``num_speculative_tokens`` (drafts per step), ``prompt_lookup_min`` /
# ``prompt_lookup_max`` (ngram only: the lengths of the suffix looked up; both default to 5 when
# neither is given, one given sets the other), ``model`` (the draft's HF directory; giving it
# without ``method`` means ``draft_model``), ``disable_by_batch_size`` (no new drafts while more
# requests than that are running) and ``draft_tensor_parallel_size`` (1 only: the draft runs
# unsharded on rank 0). Anything else is refused with a ``ValueError`` naming the key
# (``speculative_config.<key>``), which the engine server turns into exit status 2 and
# ``LLM(...)`` raises: an unknown key or method, a number that is not a positive integer, a
# lookup range upside down, a key of the other method (``SpeculativeConfig.parse``: the JSON
# alone), a draft directory without ``config.json``, or a draft whose vocabulary differs from
# the target's (``check_draft_matches``: the files, once the target is known). The feature
# itself is ``spec_decode``'s, which the runner builds through ``features.registry``.
_SPEC = "speculative_config"
_DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is given
_TOKENIZER_FILE = "tokenizer.json"


class SpecMethod(StrEnum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size", "draft_tensor_parallel_size")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's HF directory
    prompt_lookup_min: int = 0  # ngram: shortest suffix looked up (0 for draft_model)
    prompt_lookup_max: int = 0  # ngram: longest suffix looked up
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a JSON text (the flag), a dict (``LLM(speculative_config={...})``) or itself."""
        if isinstance(value, SpeculativeConfig):
            return value
        return cls._from_mapping(json_object(value, _SPEC))

    @classmethod
    def _from_mapping(cls, raw: Mapping[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"{_SPEC}.{unknown[0]} is not a known key (known: "
                             f"{', '.join(_KEYS)})")
        method = _method(raw)
        k = _positive(raw, "num_speculative_tokens", required=True)
        disable = _positive(raw, "disable_by_batch_size")
        tp = _positive(raw, "draft_tensor_parallel_size")
        if tp not in (None, 1):
            raise ValueError(f"{_SPEC}.draft_tensor_parallel_size must be 1 (the draft runs "
                             f"unsharded on rank 0), got {tp}")
        if method is SpecMethod.NGRAM:
            for key in ("model", "draft_tensor_parallel_size"):
                if raw.get(key) is not None:
                    raise ValueError(f"{_SPEC}.{key} applies to method draft_model, not ngram")
            low, high = _lookup_range(raw)
            return cls(method, k, None, low, high, disable)
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if raw.get(key) is not None:
                raise ValueError(f"{_SPEC}.{key} applies to method ngram, not draft_model")
        return cls(method, k, _draft_dir(raw.get("model")), 0, 0, disable)

    def drafts_at(self, num_running: int) -> bool:
        """Whether new drafts are proposed while ``num_running`` requests run."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def to_json(self) -> str:
        raw = {"method": str(self.method), "num_speculative_tokens": self.num_speculative_tokens}
        if self.method is SpecMethod.NGRAM:
            raw |= {"prompt_lookup_min": self.prompt_lookup_min,
                    "prompt_lookup_max": self.prompt_lookup_max}
        else:
            raw["model"] = self.model
        if self.disable_by_batch_size is not None:
            raw["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(raw)


def check_draft_matches(spec: SpeculativeConfig, target_dir: str | Path | None) -> None:
    """A draft model must be a model directory and share the target's vocabulary (when the
    target's directory is known): the same ``vocab_size`` and, when both directories carry a
    ``tokenizer.json``, the same token -> id map. ``ValueError`` naming
    ``speculative_config.model`` otherwise."""
    if spec.method is not SpecMethod.DRAFT_MODEL:
        return
    draft = Path(spec.model)
    try:
        d_vocab = ModelFiles.read(draft).config.get("vocab_size")
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"{_SPEC}.model: {exc}") from None
    if target_dir is None:
        return
    target = Path(target_dir)
    t_vocab = ModelFiles.read(target).config.get("vocab_size")
    if d_vocab != t_vocab:
        raise ValueError(f"{_SPEC}.model: the draft's vocabulary ({d_vocab} tokens) differs "
                         f"from the target's ({t_vocab} tokens)")
    d_tok, t_tok = draft / _TOKENIZER_FILE, target / _TOKENIZER_FILE
    if d_tok.is_file() and t_tok.is_file() and _vocab(d_tok) != _vocab(t_tok):
        raise ValueError(f"{_SPEC}.model: the draft's tokenizer maps tokens to other ids than "
                         "the target's")


def _vocab(path: Path) -> dict[str, int]:
    raw = json.loads(path.read_text())
    added = raw.get("added_tokens") or []
    vocab = dict((raw.get("model") or {}).get("vocab") or {})
    vocab.update({t.get("content"): t.get("id") for t in added if isinstance(t, dict)})
    return vocab


def _method(raw: Mapping[str, Any]) -> SpecMethod:
    method = raw.get("method")
    if method is None:
        if raw.get("model") is None:
            raise ValueError(f"{_SPEC}.method is required (ngram or draft_model) when no "
                             "model is given")
        return SpecMethod.DRAFT_MODEL  # as vLLM: a model alone names a draft model
    try:
        return SpecMethod(method)
    except ValueError:
        allowed = ", ".join(m.value for m in SpecMethod)
        raise ValueError(f"{_SPEC}.method must be one of {allowed}, got {method!r}") from None


def _positive(raw: Mapping[str, Any], key: str, required: bool = False) -> int | None:
    value = raw.get(key)
    if value is None:
        if required:
            raise ValueError(f"{_SPEC}.{key} is required")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{_SPEC}.{key} must be a positive integer, got {value!r}")
    return value


def _lookup_range(raw: Mapping[str, Any]) -> tuple[int, int]:
    low = _positive(raw, "prompt_lookup_min")
    high = _positive(raw, "prompt_lookup_max")
    if low is None and high is None:
        return _DEFAULT_LOOKUP, _DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    if low > high:
        raise ValueError(f"{_SPEC}.prompt_lookup_min={low} must be <= "
                         f"prompt_lookup_max={high}")
    return low, high


def _draft_dir(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise ValueError(f"{_SPEC}.model is required for method draft_model (the draft's HF "
                         "directory)")
    return str(Path(model))


@dataclass(slots=True)
class EngineConfig:
    model: str | None = flag(
        None, help="HF model directory (default: the default model, converted on first use)"
    )
    served_model_name: str | None = flag(
        None, help="the model name clients use (default: the directory's name)"
    )
    dtype: str = flag(
        "auto", help="float32, bfloat16 or float16; auto = float32 on the CPU, bfloat16 on a GPU"
    )
    device: str = flag("auto", help="cpu, cuda or cuda:N; auto = cuda when available")
    block_size: int = flag(16, help="tokens per KV block")
    num_blocks: int | None = flag(
        None, help="KV blocks in the pool (default: sized from --kv-cache-memory)"
    )
    kv_cache_memory: int | None = flag(
        None, help="bytes for the KV pool (default: 2 GiB on the CPU, 85% of free GPU memory, "
        "less what the enabled features hold back)"
    )
    max_num_seqs: int = flag(128, help="requests in one batch")
    scheduling_policy: SchedulingPolicy = flag(
        SchedulingPolicy.FCFS, help="fcfs (arrival order) or priority (a request's priority: "
        "lower first, ties by arrival; preemption takes the least urgent), as vLLM's"
    )
    max_num_batched_tokens: int | None = flag(
        None,
        help="tokens per step; longer prompts are prefilled in chunks (default: 1024 on a GPU; "
        "on the CPU 256; with AMX 2048 for bfloat16, 1024 otherwise; or max_num_seqs if larger)",
    )
    max_model_len: int | None = flag(
        None, help="context limit (default: the model's max_position_embeddings)"
    )
    enable_prefix_caching: bool = flag(True, help="automatic prefix caching")
    attention_backend: str | None = flag(
        None,
        help="cpu, torch or triton (default: triton on CUDA; on the CPU the C++ kernels when "
        "built, else torch)",
    )
    enforce_eager: bool = flag(
        False, help="no CUDA graphs: decode steps launch their kernels one by one (as vLLM)"
    )
    hash_algorithm: HashAlgorithm = flag(
        HashAlgorithm.XXH3_128, help="the prefix-cache block hash (sha256 is cut to 128 bits)"
    )
    cpu_threads: int | None = flag(
        None,
        help="threads for the CPU math, per rank (default: $OMP_NUM_THREADS, else every core "
        "this process may use: its affinity, capped by a cgroup CPU quota; divided among the "
        "tensor-parallel ranks)",
    )
    speculative_config: SpeculativeConfig | None = flag(
        None,
        parse=SpeculativeConfig.parse,
        metavar="JSON",
        help="speculative decoding, vLLM's JSON object: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4} (prompt lookup) or "
        "{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}; also "
        "prompt_lookup_min, disable_by_batch_size (no new drafts while more requests than that "
        "run). Outputs keep the target model's distribution (default: off)",
    )
    async_scheduling: bool | None = flag(
        None,
        help="schedule and prepare step n+1 while step n runs (vLLM's async scheduling); "
        "steps of requests with structured outputs, penalties, min_tokens or prompt_logprobs "
        "still run one after another, and tensor-parallel engines always do (default: on with "
        "CUDA, off on the CPU, as measured)",
    )
    tensor_parallel_size: int = flag(
        1,
        help="model ranks (GPUs) the model is split over, Megatron style: one process each, "
        "over NCCL on GPUs (gloo on the CPU)",
    )
    pipeline_parallel_size: int = flag(
        1, help="pipeline stages the layers are split over (vLLM's flag): one process each "
        "(times tensor_parallel_size), activations passed over gloo; CPU only for now")
    # A node group: ranks in several pods, each started on its own (``parallel.node_group``);
    # in a LeaderWorkerSet these come from its environment (LWS_GROUP_SIZE, ...).
    nnodes: int = flag(
        1, help="pods (nodes) the engine's ranks span: one rank each "
        "(pipeline_parallel_size x tensor_parallel_size equal to it), or one pipeline stage "
        "of tensor_parallel_size ranks each (pipeline_parallel_size equal to it) "
        "(default: $LWS_GROUP_SIZE, else 1)")
    node_rank: int = flag(
        0, help="this pod's place in its node group: 0 is the leader (serves HTTP, joins the "
        "router), others are workers that join it (default: $LWS_WORKER_INDEX, else 0)")
    master_addr: str = flag(
        "127.0.0.1", help="the leader's address, where worker nodes join it "
        "(default: $LWS_LEADER_ADDRESS, else 127.0.0.1)")
    master_port: int = flag(29501, help="the leader's rendezvous port for worker nodes")

    quantization: str | None = flag(
        None,
        help="the checkpoint's quantization method (vLLM's flag): read from its config.json "
        "quantization_config; set, it must name the same (compressed-tensors); a checkpoint is "
        "never quantized at load (default: the checkpoint's)",
    )

    enable_lora: bool = flag(
        False, help="serve LoRA adapters of the model (vLLM's flag); off, the engine has none"
    )
    max_loras: int = flag(1, help="distinct LoRA adapters in one step (their device slots)")
    max_lora_rank: int = flag(16, help="the highest LoRA rank an adapter may have")
    max_lora_file_bytes: int | None = flag(
        None, help="the largest adapter_model.safetensors read (default: every LoRA target of "
        "the model at max_lora_rank in float32, plus the header)"
    )
    max_cpu_loras: int | None = flag(
        None, help="LoRA adapters kept in host memory, LRU (default: max_loras)"
    )
    lora_modules: tuple[LoRAModule, ...] = flag(
        (),
        repeat=True,
        many=True,
        parse=LoRAModule.parse,
        metavar="NAME=PATH",
        help="adapters loaded at start: name=path, or JSON {\"name\", \"path\", "
        "\"base_model_name\"} (several after one flag, or the flag repeated)",
    )
    kv_offloading_size: float | None = flag(
        None,
        help="GiB of host memory for KV blocks evicted from the pool (vLLM's flag): full "
        "blocks are written through as they fill, and a prefix the pool lost is copied back "
        "from there (default: off)",
    )
    kv_offloading_backend: str = flag(
        "native", help="the host tier's implementation: native (the engine's own copy thread)"
    )
    kv_store_url: str | None = flag(
        None,
        help="redis:// or rediss:// URL of the KV store shared by every engine of the model (a "
        "Redis/Valkey instance of its own, maxmemory + allkeys-lru); blocks are written to it "
        "and a prefix no local tier holds is loaded from it. An engine starts without it when "
        "it does not answer, and uses it once it does (default: off)",
    )
    kv_store_timeout_s: float = flag(
        0.5, help="the shared KV store's socket timeout: slower, the block is recomputed"
    )
    kv_store_secret_file: str | None = flag(
        None,
        metavar="PATH",
        help="file holding the KV store's MAC key, a secret shared by every engine of the "
        "model (at least 16 bytes): values are authenticated with it, and one written without "
        "it is a miss (default: $PAGODA_KV_STORE_SECRET; kv_store_url needs one of them)",
    )
    kv_transfer_config: KVTransferConfig | None = flag(
        None,
        parse=KVTransferConfig.parse,
        metavar="JSON",
        help="KV connectors, vLLM's JSON object: {\"kv_connector\": NAME, \"kv_role\": "
        "\"kv_producer\" | \"kv_consumer\" | \"kv_both\", \"kv_connector_extra_config\": "
        "{...}}; also kv_transfer_timeout (seconds a finished request's blocks may be held "
        "for sending). Connectors: PagodaTiersConnector (the KV tiers; extra keys "
        "kv_offloading_size, kv_store_url, kv_store_timeout_s, as the flags), "
        "PagodaPDConnector (P/D over TCP), PagodaStorePDConnector (P/D through the KV store) "
        "and MultiConnector ({\"connectors\": [...]}, tried in order). With the tier flags, the "
        "tiers come first (default: the tier flags' connector, if any)",
    )

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        # Refused here, not at the first request's hasher: a bad name would start cleanly and
        # then fail every request with a 500.
        self.hash_algorithm = _enum(HashAlgorithm, self.hash_algorithm, "hash_algorithm")
        self.scheduling_policy = _enum(SchedulingPolicy, self.scheduling_policy,
                                       "scheduling_policy")
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            _require_positive(name, getattr(self, name))
        self._check_nodes()
        for name in ("num_blocks", "kv_cache_memory", "max_model_len", "cpu_threads",
                     "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self._default_step_tokens()
        self._check_lora()
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
            self._merge_tier_settings(self.kv_transfer_config)
        if self.quantization is not None and self.quantization not in SCHEMES:
            raise ValueError(f"quantization must be one of {sorted(SCHEMES)}, got "
                             f"{self.quantization!r}")
        self._check_kv_tiers()
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
            self._check_speculation(self.speculative_config)
        if self.kv_tiers_enabled:  # what the tiers cannot serve yet: refused at start
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_offloading_size / kv_store_url are not supported with "
                                 "tensor_parallel_size > 1 yet")
            spec = self.speculative_config
            if spec is not None and spec.method is SpecMethod.DRAFT_MODEL:
                raise ValueError("kv_offloading_size / kv_store_url are not supported with a "
                                 "draft model yet (its KV is not offloaded); ngram works")

    def _check_nodes(self) -> None:
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        _require_positive("nnodes", self.nnodes)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1} (nnodes={self.nnodes}), "
                             f"got {self.node_rank!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port!r}")
        if self.nnodes > 1:
            self._check_node_layout()

    def _check_node_layout(self) -> None:
        """A node group holds one rank per pod, or one pipeline stage of T ranks per pod (the
        pod's ranks then are one tensor-parallel group: ``parallel.node_group``); anything else
        (a stage split over pods, several stages in a pod) is refused, naming the flags."""
        pp, tp, n = self.pipeline_parallel_size, self.tensor_parallel_size, self.nnodes
        if pp * tp == n or pp == n:
            return
        raise ValueError(
            f"--pipeline-parallel-size {pp} x --tensor-parallel-size {tp} ranks do not fit "
            f"--nnodes {n} pods: a node group holds one rank per pod (pipeline x tensor "
            f"parallel = nnodes) or one pipeline stage of tensor_parallel_size ranks per pod "
            f"(pipeline parallel = nnodes)")

    def _check_pipeline(self) -> None:
        """What pipeline stages cannot serve yet: refused at start, naming the flag."""
        if self.torch_device().type == "cuda":
            raise ValueError("pipeline_parallel_size > 1 runs on the CPU only for now "
                             "(--device cpu)")
        refused = {"enable_lora": self.enable_lora,
                   "speculative_config": self.speculative_config is not None,
                   "kv_transfer_config": self.kv_transfer_config is not None,
                   "kv_offloading_size": self.kv_offloading_size is not None,
                   "kv_store_url": self.kv_store_url is not None}
        for name, on in refused.items():
            if on:
                raise ValueError(f"{name} is not supported with pipeline_parallel_size > 1 yet")

    @property
    def world_size(self) -> int:
        """Every model rank of the engine: each pipeline stage's tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """The ranks in each pod (they share its cores): 1, or tensor_parallel_size when each
        pod is a pipeline stage."""
        return self.world_size // self.nnodes

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            _require_positive(name, getattr(self, name))
        if self.max_lora_file_bytes is not None:
            _require_positive("max_lora_file_bytes", self.max_lora_file_bytes)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        names = [m.name for m in self.lora_modules]
        if len(names) != len(set(names)):
            raise ValueError(f"lora_modules names must be unique, got {names}")

    def _check_kv_tiers(self) -> None:
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float))
                                 or not size > 0):
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {size!r}")
        if self.kv_offloading_backend != "native":
            raise ValueError("kv_offloading_backend must be 'native', got "
                             f"{self.kv_offloading_backend!r}")
        if self.kv_store_url is not None and not self.kv_store_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_store_url must be a redis:// or rediss:// URL, got "
                             f"{self.kv_store_url!r}")
        if self.kv_tiers_enabled and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size / kv_store_url need enable_prefix_caching")
        if not self.kv_store_timeout_s > 0:
            raise ValueError(f"kv_store_timeout_s must be > 0, got {self.kv_store_timeout_s!r}")
        if self.kv_store_url is not None:  # at start, not after the model loaded
            load_store_secret(self.kv_store_secret_file)

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_store_url is not None

    def _merge_tier_settings(self, transfer: KVTransferConfig) -> None:
        """The tiers' extra config sets the tier flags it names: the tiers read one place."""
        named = [leaf for leaf in transfer.leaves() if leaf.kv_connector == TIERS]
        if len(named) > 1:
            raise ValueError(f"kv_transfer_config.kv_connector names {TIERS} more than once")
        where = "kv_transfer_config.kv_connector_extra_config"
        for key, value in named[0].kv_connector_extra_config.items() if named else ():
            kind = _TIER_KEYS.get(key)
            if kind is None:
                raise ValueError(f"{where}.{key} is not a key of {TIERS} (known: "
                                 f"{', '.join(_TIER_KEYS)})")
            if isinstance(value, bool) or not isinstance(value, kind):
                wanted = "number" if kind is _NUMBER else "string"
                raise ValueError(f"{where}.{key} must be a {wanted}, got {value!r}")  # noqa: TRY004
            setattr(self, key, value)
        if named and not self.kv_tiers_enabled:
            raise ValueError(f"{where}: {TIERS} needs kv_offloading_size or kv_store_url "
                             "(there, or as flags)")

    def kv_connector_specs(self) -> list[KVTransferConfig]:
        """The connectors to build, in order: the tiers (from their flags, unless
        kv_transfer_config names them), then kv_transfer_config's."""
        leaves = [] if self.kv_transfer_config is None else list(self.kv_transfer_config.leaves())
        if self.kv_tiers_enabled and all(leaf.kv_connector != TIERS for leaf in leaves):
            leaves.insert(0, KVTransferConfig(TIERS))
        return leaves

    @property
    def kv_transfer_timeout_s(self) -> float:
        t = self.kv_transfer_config
        return DEFAULT_TIMEOUT_S if t is None else t.kv_transfer_timeout

    def _check_speculation(self, spec: SpeculativeConfig) -> None:
        if spec.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(
                f"speculative_config.num_speculative_tokens={spec.num_speculative_tokens} "
                f"leaves no room in a step of max_num_batched_tokens="
                f"{self.max_num_batched_tokens}")
        # The default model's directory is known once converted (else LLMEngine checks).
        target = self.model or (default_model_dir() if is_converted(default_model_dir())
                                else None)
        check_draft_matches(spec, target)

    def check_target(self, model_path: str | Path) -> None:
        """What can only be checked once the target's directory is known (the default model,
        converted after this config was made): the draft model's vocabulary."""
        if self.speculative_config is not None:
            check_draft_matches(self.speculative_config, model_path)

    def _default_step_tokens(self) -> int:
        if self.torch_device().type == "cuda":
            return 1024
        # On the CPU a step of 256 new tokens already runs the projections at their full rate
        # (compute-bound, and oneDNN takes rows 256 at a time anyway), so a bigger step only
        # makes every prompt in it wait for all of them: under a burst of prompts, steps of 256
        # cut the mean time to first token by ~40% at the same throughput (README, CPU
        # serving). Never below max_num_seqs, or running requests past the budget would starve.
        # Intel Xeons with AMX are another matter (2-core Xeon, 2026-12-01, the model's 30
        # layers of weights in turn): oneDNN's bf16 products on the tiles run at 1.4-2.5
        # TFLOP/s up to ~1.5k rows depending on the shape, and at ~3 from 2k rows. Steps of
        # 2,048 tokens (vLLM's server default) prefilled the mixed workload's prompts 1.34x
        # faster than 512 and gave 598 tok/s against 560, with a lower mean TTFT; 4,096 was
        # slower. Their fp32 products (AVX-512) run ~10% faster at 1,024 rows than at 256:
        # 1,024-token steps gave +3% on the mixed workload and +4% with a shared prefix.
        if has_amx():
            return max(2048 if self.torch_dtype() == torch.bfloat16 else 1024, self.max_num_seqs)
        return max(256, self.max_num_seqs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def _enum(cls: type[E], value: object, name: str) -> E:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
