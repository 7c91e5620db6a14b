"""The device side of LoRA for one linear: every slot's adapter weights, stacked, and the batched add.

A linear with n fused slices (q/k/v: 3) and ranks up to R keeps, for S slots plus one all-zero "base"
slot (index S, never written):

    A [S + 1, n*R, in]     rows j*R .. j*R + r_j - 1 of slot s: slice j's A (the rest zero)
    B [S + 1, out, n*R]    block-diagonal: slice j's rows x rank block j hold s_j * B_j (the rest zero)

so h = A[s] x and y += B[s] h apply every slice of the slot's adapter in two GEMMs, and a slice the
adapter leaves out (or a rank below R) contributes exact zeros. Writing a slot zeroes it first: an
adapter of rank 8 after one of rank 64 sees no stale rows.

A step's rows are grouped by slot (`LoRABatch`: perm lists the rows slot by slot, the base group last;
offs holds each group's end). On a CPU the add is two grouped GEMMs (`torch._grouped_mm`, one aten op
each, so recorded decode steps replay it) over all rows, the base group multiplying zeros; on CUDA two
Triton kernels (foveal/lora/ops_triton.py) whose blocks for the base group never start. Neither reads
the batch on the host, so the mapping is an input of a CUDA graph, not a constant baked into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRABatch:
    """One step's rows grouped by adapter slot (device tensors)."""

    perm: torch.Tensor  # [T] int64: row indices, slot 0's rows first, ..., the base group's last
    offs: torch.Tensor  # [S + 1] int32: cumulative ends of the groups (offs[S] == T)


class LoRAState:
    """What every stack of one model reads: the current step's batch (None: no adapter row, skip)."""

    __slots__ = ("batch",)

    def __init__(self):
        self.batch: LoRABatch | None = None


class LoRAStacks:
    def __init__(self, target, state: LoRAState, num_slots: int, max_rank: int, dtype, device):
        self.target = target
        self.state = state
        self.num_slots = num_slots
        self.rank = max_rank
        k = len(target.slices) * max_rank
        self.A = torch.zeros(num_slots + 1, k, target.in_features, dtype=dtype, device=device)
        self.B = torch.zeros(num_slots + 1, target.out_features, k, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.A.nbytes + self.B.nbytes

    def write(self, slot: int, pieces) -> None:
        """Put one adapter's pieces [(slice, A [r, in], scaled B [rows, r])] in `slot` (others: zero)."""
        A, B, R = self.A[slot], self.B[slot], self.rank
        A.zero_()
        B.zero_()
        for j, a, b in pieces:
            off, rows = self.target.slices[j]
            r = a.shape[0]
            A[j * R : j * R + r].copy_(a, non_blocking=True)
            B[off : off + rows, j * R : j * R + r].copy_(b, non_blocking=True)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter delta (y is the linear's output; updated in place)."""
        batch = self.state.batch
        if batch is None:
            return y
        if y.is_cuda:
            from foveal.lora.ops_triton import lora_add_triton

            lora_add_triton(x, y, self.A, self.B, batch.perm, batch.offs, self.num_slots)
            return y
        return lora_add_grouped(x, y, self.A, self.B, batch.perm, batch.offs)


def lora_add_grouped(x, y, A, B, perm, offs) -> torch.Tensor:
    """The grouped-GEMM form (every group, the base one multiplying its zero weights): y in place."""
    xs = x.index_select(0, perm).to(A.dtype)
    h = torch._grouped_mm(xs, A.transpose(1, 2), offs)
    d = torch._grouped_mm(h, B.transpose(1, 2), offs)
    return y.index_add_(0, perm, d.to(y.dtype))
