"""Benchmark of tracing's cost on the send path: async send throughput with tracing off and at
100% sampling, in the same run. A producer in this process, a nameserver and a broker as
separate processes (``apogee.local.cluster``, async flush), a fresh cluster for each case;
spans go with the real OTLP exporter (gRPC, batched) to a small OTLP receiver in a process of
its own (this script, run with ``--receiver``), which counts them.

Prints one JSON object per line (see ``figures.emit``), plus ``client_cpu_s`` and
``broker_cpu_s`` (CPU each process used during the case), ``spans_received`` (what reached the
receiver by the end of the case, its exporters flushed: the batch processors drop spans when
their queue is full, ``OTEL_BSP_MAX_QUEUE_SIZE``) and, for the traced cases, ``vs_off`` (the
throughput as a fraction of the ``off`` case's).

Cases (``send_nowait`` in a loop, at most ``--window`` sends unsettled, 1 KiB bodies):

- ``off``: no tracing anywhere (no OTEL_* setting, no provider): the producer holds no tracer.
- ``producer_on``: the producer traces every message (``tracer_provider`` with the ALWAYS_ON
  sampler): a send span per message and its ``traceparent`` in the record; the broker does not.
- ``on``: the producer as above, and the broker started with ``OTEL_TRACES_EXPORTER=otlp`` and
  ``OTEL_TRACES_SAMPLER=always_on``: a store span per message too.
- ``on_10pct``: both trace, the producer sampling one trace in ten
  (``ParentBased(TraceIdRatioBased(0.1))``) and the broker following its decision
  (``parentbased_traceidratio``): every message still carries its ``traceparent``; nine in ten
  spans are not recorded.

    python bench/tracing_bench.py            # about a minute
    python bench/tracing_bench.py --quick    # under 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, loop_name, run_async
from load import create_topics, windowed_sends

from apogee.client import Message, Producer
from apogee.local import cluster as local_cluster

TOPIC = "BenchTracing"
BODY = 1024
SAMPLE = 16  # the latency of one send in SAMPLE is measured
#: The batch span processor's queue, in this process and the broker's: room for a second or
#: two of spans at these rates (the default, 2048, drops most of them).
BSP_QUEUE = 65_536


def receiver_main() -> None:
    """``--receiver``: serve OTLP/gRPC ``TraceService/Export`` on a free port, print ``PORT
    <n>``, count the spans exported to it until SIGTERM, then print ``SPANS <n>``."""
    import grpc  # noqa: PLC0415 - only the receiver process serves
    from opentelemetry.proto.collector.trace.v1 import (  # noqa: PLC0415
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    count = 0
    lock = threading.Lock()

    class Counter(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(
            self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
        ) -> trace_service_pb2.ExportTraceServiceResponse:
            nonlocal count
            n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            with lock:
                count += n
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    )
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Counter(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"PORT {port}", flush=True)
    stop.wait()
    server.stop(grace=2).wait()
    with lock:
        print(f"SPANS {count}", flush=True)


class Receiver:
    """The receiver process of one case."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--receiver"], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["PORT"]:
            self.proc.kill()
            raise RuntimeError(f"the OTLP receiver did not start: {line}")
        self.endpoint = f"http://127.0.0.1:{line[1]}"

    def stop(self) -> int:
        """Stop it; the spans it received."""
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        for line in out.splitlines():
            if line.startswith("SPANS "):
                return int(line.split()[1])
        return -1


#: case -> the fraction of traces sampled (None: no tracing)
CASES: dict[str, float | None] = {"off": None, "producer_on": 1.0, "on": 1.0, "on_10pct": 0.1}


def broker_env(endpoint: str, ratio: float) -> dict[str, str]:
    sampler = (
        {"OTEL_TRACES_SAMPLER": "always_on"}
        if ratio >= 1
        else {
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": str(ratio),
        }
    )
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_MAX_QUEUE_SIZE": str(BSP_QUEUE),
        "OTEL_SERVICE_NAME": "bench-broker",
        **sampler,
    }


