"""Topic to topic: count a topic's messages per tag and minute, and send each count as JSON to
another topic (exactly once on restart, through the broker's dedup window).

    spark-submit examples/spark/streaming_aggregate.py \
        --namesrv ns-0:9876 --source Orders --target OrderCounts --checkpoint /data/cp/counts
"""

from __future__ import annotations

import argparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from apogee.spark import register


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namesrv", required=True)
    parser.add_argument("--source", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument(
        "--available-now",
        action="store_true",
        help="read what is there, send the counts so far (open minutes too), stop",
    )
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
    # ISO 8601 with the offset: a key has no spaces
    minute = F.date_format("window.start", "yyyy-MM-dd'T'HH:mmXXX")
    out = counts.select(
        F.col("tag").alias("tags"),
        F.concat_ws("@", "tag", minute).alias("keys"),
        F.to_json(
            F.struct(minute.alias("minute"), F.col("tag"), F.col("count").alias("messages"))
        ).alias("body"),
    )
    if args.available_now:
        # the watermark closes a minute only once later messages arrive, and a bounded run sees
        # none: in append mode it would send nothing for the last minutes. So it sends, per
        # micro-batch, every minute whose count changed (update mode, which a data source sink
        # does not take: through foreachBatch), and a later run sends a minute again with its
        # new count. The latest message of a key is the minute's count; a micro-batch run again
        # sends its counts again (at least once), which changes nothing for that reader.
        def send(batch: DataFrame, _batch_id: int) -> None:
            (
                batch.write.format("apogee")
                .option("namesrv", args.namesrv)
                .option("topic", args.target)
                .mode("append")
                .save()
            )

        query = (
            out.writeStream.foreachBatch(send)
            .outputMode("update")
            .option("checkpointLocation", args.checkpoint)
            .trigger(availableNow=True)
            .start()
        )
    else:
        # each minute once, when the watermark has passed it
        query = (
            out.writeStream.format("apogee")
            .outputMode("append")
            .option("namesrv", args.namesrv)
            .option("topic", args.target)
            .option("checkpointLocation", args.checkpoint)
            .start()
        )
    query.awaitTermination()


if __name__ == "__main__":
    main()
