"""Batch export: every message of a topic stored in a time range, to Parquet files partitioned
by day.

    spark-submit examples/spark/export_parquet.py --namesrv ns-0:9876 --topic Orders \
        --begin 2026-11-20T00:00:00Z --end 2026-11-21T00:00:00Z --out /data/export/orders
"""

from __future__ import annotations

import argparse
from datetime import datetime

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from apogee.spark import register


def epoch_ms(text: str) -> int:
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        raise SystemExit(f"{text!r}: give a UTC offset or Z")
    return int(when.timestamp() * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--begin", required=True, help="ISO 8601 with a UTC offset")
    parser.add_argument("--end", required=True, help="ISO 8601 with a UTC offset (excluded)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    spark = SparkSession.builder.appName("apogee-export-parquet").getOrCreate()
    register(spark)
    # per queue: from the first message stored at or after --begin to the first at or after --end
    messages = (
        spark.read.format("apogee")
        .option("namesrv", args.namesrv)
        .option("topic", args.topic)
        .option("startingOffsets", str(epoch_ms(args.begin)))
        .option("endingOffsets", str(epoch_ms(args.end)))
        .load()
    )
    (
        messages.withColumn("day", F.to_date("store_timestamp"))
        .write.mode("overwrite")
        .partitionBy("day")
        .parquet(args.out)
    )


if __name__ == "__main__":
    main()
