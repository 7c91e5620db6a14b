"""Recorded decode steps for CPUs: the CPU counterpart of CUDA graphs (worker/cuda_graphs.py).

On a CPU the device work of a decode step is ~120 native kernel calls (layers/quant.py, cpu_fused.py,
attention/cpu_native.py), and the Python that leads to them (module calls, wrappers, views, shape
checks) cost a third of a 16-row SmolLM2 step on the 2-vCPU dev host. A tape records, once per
batch-size bucket, what the step really does and replays only that:

    record:  forward on static inputs under a TorchDispatchMode, with native.Entry calls appended
             -> tape = [native qlinear(ptrs...), aten.index_copy_(pool, 0, slots, k), native ...]
    replay:  fill the static inputs (token ids, positions, block tables, slots), run the tape

Recording runs the step for real (its logits are that step's), so nothing is computed twice. Every
tensor the recording made or touched is kept alive by its tape, so the data pointers in recorded
native calls stay valid; views and allocations are not replayed (their memory is the recorded one), ops
that write their operands (index_copy_, copy_, out=) run again as recorded, and other ops run again
with their result copied into the recorded output, where later ops read it. An op whose result depends
on data in a way a replay cannot follow (.item(), nonzero, masked_select) stops the recording: that
bucket then runs eagerly, for good.

Buckets and static buffers are DecodeGraphs'; the attention backend's graph_metadata /
fill_graph_metadata (attention/cpu_backend.py) give the static block tables, lengths and slots. Rows
past the batch attend to nothing and write their K/V into the null block.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foveal import native
from foveal.attention.base import AttentionBatch
from foveal.worker.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)

aten = torch.ops.aten
# ops whose results a replay cannot reproduce: values read back by Python, data-dependent shapes
_DYNAMIC = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
}
# allocations: their memory is what the recording got; nothing to redo
_ALLOC = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,  # the graphs' logits buffer, made by the first recorded step
    aten.new_empty_strided.default,
}

# Buckets of more rows run eagerly: there the kernels' time dwarfs the Python, and each tape keeps a
# step's worth of activations alive. Tapes stop being recorded once they hold MAX_BYTES between them
# (measured: SmolLM2-135M, 12.5 MiB for the 16-row bucket; an 8B model: ~6 MiB per row by count).
MAX_ROWS = 64
MAX_BYTES = 1 << 30


class NotRecordable(RuntimeError):
    pass


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable unless this says no; the wrapper's
        # first call imports torch._dynamo (~0.7 s on the 2-vCPU host, stalling the first request's
        # first decode step), and no recorded step ever runs under torch.compile
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DYNAMIC:
            raise NotRecordable(f"{func} reads tensor data back")
        out = func(*args, **kwargs)
        if func in _ALLOC:
            self.tape.append((None, out, None, None))  # kept alive, not replayed
        elif func.is_view and isinstance(args[0], torch.Tensor) and _aliases(out, args[0]):
            self.tape.append((None, (args, kwargs, out), None, None))
        elif func._schema.is_mutable:
            self.tape.append((func, args, kwargs, None))
        else:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if not all(isinstance(t, torch.Tensor) for t in outs):
                raise NotRecordable(f"{func} returns {type(out).__name__}")
            self.tape.append((func, args, kwargs, out))
        return out


def _aliases(out, base: torch.Tensor) -> bool:
    """Whether a view op really returned views of base: some (to, reshape) copy when they must."""
    ptr = base.untyped_storage().data_ptr()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in outs)


def _made_bytes(tape: list) -> int:
    """Bytes of the tensors the recorded step allocated (allocations and functional results)."""
    seen: dict[int, int] = {}
    for fn, args, kwargs, out in tape:
        if fn is None and isinstance(args, torch.Tensor):
            out = args  # an allocation
        elif fn is None or kwargs is None or out is None:
            continue  # views, kept tensors, native calls, ops writing their operands
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if t.is_mkldnn:  # an opaque tensor has no storage to share; it cannot be a view either
                raise NotRecordable(f"{fn} made an opaque (oneDNN) tensor")
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def replay(tape: list) -> None:
    for fn, args, kwargs, out in tape:
        if fn is None:
            continue  # kept alive only
        if kwargs is None:
            fn(*args)  # a native call
        elif out is None:
            fn(*args, **kwargs)  # writes its operands
        else:
            res = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                out.copy_(res)
            else:
                for o, r in zip(out, res):
                    o.copy_(r)


class CpuDecodeGraphs(DecodeGraphs):
    """DecodeGraphs whose buckets replay recorded tapes (recorded at first use) instead of CUDA
    graphs."""

    def __init__(self, model, kv_caches, backend, *, max_seqs: int, **kw):
        super().__init__(model, kv_caches, backend, max_seqs=min(max_seqs, MAX_ROWS), **kw)
        self.tapes: dict[int, list | None] = {}  # bucket -> tape; None: not recordable, eager
        self.lora_tapes: dict[int, list | None] = {}  # the same with the LoRA ops (a step with adapters)
        self.nbytes = 0  # activation memory the tapes keep

    def capture(self) -> None:
        """Nothing ahead of time: each bucket is recorded by its first step."""

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, lora=None, shared=False
    ) -> torch.Tensor:
        """`shared` is never set here: the CPU backends group no rows (the Triton backend's alone does)."""
        n = input_ids.shape[0]
        b = self._bucket_of[n]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        kw = {"lora": True} if self.fill_lora(lora, n) else {}
        if n < b:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
        meta = self.backend.fill_graph_metadata(self.meta, batch, b)
        tapes = self.lora_tapes if kw else self.tapes
        tape = tapes.get(b, ())
        if tape is None:
            self._forward(b, meta, **kw)
        elif tape:
            replay(tape)
        else:
            tapes[b] = self._record(b, meta, **kw)
        return self.logits[:n]

    def _record(self, b: int, meta, **kw) -> list | None:
        """Run bucket b's first step under the recorder; its tape, or None when the step cannot be
        recorded. Whatever goes wrong while recording (an op a tape cannot follow, a tensor it cannot
        hold) costs the bucket its replays, never the batch: the step then runs again, eagerly (its K/V
        writes are the same values), and only an error of the step itself reaches the caller."""
        tape: list = []
        native.recording.tape = tape
        try:
            with _Recorder(tape):
                self._forward(b, meta, **kw)
            nbytes = _made_bytes(tape)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        else:
            reason = None
        finally:
            native.recording.tape = None
        if reason is not None:
            log.warning("decode steps of %d rows run eagerly: recording failed (%s)", b, reason)
            self._forward(b, meta, **kw)
            return None
        if self.nbytes + nbytes > MAX_BYTES:
            log.info("decode steps of %d rows run eagerly: recorded steps hold %d MiB", b, self.nbytes >> 20)
            return None
        self.nbytes += nbytes
        calls = sum(1 for fn, *_ in tape if fn is not None)
        log.debug("recorded the %d-row decode step: %d calls, %d KiB", b, calls, nbytes >> 10)
        return tape
