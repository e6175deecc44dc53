"""Pooling: a decoder's hidden states turned into one vector per prompt (``--runner pooling``, vLLM's names).

``PoolerConfig`` is the server's choice (``--pooler-config``): which positions are pooled and whether the vector is
normalised. ``PoolingParams`` is one request's (``/v1/embeddings``' ``dimensions``), carried on the request as
vLLM's ``pooling_params``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

from pagedserve.engine.errors import InvalidRequestError

#: ``pooling_type``: the last token's hidden state (the default for decoders: only it has seen the whole prompt),
#: the mean over the prompt's tokens, or the first token's (BERT's [CLS]).
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """How the pooling runner makes a prompt's vector: ``pooling_type`` (``POOLING_TYPES``) over the last layer's
    hidden states after the final norm, then L2 normalisation when ``normalize``."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, value: Mapping | str | None) -> PoolerConfig:
        """``--pooler-config``: a JSON object (a mapping in YAML) with vLLM's keys, or None for the defaults.

        Raises:
            ValueError: not JSON or not an object, an unknown key, a pooling type outside ``POOLING_TYPES``,
                a ``normalize`` that is not a bool; the message names the key.
        """
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"pooler_config is not valid JSON: {err}") from err
        if not isinstance(value, Mapping):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise ValueError(f"pooler_config: unknown keys {', '.join(unknown)}; known keys: {', '.join(known)}")
        config = cls(**value)
        if config.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {POOLING_TYPES}, got {config.pooling_type!r}")
        if not isinstance(config.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {config.normalize!r}")
        return config


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's parameters (vLLM's ``PoolingParams``).

    Attributes:
        dimensions: keep the vector's first ``dimensions`` values (Matryoshka representation learning,
            Kusupati et al. 2022), before normalisation; None = all ``hidden_size``.
    """

    dimensions: int | None = None

    def check(self, hidden_size: int, matryoshka_dimensions: list[int] | None, is_matryoshka: bool) -> None:
        """Refuse ``dimensions`` the model was not trained to be cut to.

        Args:
            hidden_size: the vector's full length.
            matryoshka_dimensions: the lengths the model allows (its config's ``matryoshka_dimensions``), if listed.
            is_matryoshka: whether the model was trained to be cut (its config's ``is_matryoshka``, or a list above).

        Raises:
            InvalidRequestError: (``dimensions``) when the model is not Matryoshka, or the length is not one it allows.
        """
        if self.dimensions is None:
            return
        if not is_matryoshka:
            raise InvalidRequestError("this model does not support Matryoshka representations: its vectors cannot be "
                                      "cut to fewer dimensions without losing their meaning", "dimensions")
        allowed = matryoshka_dimensions or range(1, hidden_size + 1)
        if self.dimensions not in allowed:
            listed = matryoshka_dimensions or f"1 to {hidden_size}"
            raise InvalidRequestError(f"dimensions must be one of {listed}, got {self.dimensions}", "dimensions")
