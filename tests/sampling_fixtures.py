"""The reference distributions of the sampler and rejection sampler tests (their metadata and bitmasks are
``benchmarks.step_metadata``'s)."""

from __future__ import annotations

import numpy as np
import torch


def expected_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                          top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Reference: the filtered, renormalised distribution, one filter after the other."""
    def normalise(p: np.ndarray) -> np.ndarray:
        return p / p.sum()

    probs = normalise(np.exp(logits.double().numpy() / temperature))
    order = np.argsort(-probs)
    if top_k:
        probs[order[top_k:]] = 0.0
        probs = normalise(probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    probs[order[mass_before >= top_p]] = 0.0
    probs = normalise(probs)
    probs[probs < min_p * probs.max()] = 0.0
    return normalise(probs)
