"""Prometheus exporter: a MetricsSink writing to its own CollectorRegistry (so several servers in one
process, as in tests, never collide). Owns series names; must not know about HTTP routes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from foveal.metrics import RequestStats, StepReport

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
        self.images = Counter("foveal_images", "Images in finished requests", registry=r)
        self.encoder_time = Histogram(
            "foveal_request_encoder_seconds",
            "Vision-encoder time per image request",
            buckets=_LAT,
            registry=r,
        )
        self.vision_hits = Counter("foveal_vision_cache_hits", "Vision feature cache hits", registry=r)
        self.vision_misses = Counter("foveal_vision_cache_misses", "Vision feature cache misses", registry=r)
        self.vision_bytes = Gauge("foveal_vision_cache_bytes", "Bytes of cached image embeddings", registry=r)
        self._seen = (0, 0)  # cache hits/misses already counted
        self.prefix_queries = Counter(
            "foveal_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "foveal_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self._prefix_seen = (0, 0)
        self._lazy: dict[str, list[Counter]] = {}  # series registered at their first report
        self._grammar_size: tuple[Gauge, Gauge] | None = None
        self._lazy_seen: dict[str, list[float]] = {}
        self._spec: tuple[Counter, Counter, Counter, Counter] | None = None  # registered at the first report
        self._spec_seen = (0, 0, 0)  # drafts, draft tokens, accepted tokens already counted
        self._spec_pos_seen: dict[str, int] = {}
        self._spec_k: Counter | None = None
        self._spec_k_seen: dict[str, int] = {}
        self._lora: tuple[Counter, Gauge, Gauge, Gauge] | None = None  # registered with LoRA's first report
        self._lora_names: set[str] = set()

    def _lora_series(self) -> tuple[Counter, Gauge, Gauge, Gauge]:
        if self._lora is None:
            r = self.registry
            self._lora = (
                Counter(
                    "foveal_lora_requests", "Requests received per LoRA adapter", ["adapter"], registry=r
                ),
                Gauge(
                    "foveal_lora_running_requests",
                    "Sequences running per LoRA adapter",
                    ["adapter"],
                    registry=r,
                ),
                Gauge(
                    "foveal_lora_waiting_requests",
                    "Sequences waiting per LoRA adapter",
                    ["adapter"],
                    registry=r,
                ),
                # vLLM's vllm:lora_requests_info (gateway endpoint pickers read it): the labels carry the
                # running / waiting adapters, the value is the time of the report
                Gauge(
                    "foveal_lora_requests_info",
                    "Running and waiting LoRA adapters",
                    ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                    registry=r,
                ),
            )
        return self._lora

    def request_started(self, stats: RequestStats) -> None:
        if stats.adapter is not None:
            self._lora_series()[0].labels(adapter=stats.adapter).inc()

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
        if stats.num_images:
            self.images.inc(stats.num_images)
            self.encoder_time.observe(stats.encoder_time_s)
        if stats.request_time is not None:
            self.e2e.observe(stats.request_time)

    def step(self, report: StepReport) -> None:
        self.running.set(report.num_running)
        self.waiting.set(report.num_waiting)
        self.kv_usage.set(report.kv_usage)
        vision, prefix, spec, structured = report.vision, report.prefix, report.spec, report.structured
        if vision is not None:  # the cache keeps totals; counters take the increase since last step
            hits, misses = self._seen
            self.vision_hits.inc(max(0, vision.hits - hits))
            self.vision_misses.inc(max(0, vision.misses - misses))
            self._seen = (vision.hits, vision.misses)
            self.vision_bytes.set(vision.bytes_used)
        if prefix is not None:
            q, h = self._prefix_seen
            self.prefix_queries.inc(max(0, prefix[0] - q))
            self.prefix_hits.inc(max(0, prefix[1] - h))
            self._prefix_seen = prefix
        if spec is not None:
            self._spec_step(spec)
        if report.lora is not None:
            self._lora_step(report.lora)
        if structured is not None:
            self._totals(
                "mask",
                [
                    (
                        "foveal_structured_mask_rows",
                        "Logits rows masked by a grammar",
                        structured["mask_rows"],
                    ),
                    (
                        "foveal_structured_mask_seconds",
                        "Host time filling grammar masks",
                        structured["mask_seconds"],
                    ),
                    (
                        "foveal_structured_closed",
                        "Constrained answers closed early for max_tokens",
                        structured.get("closed", 0),
                    ),
                    (
                        "foveal_structured_close_skipped",
                        "Closing plans given up over their time budget (those answers were cut)",
                        structured.get("close_skipped", 0),
                    ),
                ],
            )

    def _lora_step(self, lora: dict) -> None:
        import time

        _, running, waiting, info = self._lora_series()
        run, wait = lora["running"], lora["waiting"]
        self._lora_names |= set(run) | set(wait)
        for name in self._lora_names:  # an adapter gone from both reads 0, not its last count
            running.labels(adapter=name).set(run.get(name, 0))
            waiting.labels(adapter=name).set(wait.get(name, 0))
        info.clear()
        info.labels(
            running_lora_adapters=",".join(sorted(run)),
            waiting_lora_adapters=",".join(sorted(wait)),
            max_lora=str(lora["max_loras"]),
        ).set(time.time())

    def grammar(self, stats) -> None:
        """The grammar cache's lifetime totals (GrammarCacheStats), read when /metrics is scraped."""
        self._totals(
            "grammar",
            [
                ("foveal_grammar_compiles", "Grammars compiled (cache misses)", stats.misses),
                ("foveal_grammar_cache_hits", "Grammars served from the compiled cache", stats.hits),
                ("foveal_grammar_compile_errors", "Grammar specs refused when compiled", stats.errors),
                ("foveal_grammar_compile_seconds", "Time compiling grammars", stats.compile_seconds),
                (
                    "foveal_grammar_refused",
                    "Requests refused: their grammar had failed at run time",
                    stats.refused,
                ),
            ],
        )
        if self._grammar_size is None:
            r = self.registry
            self._grammar_size = (
                Gauge("foveal_grammar_cache_entries", "Compiled grammars cached", registry=r),
                Gauge("foveal_grammar_cache_bytes", "Estimated memory of the cached grammars", registry=r),
            )
        self._grammar_size[0].set(stats.entries)
        self._grammar_size[1].set(stats.nbytes)

    def _totals(self, key: str, series: list[tuple[str, str, float]]) -> None:
        """Counters that follow lifetime totals (the increase since the last report), registered at the
        first report: a server that never constrains an output has no such series."""
        counters = self._lazy.get(key)
        if counters is None:
            counters = self._lazy[key] = [Counter(n, h, registry=self.registry) for n, h, _ in series]
            self._lazy_seen[key] = [0.0] * len(series)
        seen = self._lazy_seen[key]
        for i, (counter, (_, _, total)) in enumerate(zip(counters, series)):
            counter.inc(max(0.0, total - seen[i]))
            seen[i] = max(seen[i], total)

    def _spec_step(self, spec: dict) -> None:
        """vLLM's spec_decode counters from the engine's lifetime totals (the increase since the last
        report). Registered only once the engine reports them: a server that does not speculate has no
        spec series."""
        if self._spec is None:
            r = self.registry
            self._spec = (
                Counter("foveal_spec_decode_num_drafts", "Verify rows that carried drafts", registry=r),
                Counter("foveal_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r),
                Counter("foveal_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r),
                Counter(
                    "foveal_spec_decode_num_accepted_tokens_per_pos",
                    "Rows whose draft at this position (0-based) was accepted",
                    ["position"],
                    registry=r,
                ),
            )
        drafts, draft_tokens, accepted, per_pos = self._spec
        now = (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"])
        for counter, n, seen in zip((drafts, draft_tokens, accepted), now, self._spec_seen):
            counter.inc(max(0, n - seen))
        self._spec_seen = now
        pos = spec.get("accepted_per_pos") or ()
        self._labelled(per_pos, "position", {str(j): n for j, n in enumerate(pos)}, self._spec_pos_seen)
        chosen = spec.get("chosen_k")
        if chosen is not None:  # the load-aware policy: row-steps by the k it chose (0: no drafts)
            if self._spec_k is None:
                self._spec_k = Counter(
                    "foveal_spec_decode_chosen_k",
                    "Speculating rows' steps by the number of drafts the load-aware policy gave them",
                    ["k"],
                    registry=self.registry,
                )
            self._labelled(self._spec_k, "k", chosen, self._spec_k_seen)

    @staticmethod
    def _labelled(counter: Counter, label: str, totals: dict[str, int], seen: dict[str, int]) -> None:
        """A labelled counter following lifetime totals per label value (a new value shows at once, at 0
        if need be); `seen` is updated in place."""
        for key, n in totals.items():
            d = n - seen.get(key, 0)
            if d > 0 or key not in seen:
                counter.labels(**{label: key}).inc(max(0, d))
            seen[key] = max(n, seen.get(key, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
