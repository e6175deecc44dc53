"""Per-request sampling parameters with vLLM / OpenAI semantics."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

#: Samplers treat temperatures below this as greedy (argmax) decoding.
GREEDY_TEMPERATURE_EPS = 1e-5
#: Largest temperature: far above any useful one (OpenAI's maximum is 2), small enough that the logits
#: divided by it stay normal float32 numbers.
MAX_TEMPERATURE = 100.0
#: ``repetition_penalty``'s range: divides or multiplies float32 logits, which a penalty nearer 0 or
#: infinity would turn into 0 or infinity (NaN probabilities).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
#: ``seed``'s range, ``torch.Generator.manual_seed``'s: ``[-2**63, 2**64)``. Sibling ``i`` of ``n``
#: is seeded ``seed + i``, so the seed must leave room for ``n - 1`` more.
MIN_SEED, SEED_END = -(2**63), 2**64
#: ``top_k`` is held in int64 arrays; any value from the vocabulary size up means no limit.
MAX_TOP_K = 2**63 - 1


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``structured_outputs``): exactly one of the fields is set.

    Attributes:
        json: a JSON schema (a dict, or its JSON text) the output must be an instance of.
        regex: a regular expression the whole output must match (Rust ``regex`` syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in Lark or GBNF/EBNF syntax (llguidance's dialects).
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

    Raises:
        InvalidRequestError: (``structured_outputs``) none or more than one constraint set, or one
            of the wrong type.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError("structured_outputs must set exactly one of "
                                      f"{', '.join(_CONSTRAINTS)}; got {kinds or 'none'}", "structured_outputs")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs choice must be a non-empty list of strings",
                                      "structured_outputs")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs json is not valid JSON: {exc}",
                                          "structured_outputs") from exc
        if self.json is not None and not isinstance(self.json, dict):
            # Boolean schemas too: true is any JSON value (use json_object), false admits nothing.
            raise InvalidRequestError("structured_outputs json must be a JSON schema object, got "
                                      f"{type(self.json).__name__}", "structured_outputs")

    @property
    def kind(self) -> str:
        """The field that is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How to sample the output of one request.

    Attributes:
        n: number of completions for the prompt (>= 1).
        temperature: softmax temperature in [0, ``MAX_TEMPERATURE``]; 0 means greedy decoding.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables it, as does any value from the vocabulary
            size up to ``MAX_TOP_K``.
        min_p: drop tokens whose probability is below ``min_p`` x the top one, in [0, 1].
        seed: seeds a per-request generator so the output is reproducible
            whatever else is in the batch; in [-2**63, 2**64 - n] (``MIN_SEED``, ``SEED_END``).
        stop: strings that end the output when generated (not included unless
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the output (the token is kept).
        max_tokens: most output tokens; None = up to the model's context length.
        min_tokens: EOS and stop tokens are ignored before this many output tokens.
        ignore_eos: keep generating past EOS.
        presence_penalty: OpenAI presence penalty in [-2, 2] over output tokens.
        frequency_penalty: OpenAI frequency penalty in [-2, 2] over output tokens.
        repetition_penalty: HF / CTRL repetition penalty in [0.01, 100] (1 = off) over
            prompt and output tokens (Keskar et al. 2019, arXiv:1909.05858).
        logit_bias: token id -> bias in [-100, 100] added to the logits.
        logprobs: number of top logprobs per output token (0 = only the sampled one).
        prompt_logprobs: number of top logprobs per prompt token.
        skip_special_tokens: drop special tokens from the output text.
        include_stop_str_in_output: keep the matched stop string in the text.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar; None = free.

    Raises:
        InvalidRequestError: on any value outside its range (NaN and infinities included); ``param``
            names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise InvalidRequestError(f"{name} must be {allowed}, got {getattr(self, name)!r}", name)

        check(self.n >= 1, "n", ">= 1")
        # Written so that NaN fails every range (any comparison with it is false).
        check(self.temperature >= 0.0, "temperature", ">= 0")
        check(self.temperature <= MAX_TEMPERATURE, "temperature", f"<= {MAX_TEMPERATURE:g}")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(0 <= self.top_k <= MAX_TOP_K, "top_k", f"in [1, {MAX_TOP_K}], or 0 / -1 to disable")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(self.seed is None or (isinstance(self.seed, int) and MIN_SEED <= self.seed <= SEED_END - self.n),
              "seed", f"an integer in [-2**63, 2**64 - n] ({SEED_END - self.n} for n = {self.n})")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "non-negative token ids")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1")
        check(self.min_tokens >= 0, "min_tokens", ">= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens", f"<= max_tokens ({self.max_tokens})")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0")
        check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
              f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        check(all(-100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()),
              "logit_bias", "a map of token ids to biases in [-100, 100]")
        check(all(t >= 0 for t in (self.logit_bias or {})), "logit_bias", "keyed by non-negative token ids")
        check(self.logprobs is None or self.logprobs >= 0, "logprobs", ">= 0")
        # A grammar decides where a constrained output ends; it cannot be made to go on.
        check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
              "0 with structured output (the grammar decides where the output ends)")
        check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", ">= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
