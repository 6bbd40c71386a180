"""``docs/metrics.md`` is the catalogue of every metric the project exports, generated from the
names ``splitserve_contract`` defines (and the router's own module) by ``metrics_doc.py``. These
tests fail when the document is stale, or when a metric is added without a row."""

from __future__ import annotations

import metrics_doc
import pytest

from splitserve_contract import Metric, ModelServerMetric, OperatorMetric


def test_docs_metrics_md_is_current() -> None:
    assert metrics_doc.DOC.read_text() == metrics_doc.render(), (
        f"docs/metrics.md is stale: run `{metrics_doc.REGENERATE}`"
    )


def test_every_defined_metric_has_a_row_in_the_catalogue() -> None:
    doc = metrics_doc.render()
    names = [
        value
        for cls in (Metric, ModelServerMetric, OperatorMetric)
        for key, value in vars(cls).items()
        if key.isupper()
    ]
    names += metrics_doc.router_names(metrics_doc.ROUTER_METRICS_SOURCE.read_text())
    assert len(names) > 40
    assert [name for name in names if f"| `{name}` |" not in doc] == []


def test_a_router_metric_without_a_row_is_refused() -> None:
    source = metrics_doc.ROUTER_METRICS_SOURCE.read_text()
    with pytest.raises(ValueError, match="no row for splitserve_router_new_total"):
        metrics_doc.render(router_source=source + '\nX = "splitserve_router_new_total"\n')


def test_a_row_for_a_metric_no_longer_defined_is_refused() -> None:
    source = metrics_doc.ROUTER_METRICS_SOURCE.read_text().replace(
        '"splitserve_router_prefill_retries_total"', '"splitserve_router_renamed_total"'
    )
    with pytest.raises(ValueError, match="row for undefined splitserve_router_prefill_retries_total"):
        metrics_doc.render(router_source=source)
