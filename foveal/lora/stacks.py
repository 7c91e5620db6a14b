"""The device side of LoRA for one linear: every slot's adapter weights, stacked, and the batched add.

A linear with n fused slices (q/k/v: 3) and ranks up to R keeps, for S slots plus one all-zero "base"
slot (index S, never written; A has none on CUDA):

    A [S + 1, n*R, in]     rows j*R .. j*R + r_j - 1 of slot s: slice j's A (the rest zero)
    B [S + 1, out, n*R]    block-diagonal: slice j's rows x rank block j hold s_j * B_j (the rest zero)
                           (on a CPU stored transposed, [S + 1, n*R, out]: what its kernels read along)

so h = A[s] x and y += B[s] h apply every slice of the slot's adapter in two GEMMs, and a slice the
adapter leaves out (or a rank below R) contributes exact zeros. Writing a slot zeroes it first: an
adapter of rank 8 after one of rank 64 sees no stale rows.

A step's rows are grouped by slot (`LoRABatch`: perm lists the rows slot by slot, the base group last;
offs holds each group's end). On CUDA the slots' A live under the linear's weight (W_ext = [W; A_0;
...], no base slot): the step's GEMM over W_ext gives the base output and every slot's h, and one Triton
kernel (foveal/lora/ops_triton.py) adds each row's h_s @ B[s]^T into a fresh output. On a CPU the add is
one native call (cpu_lora.c, fp32: only adapter rows, only B's diagonal blocks read; recorded decode
steps replay it), or else two grouped GEMMs (`torch._grouped_mm`) over all rows, the base group
multiplying zeros. Nothing reads the batch on the host, so the mapping is an input of a CUDA graph, not
a constant baked into it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRABatch:
    """One step's rows grouped by adapter slot (device tensors)."""

    perm: torch.Tensor  # [T] int64: row indices, slot 0's rows first, ..., the base group's last
    offs: torch.Tensor  # [S + 1] int32: cumulative ends of the groups (offs[S] == T)


class LoRAStacks:
    def __init__(self, target, num_slots: int, max_rank: int, dtype, device, linear=None, fused=None):
        self.target = target
        self.num_slots = num_slots
        self.rank = max_rank
        k = len(target.slices) * max_rank
        self._bounds: torch.Tensor | None = None  # the slices' row bounds, for the CPU kernel
        self.W_ext = None
        # fused: the CUDA layout and kernel (None: on CUDA; tests run it on CPU in Triton's interpreter)
        if (torch.device(device).type == "cuda" if fused is None else fused) and linear is not None:
            # the slots' A stacked under the linear's weight, in one buffer (the weight becomes a view of
            # its first rows: base steps read exactly what they read before); one GEMM over it gives the
            # base output and every slot's h together
            out, inp = linear.weight.shape
            self.W_ext = torch.zeros(out + num_slots * k, inp, dtype=dtype, device=device)
            with torch.no_grad():
                self.W_ext[:out].copy_(linear.weight)
                linear.weight.data = self.W_ext[:out]
            self.A = self.W_ext[out:].view(num_slots, k, inp)
            bias = linear.bias
            self.bias_ext = (
                None if bias is None else torch.cat([bias.detach(), bias.new_zeros(num_slots * k)])
            )
        else:
            self.A = torch.zeros(num_slots + 1, k, target.in_features, dtype=dtype, device=device)
        # B as [S + 1, n*R, out] for the CPU kernels; [S + 1, out, n*R] for the CUDA one
        self.transposed = self.W_ext is None and torch.device(device).type == "cpu"
        shape = (k, target.out_features) if self.transposed else (target.out_features, k)
        self.B = torch.zeros(num_slots + 1, *shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.A.nbytes + self.B.nbytes  # (on CUDA, A is the part of W_ext past the weight)

    def write(self, slot: int, pieces) -> None:
        """Put one adapter's pieces [(slice, A [r, in], scaled B [rows, r])] in `slot` (others: zero)."""
        A, B, R = self.A[slot], self.B[slot], self.rank
        A.zero_()
        B.zero_()
        for j, a, b in pieces:
            off, rows = self.target.slices[j]
            r = a.shape[0]
            A[j * R : j * R + r].copy_(a, non_blocking=True)
            if self.transposed:
                B[j * R : j * R + r, off : off + rows].copy_(b.t())
            else:
                B[off : off + rows, j * R : j * R + r].copy_(b, non_blocking=True)

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch: LoRABatch
    ) -> torch.Tensor:
        """The linear's output plus each row's adapter delta (`batch`: the step's StepContext.lora).

        On CUDA the shrink is part of the base GEMM (x @ [W; A_0; ...]^T: a few percent more weight
        rows, no kernel of its own) and one Triton kernel adds each row's h_s @ B[s]^T to its output."""
        from foveal.layers.linear import linear

        if self.W_ext is not None:
            from foveal.lora.ops_triton import lora_expand_fused

            ye = linear(x, self.W_ext, self.bias_ext)
            return lora_expand_fused(
                ye, self.B, batch.perm, batch.offs, self.num_slots, self.target.out_features
            )
        y = linear(x, weight, bias)
        fn = _cpu_kernel() if x.dtype == torch.float32 else None
        if fn is None or x.stride(-1) != 1 or y.stride(-1) != 1 or x.dim() != 2:
            return lora_add_grouped(x, y, self.A, self.B, batch.perm, batch.offs)
        if self._bounds is None:
            self._bounds = torch.tensor([off for off, _ in self.target.slices] + [self.target.out_features])
        T = x.shape[0]
        fn(
            x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), self.A.data_ptr(), self.B.data_ptr(),
            batch.perm.data_ptr(), batch.offs.data_ptr(), self.num_slots, T, self.target.in_features,
            self.target.out_features, self.A.shape[1], self.rank, self._bounds.data_ptr(),
            len(self.target.slices), torch.get_num_threads(),
        )  # fmt: skip
        return y


@functools.cache
def _cpu_kernel():
    """foveal_lora_f32 (cpu_lora.c), or None where no compiler built it (the grouped path runs)."""
    import ctypes
    from pathlib import Path

    from foveal import native

    P, I64 = ctypes.c_void_p, ctypes.c_int64
    sig = [P, I64, P, I64, P, P, P, P, I64, I64, I64, I64, I64, I64, P, I64, ctypes.c_int]
    return native.entry(Path(__file__).with_name("cpu_lora.c"), "foveal_lora_f32", "CPU LoRA kernel", sig)


def lora_add_grouped(x, y, A, B, perm, offs) -> torch.Tensor:
    """The grouped-GEMM form (every group, the base one multiplying its zero weights; B transposed,
    [S + 1, n*R, out]): y in place."""
    xs = x.index_select(0, perm).to(A.dtype)
    h = torch._grouped_mm(xs, A.transpose(1, 2), offs)
    d = torch._grouped_mm(h, B, offs)  # B stored transposed on a CPU: [S + 1, n*R, out]
    return y.index_add_(0, perm, d.to(y.dtype))
