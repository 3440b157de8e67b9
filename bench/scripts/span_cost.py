"""What one recorded span costs: the OpenTelemetry SDK's span and OTLP encoder against
hopline's (observability/spans.py, observability/otlp.py), on this machine's CPU.

A trace shaped like a co-located miss's (a server span and 11 spans under it, three attributes
each, one set at the end) is started and ended `--traces` times on each tracer, blocks taking
turns so drift hits both alike; the thread CPU per span is reported. Then the finished spans
are encoded into OTLP export requests of 64 (the batch hopline's processor sends) and
serialised, by the SDK's encoder and by hopline's: CPU per span. Nothing is sent: what the
export thread spends on the wire is the same for both.

Usage: .venv/bin/python bench/scripts/span_cost.py [--traces 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind, Tracer

from hopline.observability import schema
from hopline.observability.otlp import encode, encode_resource
from hopline.observability.spans import RecordedSpan, SpanTracer

ATTRS = {"rpc.system": "grpc", "rpc.service": "hopline.inference.v1.InferenceService"}
SPANS_PER_TRACE = 12
BATCH = 64


class Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def traces(tracer: Tracer, n: int) -> None:
    for _ in range(n):
        with tracer.start_as_current_span(
            schema.SPAN_STREAM_MESSAGE, kind=SpanKind.SERVER, attributes=ATTRS
        ):
            for _ in range(SPANS_PER_TRACE - 1):
                with tracer.start_as_current_span(
                    schema.SPAN_INFERENCE,
                    kind=SpanKind.CLIENT,
                    attributes={**ATTRS, "rpc.method": "Infer"},
                ) as span:
                    span.set_attribute("rpc.grpc.status_code", 0)


def per_span_us(work: Callable[[], Any], spans: int) -> float:
    started = time.thread_time()
    work()
    return (time.thread_time() - started) / spans * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    sdk_kept, ours_kept = Keep(), list[RecordedSpan]()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON), shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(sdk_kept))
    sdk = provider.get_tracer("hopline")
    ours = SpanTracer(ParentBased(ALWAYS_ON), ours_kept.append)
    spans = args.traces * SPANS_PER_TRACE
    start: dict[str, list[float]] = {"sdk": [], "hopline": []}
    for _ in range(args.rounds):
        # Only the last round's spans are kept: a growing heap would slow the collector.
        sdk_kept.spans.clear()
        ours_kept.clear()
        start["sdk"].append(per_span_us(lambda: traces(sdk, args.traces), spans))
        start["hopline"].append(per_span_us(lambda: traces(ours, args.traces), spans))

    resource = Resource.create({"service.name": "gateway"})
    ours_resource = encode_resource(resource)
    readable, recorded = sdk_kept.spans, ours_kept

    def sdk_encode() -> None:
        for i in range(0, len(readable), BATCH):
            encode_spans(readable[i : i + BATCH]).SerializeToString()

    def ours_encode() -> None:
        for i in range(0, len(recorded), BATCH):
            encode(ours_resource, recorded[i : i + BATCH]).SerializeToString()

    enc: dict[str, list[float]] = {"sdk": [], "hopline": []}
    for _ in range(args.rounds):
        enc["sdk"].append(per_span_us(sdk_encode, len(readable)))
        enc["hopline"].append(per_span_us(ours_encode, len(recorded)))

    print(f"{args.traces} traces of {SPANS_PER_TRACE} spans, {args.rounds} alternated rounds")
    print("CPU per span, us (median)      SDK   hopline")
    for label, figures in (("start + end, request's thread", start), ("OTLP encode", enc)):
        s, h = statistics.median(figures["sdk"]), statistics.median(figures["hopline"])
        print(f"  {label:<30} {s:6.1f}  {h:6.1f}   ({s / h:.1f}x)")


if __name__ == "__main__":
    main()
