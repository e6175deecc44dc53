"""Per-request sampling parameters with vLLM / OpenAI semantics."""

from __future__ import annotations

import copy
import json
from array import array
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.errors import InvalidRequestError

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
#: Most ``stop`` strings a request may give, and the most characters in each. OpenAI allows 4 and evaluation
#: harnesses send a handful; each new output character is compared with the stop strings that end in it, and a
#: stream holds back the longest one's length - 1 characters, so these bound both.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 64, 1000
#: Most ``stop_token_ids`` a request may give (duplicates included): clients send an end-of-turn token or a
#: few; the list is read, deduplicated and checked against the vocabulary once per request.
MAX_STOP_TOKEN_IDS = 4096


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
            ``include_stop_str_in_output``); at most ``MAX_STOP_STRINGS`` of at most
            ``MAX_STOP_STRING_CHARS`` characters each.
        stop_token_ids: token ids that end the output (the token is kept); a list, tuple or set of at
            most ``MAX_STOP_TOKEN_IDS`` ids, held as a frozenset.
        max_tokens: most output tokens; None = up to the model's context length.
        min_tokens: EOS and stop tokens are ignored before this many output tokens.
        ignore_eos: keep generating past EOS.
        presence_penalty: OpenAI presence penalty in [-2, 2] over output tokens.
        frequency_penalty: OpenAI frequency penalty in [-2, 2] over output tokens.
        repetition_penalty: HF / CTRL repetition penalty in [0.01, 100] (1 = off) over
            prompt and output tokens (Keskar et al. 2019, arXiv:1909.05858).
        logit_bias: token id -> bias in [-100, 100] added to the logits.
        logit_bias_arrays: derived, not an argument: ``logit_bias`` as parallel arrays of token ids
            (int64, ``array("q")``) and biases (float32, ``array("f")``), built once here so that the worker
            wraps them as tensors without copying and the ``n`` completions share them; None without a bias.
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
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
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
    logit_bias_arrays: tuple[array, array] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self._check_stop_sizes()
        self.stop_token_ids = frozenset(map(int, self.stop_token_ids or ()))
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()
        self.logit_bias_arrays = self._make_logit_bias_arrays()

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of this request's ``n``: ``n = 1``; when ``seed`` is set,
        ``seed + index`` (vLLM's rule: siblings differ, yet each stays reproducible); ``prompt_logprobs``
        for completion 0 only (the prompt is the same for all).

        A shallow copy, not checked again: the children share this request's stop strings, stop token ids
        and logit bias, so fanning out costs the same whatever their size.

        Raises:
            ValueError: ``index`` outside ``[0, n)``.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"index must be in [0, {self.n}), got {index}")
        child = copy.copy(self)
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        if index > 0:
            child.prompt_logprobs = None
        return child

    def _check_stop_sizes(self) -> None:
        """Refuse too many, empty or too long stop strings, and too many stop token ids, before the ids are
        read one by one (a message quotes 40 characters at most)."""
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries, got "
                                      f"{len(self.stop_token_ids)}", "stop_token_ids")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                                      "stop")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(f"stop must be non-empty strings, got {stop!r:.40}", "stop")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"stop strings must have at most {MAX_STOP_STRING_CHARS} characters, "
                                          f"got one of {len(stop)}", "stop")

    def _make_logit_bias_arrays(self) -> tuple[array, array] | None:
        """``logit_bias_arrays``; raises ``InvalidRequestError`` for a token id outside [0, 2**63)."""
        if not self.logit_bias:
            return None
        try:
            token_ids = array("q", self.logit_bias)
        except OverflowError:
            token_ids = None
        if token_ids is None or min(token_ids) < 0:
            raise InvalidRequestError("logit_bias must be keyed by token ids in [0, 2**63)", "logit_bias")
        return token_ids, array("f", self.logit_bias.values())

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
        if min(self.stop_token_ids, default=0) < 0:
            raise InvalidRequestError(f"stop_token_ids must be non-negative token ids, got {min(self.stop_token_ids)}",
                                      "stop_token_ids")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1")
        check(self.min_tokens >= 0, "min_tokens", ">= 0")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              "min_tokens", f"<= max_tokens ({self.max_tokens})")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0")
        check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
              f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        bad_bias = next(((t, b) for t, b in (self.logit_bias or {}).items() if not -100.0 <= b <= 100.0), None)
        if bad_bias is not None:
            raise InvalidRequestError(f"logit_bias must be a map of token ids to biases in [-100, 100], got "
                                      f"{bad_bias[1]} for token {bad_bias[0]}", "logit_bias")
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