def provider_for(endpoint: str, ratio: float) -> Any:
    """The producer's provider: ``ratio`` of the traces sampled (1: every one), exported over
    OTLP/gRPC in batches."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    from opentelemetry.sdk.trace.sampling import (  # noqa: PLC0415
        ALWAYS_ON,
        ParentBased,
        TraceIdRatioBased,
    )

    sampler = ALWAYS_ON if ratio >= 1 else ParentBased(TraceIdRatioBased(ratio))
    provider = TracerProvider(sampler=sampler, resource=Resource({"service.name": "bench"}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=BSP_QUEUE))
    return provider


async def send_all(
    namesrv: str, count: int, window: int, provider: Any
) -> tuple[float, list[float], int, float]:
    """``count`` sends with ``send_nowait``, at most ``window`` unsettled; (seconds, sampled
    latencies, errors, this process's CPU seconds), timed until every send has its result."""
    msg = Message(TOPIC, os.urandom(BODY), tags="TagA")
    options: Mapping[str, Any] = {} if provider is None else {"tracer_provider": provider}
    async with Producer(namesrv, **options) as producer:
        assert (producer._tracer is None) == (provider is None)
        await asyncio.gather(*(producer.send(msg) for _ in range(500)))  # warm, not timed
        sent = await windowed_sends(producer, msg, count, window, SAMPLE)
    return sent.seconds, sent.latencies, sent.errors, sent.cpu_s


def run_case(
    case: str, count: int, window: int, loop: str, base: Path, off_rate: float | None
) -> float:
    """One case on a cluster of its own; returns its throughput."""
    receiver = Receiver()
    data = Path(tempfile.mkdtemp(prefix=f"tracing-bench-{case}-", dir=base))
    provider = None
    ratio = CASES[case]
    try:
        env = broker_env(receiver.endpoint, ratio) if ratio and case != "producer_on" else {}
        state = local_cluster.up(
            data,
            brokers=1,
            nameservers=1,
            broker_env=env,
            schedule=False,
            txn_checker=False,
            console=False,
        )
        broker = ProcessMeter(state.brokers[0].pid)
        run_async(create_topics(state.namesrv, [TOPIC]), loop)
        if ratio is not None:
            provider = provider_for(receiver.endpoint, ratio)
        out: list[tuple[float, list[float], int, float]] = []

        async def go() -> None:
            out.append(await send_all(state.namesrv, count, window, provider))

        broker_cpu0 = broker.cpu_s()
        run_async(go(), loop)
        broker_cpu = broker.cpu_s() - broker_cpu0
        seconds, lat, errors, cpu = out[0]
        if provider is not None:
            provider.shutdown()  # flushes what is still queued (not timed)
        local_cluster.down(data)  # the broker flushes its spans as it stops
        spans = receiver.stop()
        rate = count / seconds
        emit(
            case,
            count,
            BODY,
            seconds,
            lat,
            client_cpu_s=round(cpu, 2),
            broker_cpu_s=round(broker_cpu, 2),
            spans_received=spans,
            vs_off=round(rate / off_rate, 3) if off_rate else None,
            window=window,
            errors=errors,
            loop=loop,
            latency_of=f"send_nowait to its result (one send in {SAMPLE})",
        )
        return rate
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        if receiver.proc.poll() is None:
            receiver.proc.kill()
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    if "--receiver" in sys.argv[1:]:
        receiver_main()
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller runs, under 30 s in all")
    ap.add_argument("--messages", type=int, default=None, help="sends per case")
    ap.add_argument("--window", type=int, default=4096, help="unsettled sends at most")
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=None,
        help="this process's event loop (default: uvloop when installed)",
    )
    ap.add_argument("--dir", default=None, help="where to put the clusters (default: a temp dir)")
    args = ap.parse_args()
    for name in list(os.environ):
        if name.startswith("OTEL_"):
            del os.environ[name]  # the "off" case is off: nothing from the environment
    loop = loop_name(args.loop)
    count = args.messages or (30_000 if args.quick else 100_000)
    base = Path(args.dir or tempfile.gettempdir())
    off = run_case("off", count, args.window, loop, base, None)
    for case in CASES:
        if case != "off":
            run_case(case, count, args.window, loop, base, off)


if __name__ == "__main__":
    main()
