"""Topic to topic: count a topic's messages per tag and minute, and send each count as JSON to
another topic (exactly once on restart, through the broker's dedup window).

    spark-submit examples/spark/streaming_aggregate.py \
        --namesrv ns-0:9876 --source Orders --target OrderCounts --checkpoint /data/cp/counts
"""

from __future__ import annotations

import argparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from apogee.spark import register


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--available-now", action="store_true", help="read what is there, stop")
    args = parser.parse_args()

    spark = SparkSession.builder.appName("apogee-streaming-aggregate").getOrCreate()
    register(spark)
    counts = (
        spark.readStream.format("apogee")
        .option("namesrv", args.namesrv)
        .option("topic", args.source)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", 100_000)
        .load()
        .withWatermark("store_timestamp", "2 minutes")
        .groupBy(
            F.window("store_timestamp", "1 minute"), F.coalesce("tags", F.lit("")).alias("tag")
        )
        .count()
    )
    out = counts.select(
        F.col("tag").alias("tags"),
        F.concat_ws("@", "tag", F.col("window.start").cast("string")).alias("keys"),
        F.to_json(
            F.struct(
                F.col("window.start").alias("minute"),
                F.col("tag"),
                F.col("count").alias("messages"),
            )
        ).alias("body"),
    )
    writer = (
        out.writeStream.format("apogee")
        .outputMode("append")
        .option("namesrv", args.namesrv)
        .option("topic", args.target)
        .option("checkpointLocation", args.checkpoint)
    )
    query = writer.trigger(availableNow=True).start() if args.available_now else writer.start()
    query.awaitTermination()


if __name__ == "__main__":
    main()
