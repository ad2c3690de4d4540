"""Why messages died: a consumer group's dead-letter topic summarised by original topic and
failure reason (the brokers' ``DLQ_ORIGIN_TOPIC``, ``DLQ_REASON`` and ``ATTEMPTS`` properties).

    spark-submit examples/spark/dlq_summary.py --namesrv ns-0:9876 --group order-workers
"""

from __future__ import annotations

import argparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from apogee.spark import register


def summarise(spark: SparkSession, namesrv: str, group: str) -> DataFrame:
    """The group's dead letters per original topic and reason, the most first."""
    register(spark)
    dead = (
        spark.read.format("apogee")
        .option("namesrv", namesrv)
        .option("topic", f"%DLQ%{group}")
        .load()
    )
    props = F.col("properties")
    return (
        dead.select(
            F.coalesce(props["DLQ_ORIGIN_TOPIC"], F.lit("?")).alias("topic"),
            # as the consumer gave it, on one line (the SDK's consumers send the exception's
            # type and message)
            F.coalesce(props["DLQ_REASON"], F.lit("(none)")).alias("reason"),
            # the deliveries that failed, as the broker counted them (an orderly consumer's own
            # count is not in the message's reconsume times)
            F.coalesce(props["ATTEMPTS"].cast("int"), F.col("delivery_attempt")).alias("attempts"),
            "store_timestamp",
        )
        .groupBy("topic", "reason")
        .agg(
            F.count("*").alias("messages"),
            F.max("attempts").alias("most_attempts"),
            F.min("store_timestamp").alias("first"),
            F.max("store_timestamp").alias("last"),
        )
        .orderBy(F.desc("messages"), "topic", "reason")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()

    spark = SparkSession.builder.appName("apogee-dlq-summary").getOrCreate()
    summarise(spark, args.namesrv, args.group).show(args.top, truncate=80)


if __name__ == "__main__":
    main()
