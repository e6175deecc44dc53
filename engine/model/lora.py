"""LoRA on the linear layers: each targeted layer adds its tokens' adapters' ``x @ A.T @ B.T`` to its output.

As in vLLM (its punica kernels, after Chen et al., 2023, arXiv:2310.18547), a layer holds the weights of
``max_loras`` adapter slots stacked, and one step's tokens may each use a different slot, or none (the base
model). Per slot with tokens, one "shrink" (``x @ A.T``, to the rank) and one "expand" (``@ B.T``, back to the
output features) run on those tokens' rows; the scaling is folded into ``B`` when a slot is filled. A fused layer
(``qkv_proj``, ``gate_up_proj``) stacks its parts' ``A`` along the rank and holds ``B`` block-diagonal, so that
its parts take one shrink and one expand too.

Two kernels do this: torch's products per slot with tokens (``addmm``, or ``index_select``/``index_add`` when the
step mixes slots), on any device; and on CUDA one Triton launch per half for all slots (``triton_lora``), over the
step's segments of tokens of one slot each.

Tensor parallelism needs no communication of its own: a column-parallel layer's ``B`` is split by output rows
like its weight, and a row-parallel layer's ``A`` by input columns, whose partial products its all-reduce sums
with the weight's (``(x_r @ A_r.T) @ B.T`` summed over ranks is ``x @ A.T @ B.T``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LoRAMapping:
    """Which slot each token of the step runs with, as the worker sets it before the forward pass.

    Attributes:
        groups: ``(slot, rows)`` per slot with tokens: ``rows`` a ``[n]`` int64 index of the step's tokens, or
            None when every token of the step uses that slot. Empty: no token uses an adapter.
        segments: for the Triton kernel (else None): ``[S, 3]`` int32, ``(first token, tokens, slot)`` per run of
            consecutive tokens of one slot.
        max_segment_len: the longest segment's tokens.
        graph_rows: with CUDA graphs (``allocate_graph_rows``), the segments their decode steps read:
            ``[max batch, 3]`` int32, a static buffer with one row per token (``(t, 1, slot)``, or ``(t, 0, 0)``
            for the base model and padding), rewritten in place before each replay (``update``).
    """

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    segments: torch.Tensor | None = None
    max_segment_len: int = 0
    graph_rows: torch.Tensor | None = None
    # On CUDA the rows are written into pinned memory and copied without waiting for the work queued before (a
    # copy from pageable memory would, and undo async scheduling's overlap); the event marks the last copy out
    # of it, which must be done before it is written again.
    _host_rows: torch.Tensor | None = field(default=None, repr=False)
    _rows_copied: torch.cuda.Event | None = field(default=None, repr=False)

    def allocate_graph_rows(self, max_batch_size: int, device: torch.device) -> None:
        """Allocate ``graph_rows`` for decode batches of up to ``max_batch_size`` tokens on ``device``."""
        self.graph_rows = torch.zeros(max_batch_size, 3, dtype=torch.int32, device=device)
        if device.type == "cuda":
            self._host_rows = torch.zeros(max_batch_size, 3, dtype=torch.int32, pin_memory=True)

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def update(self, token_slots: np.ndarray, device: torch.device, segments: bool) -> None:
        """Set the map from each token's slot (``token_slots`` ``[T]`` integers, -1 for the base model);
        ``segments``: the Triton kernel's too, and the CUDA graphs' rows when they are allocated."""
        self.groups = []
        for slot in np.unique(token_slots[token_slots >= 0]).tolist():
            rows = np.flatnonzero(token_slots == slot)
            self.groups.append((slot, None if len(rows) == len(token_slots) else
                                torch.from_numpy(rows).to(device, non_blocking=True)))
        self.segments, self.max_segment_len = None, 0
        if segments and self.groups:
            starts = np.flatnonzero(np.diff(token_slots, prepend=-2))  # where the slot changes
            lengths = np.diff(starts, append=len(token_slots))
            keep = token_slots[starts] >= 0
            runs = np.stack([starts[keep], lengths[keep], token_slots[starts][keep]], axis=1).astype(np.int32)
            self.segments = torch.from_numpy(runs).to(device, non_blocking=True)
            self.max_segment_len = int(lengths[keep].max())
        if self.graph_rows is not None and len(token_slots) <= len(self.graph_rows):
            self._write_graph_rows(token_slots)

    def _write_graph_rows(self, token_slots: np.ndarray) -> None:
        host = self._host_rows
        if host is None:
            host = torch.empty_like(self.graph_rows)  # on the CPU (tests): a plain copy
        elif self._rows_copied is not None:
            self._rows_copied.synchronize()  # the previous step's copy has left the buffer (long done, as a rule)
        rows = host.numpy()
        rows[:, 0] = np.arange(len(rows))
        rows[:, 1:] = 0
        rows[:len(token_slots), 1] = token_slots >= 0
        rows[:len(token_slots), 2] = np.maximum(token_slots, 0)
        self.graph_rows.copy_(host, non_blocking=self._host_rows is not None)
        if self._host_rows is not None:
            self._rows_copied = torch.cuda.Event()
            self._rows_copied.record()

    def capture_rows(self, batch_size: int) -> None:
        """Point the layers at the first ``batch_size`` graph rows, one token each, while a graph is captured."""
        self.segments, self.max_segment_len = self.graph_rows[:batch_size], 1


class LoRALayer:
    """The adapter slots of one linear layer, on this rank.

    Args:
        mapping: the step's token -> slot map, shared by every layer.
        num_slots: ``max_loras``.
        max_rank: ``max_lora_rank``; an adapter of a smaller rank fills the first rows of its slot, zeros after.
        input_size: the layer's input features on this rank.
        output_sizes: the layer's output features on this rank, per part (one entry unless fused).
        dtype, device: the activations'.
    """

    def __init__(self, mapping: LoRAMapping, num_slots: int, max_rank: int, input_size: int,
                 output_sizes: list[int], dtype: torch.dtype, device: torch.device) -> None:
        self.mapping = mapping
        self.max_rank = max_rank
        self.output_sizes = output_sizes
        num_parts = len(output_sizes)
        # [slots, parts * rank, in] and [slots, out, parts * rank]: part i's A in rows i*R.., its B in the
        # block of its output rows and those columns.
        self.a = torch.zeros(num_slots, num_parts * max_rank, input_size, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, sum(output_sizes), num_parts * max_rank, dtype=dtype, device=device)

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Fill part ``part`` of slot ``slot``: ``a`` ``[r, input_size]`` and ``b`` ``[output_sizes[part], r]``, this
        rank's slices, the scaling already in ``b``.

        Raises:
            ValueError: as ``check_part``.
        """
        self.check_part(part, a, b)
        rank, start = a.shape[0], part * self.max_rank
        offset = sum(self.output_sizes[:part])
        self.a[slot, start:start + rank] = a
        self.b[slot, offset:offset + self.output_sizes[part], start:start + rank] = b

    def check_part(self, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Raises: ValueError: ``a`` and ``b`` (as ``set_part`` takes them) do not fit a slot: a rank above
        ``max_rank``, other features, a B whose rank is not A's."""
        rank = a.shape[0]
        if (a.dim() != 2 or b.dim() != 2 or rank > self.max_rank or a.shape[1] != self.a.shape[2]
                or tuple(b.shape) != (self.output_sizes[part], rank)):
            raise ValueError(f"LoRA weights of shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit a slot of rank "
                             f"{self.max_rank}, {self.a.shape[2]} inputs and {self.output_sizes[part]} outputs")

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` ``[T, out]`` plus each token's adapter applied to ``x`` ``[T, in]`` (in place; returns ``out``)."""
        if (segments := self.mapping.segments) is not None:
            from pagedserve.engine.model.triton_lora import sgmv  # imports Triton: only where it runs

            shrunk = torch.empty(x.shape[0], self.a.shape[1], dtype=torch.float32, device=x.device)
            sgmv(x, self.a, shrunk, segments, self.mapping.max_segment_len, accumulate=False)
            sgmv(shrunk, self.b, out, segments, self.mapping.max_segment_len, accumulate=True)
            return out
        for slot, rows in self.mapping.groups:
            a, b = self.a[slot], self.b[slot]
            if rows is None:
                out.addmm_(x @ a.t(), b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out
