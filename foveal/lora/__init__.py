"""LoRA adapters, many per batch (issue 21).

    peft.py        PEFT's format: config (refusals, per-module scaling), tensor names, Hub ids
    adapter.py     where LoRA goes in a model (LoRALayout) and one adapter in host memory (HostAdapter)
    registry.py    served adapters by name (request side: the server, LLM's LoRARequest)
    driver.py      the scheduling side: each request's adapter, slot choice (LRU), the cap per step
    slots.py       the device's slots (the runner's): slot writes, a step's rows grouped by slot
    stacks.py      per-linear stacked weights and the batched add (which kernel runs where)
    ops_triton.py  the CUDA kernel (the grouped expand after a GEMM that also did the shrink)
    cpu_lora.c     the CPU kernel (shrink and expand in one call)

A request carries its HostAdapter from the request side to the scheduler; its driver gives each step
a LoRAStep (per item a slot; the slot writes the step needs, with their adapters), which the runner
applies before the step's forward pass; the step's StepContext.lora tells every LoRA-capable linear
which rows use which slot.
"""
