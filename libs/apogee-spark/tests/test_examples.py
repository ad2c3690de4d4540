"""The examples under examples/spark: the Kubernetes manifest against the Kubernetes schemas,
and the batch export run against a real cluster."""

from __future__ import annotations

import importlib.util
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from pyspark.sql import SparkSession
from spark_support import Cluster, send

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "spark"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_job_manifest_is_valid_kubernetes() -> None:
    documents = [d for d in yaml.safe_load_all((EXAMPLES / "job.yaml").read_text()) if d]
    assert {d["kind"] for d in documents} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PersistentVolumeClaim",
        "Job",
    }
    for document in documents:
        kubernetes_validate.validate(document, "1.30", strict=True)
    [job] = [d for d in documents if d["kind"] == "Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--master") + 1].startswith("k8s://")
    assert "/opt/apogee/examples/spark/streaming_aggregate.py" in args


@pytest.mark.integration
def test_the_export_writes_the_time_range_to_parquet(
    spark: SparkSession, cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = "SparkExport"
    cluster.create_topic(topic, queues=2)
    begin = datetime.now(UTC)
    send(cluster.namesrv, topic, [str(i) for i in range(200)])
    # the range ends a millisecond after the last store time, and the late ones come after it
    end = datetime.now(UTC) + timedelta(milliseconds=2)
    while datetime.now(UTC) <= end:
        pass
    send(cluster.namesrv, topic, [f"late-{i}" for i in range(20)])
    out = tmp_path / "export"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "export_parquet.py",
            "--namesrv",
            cluster.namesrv,
            "--topic",
            topic,
            "--begin",
            begin.isoformat(),
            "--end",
            end.isoformat(),
            "--out",
            str(out),
        ],
    )
    _example("export_parquet").main()
    rows = spark.read.parquet(str(out)).collect()
    assert sorted(bytes(r.body).decode() for r in rows) == sorted(str(i) for i in range(200))
