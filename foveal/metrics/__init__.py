"""Request and step statistics, and the sink protocol the EngineLoop reports them to.

This module owns the numbers (time to first token, prefill and decode rates, request time) and a
thread-safe JSON summary. It must not import the HTTP layer; exporters (Prometheus) implement
`MetricsSink` elsewhere and are handed to the loop.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class RequestStats:
    """Timings of one HTTP-level request (all its choices), measured on the model thread."""

    request_id: str
    streaming: bool = False
    tenant: str | None = None  # who sent it (the API key's tenant); None without auth
    adapter: str | None = None  # the LoRA adapter it runs with (its served name); None: the base model
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_images: int = 0
    encoder_time_s: float = 0.0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def request_time(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def prefill_tps(self) -> float | None:
        t = self.ttft
        return self.num_prompt_tokens / t if t else None

    @property
    def decode_tps(self) -> float | None:
        return _rate(self.token_times)

    def to_dict(self) -> dict:
        tt = self.token_times
        return {
            "request_id": self.request_id,
            "streaming": self.streaming,
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "ttft_s": self.ttft,
            "prefill_tokens_per_s": self.prefill_tps,
            "decode_tokens_per_s": self.decode_tps,
            "first_32_tokens_per_s": _rate(tt[:32]),
            "first_64_tokens_per_s": _rate(tt[:64]),
            "last_32_tokens_per_s": _rate(tt[-32:]),
            "last_64_tokens_per_s": _rate(tt[-64:]),
            "request_time_s": self.request_time,
            "cached_prompt_tokens": self.num_cached_tokens,
            "images": self.num_images,
            "encoder_time_s": self.encoder_time_s,
            "peak_memory_mb": peak_memory_mb(),
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


def _rate(times: list[float]) -> float | None:
    """Tokens per second between the first and last token of a run of token timestamps."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def peak_memory_mb() -> float:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / 2**20
    except Exception:  # metrics must never fail a request
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


