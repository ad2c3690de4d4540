"""The rows a read gives: one per message.

======================  ===================  ==============================================
column                  type                 what
======================  ===================  ==============================================
``topic``               string               the topic
``broker``              string               the broker that stores the queue
``queue``               int                  the queue id on that broker
``queue_offset``        long                 the message's offset in its queue
``message_id``          string               the producer's unique id
``keys``                array<string>        the message's keys
``tags``                string               its tag (null when it has none)
``body``                binary               its body, decompressed
``properties``          map<string,string>   user properties (not with includeProperties=false)
``born_timestamp``      timestamp            when the producer made it
``store_timestamp``     timestamp            when the broker stored it
``delivery_attempt``    int                  1 + the times it was consumed again (retries)
======================  ===================  ==============================================
"""

from __future__ import annotations

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)


def spark_schema(include_properties: bool = True) -> StructType:
    fields = [
        StructField("topic", StringType(), False),
        StructField("broker", StringType(), False),
        StructField("queue", IntegerType(), False),
        StructField("queue_offset", LongType(), False),
        StructField("message_id", StringType(), True),
        StructField("keys", ArrayType(StringType(), False), True),
        StructField("tags", StringType(), True),
        StructField("body", BinaryType(), True),
    ]
    if include_properties:
        fields.append(StructField("properties", MapType(StringType(), StringType(), False), True))
    fields += [
        StructField("born_timestamp", TimestampType(), True),
        StructField("store_timestamp", TimestampType(), True),
        StructField("delivery_attempt", IntegerType(), True),
    ]
    return StructType(fields)


def arrow_schema(include_properties: bool = True) -> pa.Schema:
    fields = [
        pa.field("topic", pa.string(), False),
        pa.field("broker", pa.string(), False),
        pa.field("queue", pa.int32(), False),
        pa.field("queue_offset", pa.int64(), False),
        pa.field("message_id", pa.string()),
        pa.field("keys", pa.list_(pa.field("element", pa.string(), nullable=False))),
        pa.field("tags", pa.string()),
        pa.field("body", pa.binary()),
    ]
    if include_properties:
        fields.append(
            pa.field(
                "properties",
                pa.map_(pa.string(), pa.field("value", pa.string(), nullable=False)),
            )
        )
    fields += [
        pa.field("born_timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("store_timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("delivery_attempt", pa.int32()),
    ]
    return pa.schema(fields)
