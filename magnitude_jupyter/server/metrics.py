"""`/metrics`: the engine's counters in Prometheus' text format, through `prometheus_client`.

A collector reads the pool's engines when scraped (nothing is copied on the hot path), into a
registry of its own per server and viewer, so two servers in one process never mix their figures.

Who scrapes decides what is shown (docs/operations.md, "Several clients"): the owner sees every
family; a tenant sees the server's state now (the gauges, the objectives' judgement) and its own
`magnitude_tenant_*` series, but no counter or histogram that sums every tenant's requests, since
another tenant's request sizes and times could be read from two scrapes of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..engine import Engine
from ..engine.metrics import EngineMetrics, Histogram
from ..engine.plan import SchedulerStats
from ..engine.pool import ModelPool
from ..engine.slo import evaluate
from ..engine.stats import EngineStats

OUTCOMES = ("stop", "length", "cancelled", "error")
SLO_GAUGES = (
    ("magnitude_slo_objective", "The objective's limit (ms, or tokens/s for a rate)."),
    ("magnitude_slo_current", "The window's p95 (p5 for a rate), where it has requests."),
    ("magnitude_slo_compliance_ratio", "Share of the window's requests within the objective."),
    ("magnitude_slo_burn_rate", "Misses over the 5% the objective allows: above 1 it breaks."),
    ("magnitude_slo_requests", "Requests judged in the window."),
)


def _add_histogram(family: HistogramMetricFamily, model: str, hist: Histogram) -> None:
    buckets = [("+Inf" if bound == float("inf") else f"{bound:g}", count) for bound, count in hist.cumulative()]
    family.add_metric([model], buckets=buckets, sum_value=hist.total)


# Each engine's counters and gauges: (name, help, its value from the engine's metrics, its scheduler's
# figures and its stats).
Reading = Callable[[EngineMetrics, SchedulerStats, EngineStats], float]
ENGINE_COUNTERS: tuple[tuple[str, str, Reading], ...] = (
    ("magnitude_prompt_tokens", "Prompt tokens of finished requests.", lambda m, s, e: m.prompt_tokens_total),
    ("magnitude_generation_tokens", "Tokens generated.", lambda m, s, e: m.generation_tokens_total),
    ("magnitude_draft_tokens", "Prompt-lookup draft tokens decoded.", lambda m, s, e: m.draft_tokens_total),
    (
        "magnitude_draft_accepted_tokens",
        "Draft tokens the model's own greedy picks confirmed.",
        lambda m, s, e: m.draft_accepted_total,
    ),
    ("magnitude_decode_calls", "llama_decode calls.", lambda m, s, e: m.decode_calls_total),
    (
        "magnitude_decode_rows",
        "Rows llama_decode computed: prompt, answer, draft.",
        lambda m, s, e: m.decode_rows_total,
    ),
    ("magnitude_decode_prompt_rows", "Prompt rows among them.", lambda m, s, e: m.decode_prompt_rows_total),
    ("magnitude_decode_seconds", "Seconds inside llama_decode.", lambda m, s, e: m.decode_seconds_total),
    (
        "magnitude_step_seconds",
        "Seconds of whole engine steps: plan, llama_decode, sampling, events.",
        lambda m, s, e: m.step_seconds_total,
    ),
    (
        "magnitude_kv_compactions",
        "KV cache compactions: the cells in use moved to the front before a prompt step.",
        lambda m, s, e: m.compactions_total,
    ),
    (
        "magnitude_kv_compaction_seconds",
        "Seconds spent compacting the KV cache (and checking whether to).",
        lambda m, s, e: m.compaction_seconds_total,
    ),
    (
        "magnitude_prompt_cache_lookup_tokens",
        "Prompt tokens of admitted requests that could use the prefix cache.",
        lambda m, s, e: s.prompt_tokens_looked_up,
    ),
    (
        "magnitude_prompt_cache_hit_tokens",
        "Prompt tokens copied from the prefix cache instead of computed.",
        lambda m, s, e: s.prompt_tokens_cached,
    ),
    (
        "magnitude_prompt_cache_restored_tokens",
        "Prompt tokens the prefix cache brought back from its RAM tier.",
        lambda m, s, e: s.prompt_tokens_restored,
    ),
    (
        "magnitude_prefix_cache_spilled_entries",
        "Prefix-cache entries moved to the RAM tier for being idle while other rows were decoded.",
        lambda m, s, e: s.prefix_cache_spilled,
    ),
    ("magnitude_preemptions", "Running requests preempted for lack of KV cells.", lambda m, s, e: s.preemptions),
    ("magnitude_preempted_cells", "KV cells preempted requests gave back.", lambda m, s, e: s.preempted_cells),
    (
        "magnitude_preempted_seconds",
        "Seconds preempted requests waited to resume.",
        lambda m, s, e: s.preempted_seconds,
    ),
    (
        "magnitude_prompt_cache_respelled_tokens",
        "Cached answer tokens reused where the prompt's tokens spelled the same text otherwise.",
        lambda m, s, e: s.prompt_tokens_respelled,
    ),
    (
        "magnitude_prompt_cache_window_missed_tokens",
        "Cached prompt tokens not reused because a sliding window had moved past them.",
        lambda m, s, e: s.prompt_tokens_window_missed,
    ),
    (
        "magnitude_prompt_cache_window_checkpoint_tokens",
        "Cached prompt tokens reused through a window checkpoint of a sliding-window model.",
        lambda m, s, e: s.prompt_tokens_window_checkpoint,
    ),
)
ENGINE_GAUGES: tuple[tuple[str, str, Reading], ...] = (
    (
        "magnitude_kv_usage_ratio",
        "KV cells reserved by running requests / all cells.",
        lambda m, s, e: s.kv_cells_reserved / s.kv_cells_total if s.kv_cells_total else 0.0,
    ),
    ("magnitude_kv_cells_used", "KV cells holding tokens.", lambda m, s, e: s.kv_cells_used),
    ("magnitude_prefix_cache_cells", "KV cells held by prefix-cache entries.", lambda m, s, e: s.prefix_cache_cells),
    ("magnitude_prefix_cache_entries", "Prefix-cache entries in the KV cache.", lambda m, s, e: s.prefix_cache_entries),
    (
        "magnitude_prefix_cache_ram_bytes",
        "Saved prefix-cache entries in RAM.",
        lambda m, s, e: s.prefix_cache_ram_bytes,
    ),
    ("magnitude_requests_running", "Requests being decoded.", lambda m, s, e: s.running),
    ("magnitude_requests_waiting", "Requests queued for KV cells or a slot.", lambda m, s, e: s.waiting),
    ("magnitude_requests_preempted", "Preempted requests waiting to resume.", lambda m, s, e: s.preempted_waiting),
    (
        "magnitude_preempted_state_bytes",
        "Preempted reproducible requests' KV states held in memory.",
        lambda m, s, e: s.preempted_state_bytes,
    ),
    (
        "magnitude_recent_tokens_per_second",
        "Generated tokens/s over the last seconds.",
        lambda m, s, e: e.recent_tokens_per_s,
    ),
)


class PoolCollector:
    """Every resident model's figures, one label value per model (a model that unloads leaves);
    `tenant`: the one tenant whose scrape this is (None: the owner's, everything)."""

    def __init__(self, pool: ModelPool, tenant: str | None = None) -> None:
        self.pool = pool
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}

        def family(kind: type, name: str, help_text: str, labels: tuple[str, ...] = ("model",)) -> Any:
            if name not in families:
                families[name] = kind(name, help_text, labels=list(labels))
            return families[name]

        loaded = family(GaugeMetricFamily, "magnitude_model_loaded", "1 for each resident model.")
        memory = family(GaugeMetricFamily, "magnitude_model_memory_bytes", "Planned memory of a resident model.")
        for resident in self.pool.residents():
            engine = resident.engine
            loaded.add_metric([engine.model_id], 1.0 if engine.ready else 0.0)
            memory.add_metric([engine.model_id], resident.plan.resident)
            self._engine(engine, family)
        yield from families.values()

    def _engine(self, engine: Engine, family: Callable[..., Any]) -> None:
        stats = engine.stats()
        metrics = engine.metrics
        model, sched = stats.model, stats.scheduler
        self._tenants(metrics, model, family)
        if self.tenant is None:  # what sums every tenant's requests: the owner's only
            requests = family(
                CounterMetricFamily, "magnitude_requests", "Finished requests by outcome.", ("model", "outcome")
            )
            for outcome in OUTCOMES:
                requests.add_metric([model, outcome], metrics.requests_by_outcome.get(outcome, 0))
            for name, help_text, read in ENGINE_COUNTERS:
                family(CounterMetricFamily, name, help_text).add_metric([model], read(metrics, sched, stats))
            for name, help_text, hist in (
                ("magnitude_time_to_first_token_seconds", "Arrival to first token.", metrics.ttft),
                ("magnitude_e2e_request_latency_seconds", "Arrival to last token.", metrics.e2e),
            ):
                _add_histogram(family(HistogramMetricFamily, name, help_text), model, hist)
        for name, help_text, read in ENGINE_GAUGES:
            family(GaugeMetricFamily, name, help_text).add_metric([model], read(metrics, sched, stats))
        self._slo(engine, model, family)

    def _tenants(self, metrics: EngineMetrics, model: str, family: Callable[..., Any]) -> None:
        """A server with several API keys: each tenant's requests and tokens (a tenant's scrape: its own)."""
        tenant_requests, tenant_tokens = metrics.tenant_counts()
        if self.tenant is not None:
            tenant_requests = {k: v for k, v in tenant_requests.items() if k[0] == self.tenant}
            tenant_tokens = {k: v for k, v in tenant_tokens.items() if k[0] == self.tenant}
        if not tenant_requests:
            return
        by_tenant = family(
            CounterMetricFamily,
            "magnitude_tenant_requests",
            "Finished requests by API key (tenant) and outcome.",
            ("model", "tenant", "outcome"),
        )
        for (tenant, outcome), n_requests in sorted(tenant_requests.items()):
            by_tenant.add_metric([model, tenant, outcome], n_requests)
        tokens = family(
            CounterMetricFamily,
            "magnitude_tenant_tokens",
            "Prompt and generated tokens of finished requests, by API key (tenant).",
            ("model", "tenant", "kind"),
        )
        for (tenant, kind), n_tokens in sorted(tenant_tokens.items()):
            tokens.add_metric([model, tenant, kind], n_tokens)

    def _slo(self, engine: Engine, model: str, family: Callable[..., Any]) -> None:
        """Each objective set for the model, judged over its rolling window (slo.py)."""
        settings = self.pool.settings.model_slo(model)
        window = family(GaugeMetricFamily, "magnitude_slo_window_seconds", "The window objectives are judged over.")
        if settings.any:
            window.add_metric([model], settings.window)
        # Every family is declared, objectives set or not: dashboards and rules find them on any server.
        metrics = {name: family(GaugeMetricFamily, name, text, ("model", "objective")) for name, text in SLO_GAUGES}
        for state in evaluate(settings, engine.metrics.finished_since):
            values = (state.objective, state.current, state.compliance, state.burn_rate, state.requests)
            for (name, _), value in zip(SLO_GAUGES, values, strict=True):
                if value is not None:
                    metrics[name].add_metric([model, state.name], float(value))


def make_registry(pool: ModelPool, tenant: str | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(pool, tenant))
    return registry


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) for one scrape."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
