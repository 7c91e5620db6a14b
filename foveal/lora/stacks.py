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
    """What every stack of one model reads: the current step's batch (None: no adapter row, skip), and
    on CUDA the side stream the shrinks run on."""

    __slots__ = ("batch", "_side")

    def __init__(self):
        self.batch: LoRABatch | None = None
        self._side = None

    def side_stream(self, device):
        if self._side is None:  # made by the first (eager) step, before any graph capture
            self._side = torch.cuda.Stream(device)
        return self._side


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

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The linear's output plus each row's adapter delta (the step's batch must be set).

        On CUDA the shrink runs on a side stream while the base GEMM runs (it reads only x), and the
        expand adds into the GEMM's output after both: a small kernel hides behind a big one, in eager
        steps and in captured graphs alike (the side stream forks from and joins the main one)."""
        from foveal.layers.linear import linear

        batch = self.state.batch
        if x.is_cuda:
            from foveal.lora.ops_triton import lora_expand, lora_shrink

            main = torch.cuda.current_stream(x.device)
            side = self.state.side_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                h = lora_shrink(x, self.A, batch.perm, batch.offs, self.num_slots)
            y = linear(x, weight, bias)
            main.wait_stream(side)
            lora_expand(h, y, self.B, batch.perm, batch.offs, self.num_slots)
            return y
        return lora_add_grouped(x, linear(x, weight, bias), self.A, self.B, batch.perm, batch.offs)


def lora_add_grouped(x, y, A, B, perm, offs) -> torch.Tensor:
    """The grouped-GEMM form (every group, the base one multiplying its zero weights): y in place."""
    xs = x.index_select(0, perm).to(A.dtype)
    h = torch._grouped_mm(xs, A.transpose(1, 2), offs)
    d = torch._grouped_mm(h, B.transpose(1, 2), offs)
    return y.index_add_(0, perm, d.to(y.dtype))
