"""How long the host spends in one CUDA graph launch (a 600-node graph, the size of a dummy 8B model's
decode step), with the GPU idle and with another graph queued in front of it, without a profiler: under
torch.profiler (CUPTI tracing every graph node) the same launch shows as 0.5-1.1 ms.

    python scripts/graph_launch_probe.py      # on the GPU machine
"""

import time

import torch

DEV = "cuda"


def chain(n: int, rows: int = 1, size: int = 4096):
    """n matmul + SiLU pairs: a graph of ~2n kernel nodes."""
    w = [torch.randn(size, size, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    x = torch.randn(rows, size, device=DEV, dtype=torch.bfloat16)

    def f():
        y = x
        for i in range(n):
            y = torch.nn.functional.silu(y @ w[i % 4])
        return y

    return f


def main() -> None:
    graphs = {}
    for name, f in (("A", chain(100)), ("B", chain(600))):
        f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs[name] = g
    torch.cuda.synchronize()
    flag = torch.zeros(1, device=DEV)

    def launch_us(before, reps: int = 50) -> float:
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            before()
            t0 = time.perf_counter()
            graphs["B"].replay()
            out.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return round(sorted(out)[reps // 2] * 1e6, 1)

    def device_us(name: str) -> float:
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        graphs[name].replay()
        e.record()
        torch.cuda.synchronize()
        return round(s.elapsed_time(e) * 1e3, 1)

    print("B launch, idle GPU (us):", launch_us(lambda: None))
    print("B launch after A queued (us):", launch_us(lambda: graphs["A"].replay()))
    print("B launch after A queued + small op (us):", launch_us(lambda: (graphs["A"].replay(), flag.add_(1))))
    print("A device us", device_us("A"), "B device us", device_us("B"))


if __name__ == "__main__":
    main()
