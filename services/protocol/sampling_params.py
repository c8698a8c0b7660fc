"""Per-request sampling parameters: vLLM's field names, defaults and ranges, checked on creation.

The gateway maps OpenAI fields onto this; the engine resolves ``max_tokens=None`` ("up to the
context") once it knows the prompt length. Every bad value, a wrong type included, raises
``ValueError`` whose message starts with the field's name (the gateway's 400 points at it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from services.protocol.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_STOP_STRINGS = 64
# Counts and token ids above this are mistakes (no vocabulary or context is this large), and
# must be refused here: they would not even fit the engine wire format (msgpack, 64 bits).
MAX_INT32 = 2**31 - 1
MAX_STOP_TOKEN_IDS = 1024  # each is checked against every sampled token
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI documents 300)
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100], as OpenAI and vLLM
# As vLLM: 0 < T < this is raised to it. Smaller T overflows logits / T to inf in float32
# (and inf - inf = nan) while sampling at T = 0.01 is already greedy for practical purposes.
MIN_TEMPERATURE = 1e-2
# The range torch.Generator.manual_seed accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token of one request (one sequence; the engine fans out ``n``)."""

    n: int = 1
    presence_penalty: float = 0.0  # [-2, 2], on output tokens (OpenAI)
    frequency_penalty: float = 0.0  # [-2, 2], on output tokens (OpenAI)
    repetition_penalty: float = 1.0  # > 0, on prompt + output tokens (HF/vLLM); 1 = off
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off; -1 (vLLM's older spelling of off) is normalised to 0
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single str is accepted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N per generated token; 0 = only the chosen token's
    # top-N per prompt token (vLLM's extension; the first prompt token has none). Costs the
    # prompt's logits and skips the prefix cache for this request.
    prompt_logprobs: int | None = None
    # token id -> added to its logit before sampling; a list of [id, bias] pairs is accepted
    # (the msgpack wire form: its maps have string keys only).
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Guided decoding (vLLM's field); a dict (the wire's form) is accepted and converted.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._check_counts()
        self._check_floats()
        self._check_stops()
        self._check_logit_bias()
        self._check_flags()
        self._normalise()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _check_counts(self) -> None:
        _check_int("n", self.n, lo=1, hi=MAX_INT32)
        _check_int("top_k", self.top_k, lo=-1, hi=MAX_INT32)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=MAX_INT32)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)  # the context bounds it
            if self.min_tokens > self.max_tokens:
                raise ValueError(
                    f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
                )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX)

    def _check_floats(self) -> None:
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, -2.0, 2.0
        )
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True
        )
        self.temperature = _check_float("temperature", self.temperature, 0.0, math.inf)
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)

    def _check_stops(self) -> None:
        # Copies, so a caller mutating its own list later cannot change a running request.
        if isinstance(self.stop, str):
            stop = [self.stop]
        else:
            stop = _as_list("stop", self.stop, "a string or a list")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} entries, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop entries must be non-empty strings, got {s!r}")
        self.stop = stop
        ids = _as_list("stop_token_ids", self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, got {len(ids)}"
            )
        for t in ids:
            _check_int("stop_token_ids entry", t, lo=0, hi=MAX_INT32)
        self.stop_token_ids = ids

    def _check_logit_bias(self) -> None:
        raw = self.logit_bias
        if raw is None:
            return
        items = raw.items() if isinstance(raw, dict) else _as_list("logit_bias", raw, "a map")
        bias: dict[int, float] = {}
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"logit_bias entries must be [token_id, bias] pairs, got {item!r}")
            token, value = item
            _check_int("logit_bias token id", token, lo=0, hi=MAX_INT32)
            value = _check_float("logit_bias value", value, -math.inf, math.inf)
            bias[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}"
            )
        self.logit_bias = bias or None

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")  # noqa: TRY004

    def _normalise(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature=%g is below %g; raised to %g",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        if self.greedy:
            # As vLLM: greedy ignores the truncation knobs, so the sampler never applies them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0


def _as_list(name: str, value: object, kinds: str = "a list") -> list:
    """A copy of a list field; None is empty. Other iterables (a dict, a string of ids) are
    refused rather than iterated into something the client did not mean."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be {kinds}, got {type(value).__name__}")  # noqa: TRY004
    return list(value)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    # bool is an int subclass, but True as a count is always a client mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")  # noqa: TRY004
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value < lo or (lo_open and value == lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {value:g}")
    if value > hi:
        raise ValueError(f"{name} must be <= {hi:g}, got {value:g}")
    return value
