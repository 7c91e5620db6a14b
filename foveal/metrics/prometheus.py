"""Prometheus exporter: a MetricsSink writing to its own CollectorRegistry (so several servers in one
process, as in tests, never collide). Owns series names; must not know about HTTP routes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from foveal.metrics import RequestStats

_LAT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrometheusSink:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("foveal_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("foveal_time_to_first_token_seconds", "TTFT", buckets=_LAT, registry=r)
        self.itl = Histogram(
            "foveal_inter_token_latency_seconds", "Inter-token latency", buckets=_ITL, registry=r
        )
        self.e2e = Histogram("foveal_e2e_request_latency_seconds", "Request time", buckets=_LAT, registry=r)
        self.prompt_tokens = Counter("foveal_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("foveal_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("foveal_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("foveal_num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("foveal_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)

    def request_started(self, stats: RequestStats) -> None:
        pass

    def token(self, stats: RequestStats, now: float, num_tokens: int) -> None:
        times = stats.token_times
        if len(times) == 1:
            self.ttft.observe(times[0] - stats.arrival)
        elif len(times) >= 2:
            self.itl.observe(times[-1] - times[-2])
        self.generation_tokens.inc(num_tokens)

    def request_finished(self, stats: RequestStats, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.request_time is not None:
            self.e2e.observe(stats.request_time)

    def step(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
