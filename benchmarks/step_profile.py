"""Where an engine step's time goes: a torch.profiler trace of a few engine steps, summarised per step.

    with StepProfile(llm.engine, "/tmp/out/spec.json") as p:
        ...run some steps...
    print(p.summary())

The engine's phases (propose, schedule, launch, resolve, collect inside resolve) are marked as
profiler ranges; each GPU kernel is charged to the phase whose host call launched it (the runtime
call's correlation id: a CUDA graph's kernels carry their cudaGraphLaunch's). The summary, per engine
step: wall time, the time the GPU was busy (the union of kernel intervals) and idle, host milliseconds
in each phase, GPU milliseconds launched from each phase, and the kernels that took the most GPU time.
The chrome trace is kept for a closer look (chrome://tracing, ui.perfetto.dev). CUPTI's tracing slows
the host: a CUDA graph launch of ~600 nodes shows as 0.5-1.1 ms under it and takes ~10-35 us without
it (scripts/graph_launch_probe.py; HostTimes' `*.replay`), so read host times from HostTimes.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import torch


def _phases(eng) -> list[tuple[object, str, str]]:
    """The engine's phases worth timing, in this tree (a method a tree lacks is skipped)."""
    out = [(eng, "_resolve", "engine.resolve"), (eng, "_propose", "engine.propose")]
    spec = getattr(eng, "speculation", None)
    if spec is not None:
        out += [(spec, n, f"speculation.{n}") for n in ("begin_step", "propose", "observe", "step_done")]
    out += [(eng.scheduler, n, f"scheduler.{n}") for n in ("schedule", "advance")]
    out += [(eng.runner, n, f"runner.{n}") for n in ("launch", "sample", "collect")]
    return out


