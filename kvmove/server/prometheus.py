"""Prometheus text exposition of one server's state (prometheus-client), read from the runtime at scrape time.

``GET /metrics`` serves this text (what Prometheus, vLLM and SGLang scrapers expect); the same numbers as JSON,
for scripts and the migration controller, stay at ``GET /metrics.json`` (and ``/metrics?format=json``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

if TYPE_CHECKING:
    from kvmove.server.runtime import Runtime

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RuntimeCollector:
    """Gauges of the scheduler and KV pools, counters of tokens, an info metric of model/weights/transport."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[Any]:
        m = self.rt.metrics()
        with self.rt.lock:
            stats = self.rt.worker.stats()
        waiting = GaugeMetricFamily("kvmove_requests_waiting", "Requests waiting, per priority", labels=["priority"])
        for priority, n in sorted(m.waiting_per_priority.items()):
            waiting.add_metric([priority], n)
        yield waiting
        yield GaugeMetricFamily("kvmove_requests_running", "Requests in the running batch", value=m.running)
        yield GaugeMetricFamily("kvmove_requests_held", "Requests held for a migration", value=len(m.held_rids))
        pages = GaugeMetricFamily("kvmove_kv_pages", "Device KV pages by state", labels=["state"])
        for state, n in (("free", m.free_pages), ("used", m.used_pages), ("cached", m.cached_pages)):
            pages.add_metric([state], n)
        yield pages
        yield GaugeMetricFamily("kvmove_kv_pages_total", "Device KV pages in the pool", value=m.total_pages)
        yield GaugeMetricFamily("kvmove_kv_page_size_tokens", "Tokens per KV page", value=m.page_size)
        yield GaugeMetricFamily("kvmove_host_kv_pages_free", "Free pages of the host KV pool", value=m.host_free_pages)
        yield GaugeMetricFamily(
            "kvmove_migrations_pending", "Uncommitted incoming migrations", value=m.migrations_pending
        )
        tokens = CounterMetricFamily("kvmove_tokens", "Tokens since start, by kind", labels=["kind"])
        for kind, n in (
            ("prefill", stats.prefill_tokens),
            ("decode", stats.decode_tokens),
            ("cached", stats.cached_tokens),
        ):
            tokens.add_metric([kind], n)
        yield tokens
        info = {
            "model": self.rt.config.model,
            "weight_version": m.weight_version,
            "kv_transport": m.transport,
            "kv_migration": str(self.rt.config.enable_kv_migration).lower(),
        }
        yield InfoMetricFamily("kvmove_server", "What this server runs", value=info)


def registry_for(rt: Runtime) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(rt))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry's metrics in the Prometheus text format."""
    return bytes(generate_latest(registry))
