"""The pooling runner's last stage: each pooling request's prompt, chunk by chunk, into one vector."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.engine.pooling_params import PoolerConfig
from pagedserve.engine.worker.input_batch import CachedRequestState


class Pooler:
    """Pools the final hidden states (after the last norm) of each pooling request's prompt (``PoolerConfig``).

    A prompt may run in several chunks (chunked prefill): ``MEAN`` keeps the running float32 sum of its positions
    on the request's state, ``CLS`` its first position; a chunk that starts at position 0 (the first, or the first
    after a preemption) starts them again. The prompt's last chunk makes the vector: the last position (``LAST``),
    the mean or the first; its first ``dimensions`` values (Matryoshka); then L2-normalised when ``normalize``.
    """

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config

    def __call__(self, hidden_states: torch.Tensor, states: list[CachedRequestState], query_start_loc: np.ndarray,
                 chunk_starts: np.ndarray) -> dict[str, torch.Tensor]:
        """The vectors of the requests whose prompt this step completes.

        Args:
            hidden_states: ``[T, hidden_size]`` the step's final hidden states, rows as the step's tokens.
            states: the step's requests, by batch row.
            query_start_loc: ``[len(states) + 1]`` where each row's tokens start in ``hidden_states``.
            chunk_starts: ``[len(states)]`` the prompt position each row's tokens start at.

        Returns:
            request id -> ``[D]`` float32 CPU vector, for each request whose prompt's last token ran this step.
        """
        pooling_type = self.config.pooling_type
        vectors: dict[str, torch.Tensor] = {}
        for row, state in enumerate(states):
            chunk = hidden_states[int(query_start_loc[row]):int(query_start_loc[row + 1])]
            first = int(chunk_starts[row])
            if pooling_type == "MEAN":
                total = chunk.sum(dim=0, dtype=torch.float32)
                state.pooled = total if first == 0 else state.pooled + total
            elif pooling_type == "CLS" and first == 0:
                state.pooled = chunk[0].float()
            num_prompt = len(state.prompt_token_ids)
            if first + len(chunk) < num_prompt:
                continue
            if pooling_type == "LAST":
                vector = chunk[num_prompt - 1 - first].float()
            else:
                vector = state.pooled / num_prompt if pooling_type == "MEAN" else state.pooled
            state.pooled = None
            dimensions = state.pooling_params.dimensions if state.pooling_params is not None else None
            vector = vector[:dimensions]
            if self.config.normalize:
                vector = F.normalize(vector, dim=-1)
            vectors[state.req_id] = vector.cpu()
        return vectors
