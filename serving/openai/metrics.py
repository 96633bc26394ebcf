"""The server's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

Two sources: what the app sees of each request as it ends (finish reasons as the client
got them, time to first token), kept in counters and a histogram; and what the engine
holds now (queue, running sequences, cache reservations, token totals), read when
scraped from ``Engine.load`` and ``Engine.stats``, values the engine thread replaces
whole, so a scrape never waits on or disturbs the engine. Each app has its own registry.

Prompt-reuse counters (``mlx_pte_prefix_cache_*``) appear when the engine's stats carry
them (``cached_tokens``: prompt tokens served from retained prefixes; ``prefix_hits``:
requests that reused one).
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..engine import Engine, RequestHandle

# Seconds from submission to the first generated token: interactive through batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# EngineStats fields exported if present, as (field, metric name, help).
_PREFIX_FIELDS = (
    ("cached_tokens", "mlx_pte_prefix_cache_hit_tokens", "Prompt tokens served from retained prompt prefixes"),
    ("prefix_hits", "mlx_pte_prefix_cache_hits", "Requests whose prompt reused a retained prefix"),
)


class _EngineCollector:
    """Reads the engine at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def describe(self) -> Iterable:
        return []  # values are read at scrape time; nothing to declare up front

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self._engine
        load, stats = engine.load, engine.stats
        gauges = (
            ("mlx_pte_queue_requests", "Requests waiting to be admitted", load.waiting),
            ("mlx_pte_running_sequences", "Cache sequences generating now (one per running sample)", load.running),
            ("mlx_pte_cache_reserved", f"Cache capacity reserved by admitted requests, in {engine.kind} "
                                       "capacity units (positions or cells)", load.reserved),
            ("mlx_pte_cache_capacity", "Cache capacity, in the same units", engine.capacity),
            ("mlx_pte_cache_positions", "Token positions the cache holds, summed over its sequences (prompts "
                                        "kept for reuse included)", load.positions),
            ("mlx_pte_decode_tokens_per_second", "Decode-only steps' tokens per second, over the engine's life",
             stats.decode_tps),
            ("mlx_pte_throughput_tokens_per_second", "Generated tokens per second of forward time, prefill "
                                                     "included, over the engine's life", stats.throughput_tps),
        )
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(name, help_text, value=value)
        counters = (
            ("mlx_pte_prompt_tokens", "Prompt tokens prefilled", stats.prompt_tokens),
            ("mlx_pte_generated_tokens", "Tokens generated", stats.generated_tokens),
            ("mlx_pte_forward_steps", "Forward steps run", stats.steps),
            ("mlx_pte_forward_seconds", "Seconds spent in forward steps", stats.busy_seconds),
        )
        for name, help_text, value in counters:
            yield CounterMetricFamily(name, help_text, value=value)
        for field, name, help_text in _PREFIX_FIELDS:
            value = getattr(stats, field, None)
            if value is not None:
                yield CounterMetricFamily(name, help_text, value=value)


class ServerMetrics:
    """The metrics of one app: ``finished`` records each request's end; ``exposition`` renders all."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self._finished = Counter(
            "mlx_pte_request_finished", "Choices of finished requests by finish reason (a request with n "
            "samples counts n; 'cancelled': the client left, 'error': the request failed)",
            ["finish_reason"], registry=self.registry)
        self._ttft = Histogram("mlx_pte_time_to_first_token_seconds", "Seconds from a request's arrival at the "
                               "engine to its first generated token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def finished(self, handle: RequestHandle, reasons: Iterable[str]) -> None:
        """Record a request's end: each choice's finish reason as the client saw it."""
        for reason in reasons:
            self._finished.labels(finish_reason=reason).inc()
        first: Optional[float] = handle.stats.first_token
        if first is not None:
            self._ttft.observe(first - handle.stats.submitted)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