@dataclass(frozen=True, slots=True)
class StepReport:
    """The engine's state after a step, as the loop reports it to every sink (lifetime totals where
    a figure counts)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    vision: Any = None  # the vision cache's EncoderCacheStats (hits, misses, ...); None: text-only model
    prefix: tuple[int, int] | None = None  # (prompt tokens looked up, tokens found) in the prefix cache
    # speculative decoding's totals (the engine's SpecStats.as_dict(), "method", the load-aware policy's
    # "chosen_k"); None when the engine does not speculate
    spec: dict | None = None
    structured: dict | None = (
        None  # grammar totals {"mask_seconds", "mask_rows", "closed", "close_skipped"}; None before any
    )
    # LoRA: {"running": {adapter: sequences}, "waiting": {...}, "max_loras": n}; None when LoRA is off
    lora: dict | None = None


class MetricsSink(Protocol):
    def request_started(self, stats: RequestStats) -> None: ...
    def token(self, stats: RequestStats, now: float, num_tokens: int) -> None: ...
    def request_finished(self, stats: RequestStats, outcome: str) -> None: ...
    def step(self, report: StepReport) -> None: ...


@dataclass(slots=True)
class _TenantTally:
    started: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0  # the client left or cancelled: not a failure of the server
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "requests_started": self.started,
            "requests_completed": self.completed,
            "requests_failed": self.failed,
            "requests_aborted": self.aborted,
            "requests_in_flight": self.started - self.completed - self.failed - self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_prompt_tokens": self.cached_tokens,
        }


class SummarySink:
    """Lifetime counters plus the latest and recent requests, as JSON for GET /v1/metrics: all of it for
    an admin, a tenant's own requests and counters for anyone else (one tenant must not see another's
    request ids, prompt sizes or cache hits)."""

    def __init__(self, recent: int = 16, max_tenants: int = 4096):
        self._lock = threading.Lock()
        self._recent: deque[tuple[str | None, dict]] = deque(maxlen=recent * 4)
        self._recent_n = recent
        self._tenants: dict[str | None, _TenantTally] = {}
        self._max_tenants = max_tenants
        self.started = self.completed = self.failed = self.aborted = self.streaming = 0
        self.prompt_tokens = self.completion_tokens = 0
        self._time_sum = 0.0
        self._decode_sum, self._decode_n = 0.0, 0
        self.last_error: str | None = None
        self.last_step = StepReport(0, 0, 0.0)
        self.images = 0
        self.encoder_time = 0.0

    def _tally(self, tenant: str | None) -> _TenantTally:
        t = self._tenants.get(tenant)
        if t is None:
            if len(self._tenants) >= self._max_tenants:  # keys are the operator's, but stay bounded
                self._tenants.pop(next(iter(self._tenants)))
            t = self._tenants[tenant] = _TenantTally()
        return t

    def request_started(self, stats: RequestStats) -> None:
        with self._lock:
            self.started += 1
            self.streaming += stats.streaming
            self._tally(stats.tenant).started += 1

    def token(self, stats: RequestStats, now: float, num_tokens: int) -> None:
        pass

    def request_finished(self, stats: RequestStats, outcome: str) -> None:
        d = stats.to_dict()
        with self._lock:
            t = self._tally(stats.tenant)
            t.prompt_tokens += stats.num_prompt_tokens
            t.completion_tokens += stats.num_output_tokens
            t.cached_tokens += stats.num_cached_tokens
            if outcome == "completed":
                self.completed += 1
                t.completed += 1
            elif outcome == "aborted":
                self.aborted += 1
                t.aborted += 1
            else:
                self.failed += 1
                t.failed += 1
                self.last_error = stats.error or outcome
            self.prompt_tokens += stats.num_prompt_tokens
            self.completion_tokens += stats.num_output_tokens
            self.images += stats.num_images
            self.encoder_time += stats.encoder_time_s
            self._time_sum += stats.request_time or 0.0
            if stats.decode_tps:
                self._decode_sum += stats.decode_tps
                self._decode_n += 1
            self._recent.append((stats.tenant, d))

    def step(self, report: StepReport) -> None:
        self.last_step = report

    def tenant_dict(self, tenant: str | None) -> dict:
        """What one (non-admin) tenant may see: its own recent requests and counters."""
        with self._lock:
            recent = [d for t, d in self._recent if t == tenant][-self._recent_n :]
            tally = self._tenants.get(tenant) or _TenantTally()
            return {"latest": recent[-1] if recent else None, "recent": recent, "summary": tally.as_dict()}

    def to_dict(self) -> dict:
        with self._lock:
            done = self.completed + self.failed + self.aborted
            recent = [d for _, d in self._recent][-self._recent_n :]
            st = self.last_step
            return {
                "latest": recent[-1] if recent else None,
                "recent": recent,
                "summary": {
                    "requests_started": self.started,
                    "requests_completed": self.completed,
                    "requests_failed": self.failed,
                    "requests_aborted": self.aborted,
                    "requests_in_flight": self.started - done,
                    "streaming_requests": self.streaming,
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens,
                    "avg_request_time_s": self._time_sum / done if done else None,
                    "avg_decode_tokens_per_s": self._decode_sum / self._decode_n if self._decode_n else None,
                    "last_error": self.last_error,
                    "num_running": st.num_running,
                    "num_waiting": st.num_waiting,
                    "kv_cache_usage": st.kv_usage,
                    "images": self.images,
                    "encoder_time_s": self.encoder_time,
                    "vision_cache": st.vision.as_dict() if st.vision is not None else None,
                    "prefix_cache_query_tokens": st.prefix[0] if st.prefix else 0,
                    "prefix_cache_hit_tokens": st.prefix[1] if st.prefix else 0,
                    # global engine figures, like kv_cache_usage: not in a tenant's view
                    "speculative": dict(st.spec) if st.spec is not None else None,
                    "structured": _structured(st.structured),
                },
            }


def _structured(s: dict | None) -> dict | None:
    """Grammar masks: rows masked, host time filling them, and its mean per row."""
    if s is None:
        return None
    rows = s["mask_rows"]
    return {**s, "mask_us_per_row": s["mask_seconds"] / rows * 1e6 if rows else None}


class FanoutSink:
    """Several sinks behind one; a failing sink is logged by the caller, never fatal."""

    def __init__(self, *sinks: MetricsSink):
        self.sinks = sinks

    def request_started(self, stats):
        for s in self.sinks:
            s.request_started(stats)

    def token(self, stats, now, num_tokens):
        for s in self.sinks:
            s.token(stats, now, num_tokens)

    def request_finished(self, stats, outcome):
        for s in self.sinks:
            s.request_finished(stats, outcome)

    def step(self, report):
        for s in self.sinks:
            s.step(report)
