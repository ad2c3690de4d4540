"""The public protocol, ``apache.rocketmq.v2.MessagingService`` (the official RocketMQ 5
clients'), served on the broker's gRPC port beside the internal one."""
