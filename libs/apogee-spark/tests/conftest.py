"""Fixtures of the Spark tests: one Spark session (``local[2]``) for the whole run, and local
clusters of real nameserver and broker processes (:mod:`apogee.local.cluster`), so that a
broker can be killed with SIGKILL and started again.

Spark's Python workers are processes of their own: they run this interpreter
(``PYSPARK_PYTHON``) and import :mod:`apogee.spark` from it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from apogee.spark import register

# the tests' helpers (spark_support.py) sit beside this file
sys.path.insert(0, str(Path(__file__).parent))

from spark_support import Cluster


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2]")
        .appName("apogee-spark-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.streaming.stopTimeout", "30s")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster.start(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield c
    finally:
        c.close()
