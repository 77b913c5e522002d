"""What the three services can export to Prometheus, read from their metric modules' collectors
(every metric is declared at import, its labelled series or not): the series names and labels
that deploy/'s queries (KEDA's, the Grafana dashboard's) may name."""

from __future__ import annotations

import importlib

from prometheus_client import REGISTRY

MODULES = ("card.cache_service.metrics", "card.target_service.metrics", "card.draft_service.metrics")
# the series each type exposes and the labels a suffix adds (prometheus_client's own); a counter's
# or a histogram's bare name is no series, so a query on it reads nothing
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",),
            "gaugehistogram": ("_bucket", "_gsum", "_gcount")}
SUFFIX_LABELS = {"_bucket": frozenset({"le"})}


def metric_labels() -> dict[str, frozenset[str]]:
    """Every series name the services can export, with the label names it carries."""
    for module in MODULES:
        importlib.import_module(module)
    out: dict[str, frozenset[str]] = {}
    for collector in list(REGISTRY._collector_to_names):  # the registry's one index of collectors
        labels = getattr(collector, "_labelnames", None)
        if labels is None:  # a custom collector (process, gc, platform): its samples say
            for family in collector.collect():
                for sample in family.samples:
                    out[sample.name] = out.get(sample.name, frozenset()) | set(sample.labels)
            continue
        for family in collector.describe():
            for suffix in SUFFIXES.get(family.type, ("",)):
                out[family.name + suffix] = frozenset(labels) | SUFFIX_LABELS.get(suffix, frozenset())
    return out


def exported_metrics() -> set[str]:
    """Every series name the services can export (counters' _total, histograms' _bucket, _sum and
    _count, ...; never a counter's or histogram's bare name)."""
    return set(metric_labels())
