"""``LLM.get_metrics()``'s answer: the engine's Prometheus registry read into plain objects,
vLLM's classes (``vllm.v1.metrics.reader``): Counter, Gauge, Histogram, and Vector for the one
counter kept per position (speculative decoding's accepted tokens)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.samples import Sample

_VECTOR = "vllm:spec_decode_num_accepted_tokens_per_pos"  # its "position" label indexes the values


@dataclass
class Metric:
    """One metric under one set of labels (an engine may report a name under several)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """Counters indexed by position (no Prometheus type: a counter with a "position" label)."""

    values: list[int]


@dataclass
class Histogram(Metric):
    """``buckets``: each bucket's upper bound as Prometheus writes it ("0.5", "+Inf") to the count
    of observations up to it (cumulative, as in Prometheus); ``count``: all of them."""

    count: int
    sum: float
    buckets: dict[str, int]


def _key(labels: dict[str, str], drop: str | None = None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``vllm:`` gauge, counter and histogram in the registry, one object per label set."""
    found: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith("vllm:"):
            continue
        if family.type == "gauge":
            found += [Gauge(family.name, s.labels, s.value) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name == family.name + "_total"]
            if family.name == _VECTOR:
                found += _vectors(family.name, totals)
            else:
                found += [Counter(family.name, s.labels, int(s.value)) for s in totals]
        elif family.type == "histogram":
            found += _histograms(family.name, family.samples)
    return found


def _vectors(name: str, samples: list[Sample]) -> list[Metric]:
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = int(s.value)
    return [Vector(name, dict(k), [v.get(i, 0) for i in range(max(v) + 1)]) for k, v in by_labels.items()]


def _histograms(name: str, samples: list[Sample]) -> list[Metric]:
    parts: dict[tuple, dict] = {}
    for s in samples:
        part = parts.setdefault(_key(s.labels, "le"), {"buckets": {}, "count": 0, "sum": 0.0})
        if s.name == name + "_bucket":
            part["buckets"][s.labels["le"]] = int(s.value)
        elif s.name == name + "_count":
            part["count"] = int(s.value)
        elif s.name == name + "_sum":
            part["sum"] = s.value
    return [Histogram(name, dict(k), p["count"], p["sum"], p["buckets"]) for k, p in parts.items()]