class HostProfile:
    """cProfile of the host while the block runs; `table()` lists the functions by own time."""

    def __enter__(self):
        import cProfile

        self.prof = cProfile.Profile()
        self.prof.enable()
        return self

    def __exit__(self, *exc):
        self.prof.disable()
        return False

    def table(self, top: int = 30, steps: int = 1) -> str:
        """The functions by own time, then foveal's by cumulative time (what each call costs in all)."""
        import io
        import pstats

        out = io.StringIO()
        out.write(f"(cProfile over {steps} engine steps)\n")
        stats = pstats.Stats(self.prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("foveal", top)
        return out.getvalue()


class _GraphTimer:
    """Stands in for a CUDA graph in a graphs' dict: replays it, timing the host call."""

    def __init__(self, graph, totals: dict, name: str):
        self.graph, self.totals, self.name = graph, totals, name

    def replay(self):
        t0 = time.perf_counter()
        self.graph.replay()
        self.totals[self.name] += time.perf_counter() - t0


class HostTimes:
    """Host seconds in each engine phase and in each CUDA graph launch, without a profiler (whose
    tracing slows launches): `totals` per name, `per_step()` in milliseconds."""

    def __init__(self, engine, graphs: dict | None = None):
        self.engine, self.graphs = engine, graphs or {}
        self.totals: dict[str, float] = defaultdict(float)
        self._restore: list[tuple[object, str]] = []
        self._swapped: list[tuple[dict, int, object]] = []

    def _time(self, obj, name: str, label: str) -> None:
        fn, totals = getattr(obj, name, None), self.totals
        if fn is None:  # a method this tree does not have (the trees compared differ)
            return

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t0

        setattr(obj, name, timed)
        self._restore.append((obj, name))

    def __enter__(self):
        eng = self.engine
        self.steps0 = eng.step_seconds["steps"]
        for obj, name, label in _phases(eng):
            self._time(obj, name, label)
        self.kinds = StepKinds(eng).__enter__()
        for label, g in self.graphs.items():  # DecodeGraphs-like: .graphs {bucket: CUDAGraph}
            for b, graph in list(g.graphs.items()):
                self._swapped.append((g.graphs, b, graph))
                g.graphs[b] = _GraphTimer(graph, self.totals, f"{label}.replay")
        return self

    def __exit__(self, *exc):
        self.kinds.__exit__(*exc)
        for obj, name in self._restore:
            delattr(obj, name)
        for d, b, graph in self._swapped:
            d[b] = graph
        self.steps = self.engine.step_seconds["steps"] - self.steps0
        return False

    def per_step(self) -> dict:
        """Milliseconds a step in each phase (over every step), then whole steps by kind: how many
        and their mean milliseconds."""
        n = max(self.steps, 1)
        out = {"steps": self.steps, **{k: round(v / n * 1e3, 3) for k, v in sorted(self.totals.items())}}
        for kind, (count, ms) in self.kinds.summary().items():
            out[f"steps_{kind}"], out[f"step_ms_{kind}"] = count, ms
        return out


class StepKinds:
    """Whole engine steps by kind while the block runs, timed without a profiler: `prefill` (a prompt
    chunk among the rows: such a step runs eagerly) or `decode` (the batch's items are all decodes or
    verify runs); `summary()`: {kind: [steps, mean ms]}. What it wraps is put back as it was."""

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        eng = self.engine
        self.counts: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved = [(o, n, vars(o).get(n)) for o, n in ((eng, "step"), (eng.scheduler, "schedule"))]
        step, schedule, kind = eng.step, eng.scheduler.schedule, ["idle"]

        def scheduled():
            batch = schedule()
            if not batch.empty:
                kind[0] = "decode" if all(x.is_decode for x in batch.items) else "prefill"
            return batch

        def stepped():
            kind[0] = "idle"  # nothing scheduled
            t0 = time.perf_counter()
            out = step()
            self.seconds[kind[0]] += time.perf_counter() - t0
            self.counts[kind[0]] += 1
            return out

        eng.step, eng.scheduler.schedule = stepped, scheduled
        return self

    def __exit__(self, *exc):
        for obj, name, was in self._saved:
            if was is None:
                delattr(obj, name)
            else:
                setattr(obj, name, was)
        return False

    def summary(self) -> dict:
        return {k: [n, round(self.seconds[k] / n * 1e3, 3)] for k, n in sorted(self.counts.items())}


def decode_window(
    llm,
    prompts,
    params,
    trace: str,
    timed: int = 10,
    traced: int = 5,
    finish: bool = True,
    cprofiled: int = 0,
) -> dict:
    """Per-step figures of decode steps only: the requests are run until each has its first token (and
    two steps more), then `timed` steps under HostTimes (host ms per phase, no profiler), then `traced`
    steps under StepProfile (GPU busy/idle, GPU ms per phase, top kernels), then `cprofiled` steps under
    HostProfile (its table in "cprofile"); then run to the end (`finish`) or aborted."""
    eng = llm.engine
    ids = [eng.add_request(llm.processor.request(p, sp)) for p, sp in zip(prompts, params)]
    seen: set[str] = set()
    while len(seen) < len(ids):
        seen |= {d.request_id for d in eng.step() if d.token_ids}
    eng.step(), eng.step()
    _sync()
    t0 = time.perf_counter()
    with HostTimes(eng) as ht:
        for _ in range(timed):
            eng.step()
    _sync()
    out = {"step_ms": (time.perf_counter() - t0) / timed * 1e3, "host_ms": ht.per_step()}
    with StepProfile(eng, trace) as prof:
        for _ in range(traced):
            eng.step()
    out["trace"] = prof.summary()
    if cprofiled:
        with HostProfile() as hp:
            for _ in range(cprofiled):
                eng.step()
        out["cprofile"] = hp.table(steps=cprofiled)
    if not finish:
        for r in ids:
            eng.abort(r)
    while eng.has_unfinished():
        eng.step()
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepProfile:
    def __init__(self, engine, path: str):
        self.engine, self.path = engine, path
        self._restore: list[tuple[object, str]] = []

    def _mark(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def marked(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        setattr(obj, name, marked)
        self._restore.append((obj, name))

    def __enter__(self):
        eng = self.engine
        self._mark(eng, "step", "engine.step")
        for obj, name, label in _phases(eng):
            self._mark(obj, name, label)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(*exc)
        for obj, name in self._restore:
            delattr(obj, name)  # the instance attribute goes: the class's method shows again
        self.prof.export_chrome_trace(self.path)
        return False

    def summary(self, top: int = 12) -> dict:
        return summarize(self.path, top)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(path: str, top: int = 12) -> dict:
    """Per engine step (the `engine.step` ranges that launched GPU work): milliseconds of wall, GPU
    busy, host per phase and GPU launched per phase; the top kernels' GPU milliseconds per step."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    steps = sorted((e for e in ranges if e["name"] == "engine.step"), key=lambda e: e["ts"])
    runtime = {  # the launching calls: the runtime API's, and the driver API's (Triton launches there)
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not steps:
        return {"steps": 0}
    t0, t1 = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    n = len(steps)
    host: dict[str, float] = defaultdict(float)
    for r in ranges:
        if r["name"] != "engine.step" and t0 <= r["ts"] <= t1:
            host[r["name"]] += r["dur"]
    by_phase: dict[str, float] = defaultdict(float)
    by_kernel: dict[str, float] = defaultdict(float)
    busy = []
    inner = sorted(ranges, key=lambda r: r["dur"])  # innermost range first
    for k in gpu:
        if not (t0 <= k["ts"] <= t1 + 50_000):
            continue
        busy.append((k["ts"], k["ts"] + k["dur"]))
        by_kernel[k["name"][:90]] += k["dur"]
        call = runtime.get(k.get("args", {}).get("correlation"))
        phase = "other"
        if call is not None:
            for r in inner:
                if r["ts"] <= call["ts"] <= r["ts"] + r["dur"] and r.get("tid") == call.get("tid"):
                    phase = r["name"]
                    break
        by_phase[phase] += k["dur"]
    wall = t1 - t0
    gpu_busy = _union(busy)
    ms = 1e-3 / n
    return {
        "steps": n,
        "wall_ms": round(wall * ms, 3),
        "gpu_busy_ms": round(gpu_busy * ms, 3),
        "gpu_idle_ms": round((wall - gpu_busy) * ms, 3),
        "host_ms": {k: round(v * ms, 3) for k, v in sorted(host.items())},
        "gpu_ms_by_phase": {k: round(v * ms, 3) for k, v in sorted(by_phase.items())},
        "top_kernels_ms": {
            k: round(v * ms, 4) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
        },
        "by_kind": _idle_by_kind(steps, ranges, gpu, runtime),
    }


def _idle_by_kind(steps, ranges, gpu, runtime, resolution_us: float = 10.0) -> dict:
    """Per kind of step (`prefill`: it launched the prefill attention kernel; else `decode`): steps, wall
    and GPU-busy ms a step, and the GPU's idle ms a step charged to the innermost engine phase open on
    the host at that moment (sampled every `resolution_us`): what the device waits for."""
    tid = steps[0].get("tid")
    inner = sorted(
        (r for r in ranges if r.get("tid") == tid and r["name"] != "engine.step"), key=lambda r: r["dur"]
    )
    intervals: list[list[float]] = []
    for a, b in sorted((k["ts"], k["ts"] + k["dur"]) for k in gpu):
        if intervals and a <= intervals[-1][1]:
            intervals[-1][1] = max(intervals[-1][1], b)
        else:
            intervals.append([a, b])
    prefill_calls = [runtime[c]["ts"] for k in gpu if k["name"] == "_prefill_kernel"
                     if (c := k.get("args", {}).get("correlation")) in runtime]  # fmt: skip
    out: dict[str, dict] = {}
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        kind = "prefill" if any(t0 <= t <= t1 for t in prefill_calls) else "decode"
        o = out.setdefault(kind, {"steps": 0, "wall": 0.0, "busy": 0.0, "idle": defaultdict(float)})
        o["steps"] += 1
        o["wall"] += t1 - t0
        cur = t0
        for a, b in intervals:
            if b <= t0 or a >= t1:
                continue
            o["busy"] += min(b, t1) - max(a, t0)
            if a > cur:  # the device idle from cur to a
                _charge(o["idle"], inner, cur, a, resolution_us)
            cur = max(cur, b)
        _charge(o["idle"], inner, cur, t1, resolution_us)
    return {
        kind: {
            "steps": o["steps"],
            "wall_ms": round(o["wall"] / o["steps"] * 1e-3, 3),
            "gpu_busy_ms": round(o["busy"] / o["steps"] * 1e-3, 3),
            "gpu_idle_ms_by_phase": {
                k: round(v / o["steps"] * 1e-3, 3)
                for k, v in sorted(o["idle"].items(), key=lambda kv: -kv[1])
            },
        }
        for kind, o in sorted(out.items())
    }


def _charge(idle: dict, inner: list, a: float, b: float, step: float) -> None:
    """Charge the idle interval [a, b) to the innermost range open at each sample (`none`: no phase)."""
    t = a
    while t < b:
        dt = min(step, b - t)
        mid = t + dt / 2
        idle[next((r["name"] for r in inner if r["ts"] <= mid <= r["ts"] + r["dur"]), "none")] += dt
        t += dt
