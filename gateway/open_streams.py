"""How many streams (PredictStream, ModelStreamInfer) a gateway holds open, in all and by
tenant.

An open stream costs the gateway memory whether or not it sends (about 30 KB idle, a helper's
probe), and a stream is not a request in flight, so admission's limits never saw one: a
client opened 5,000 and a gateway would have taken any number. Past
`HOPLINE_GATEWAY_MAX_STREAMS` a new stream is refused RESOURCE_EXHAUSTED before it reads a
message; once a second tenant has opened a stream on this gateway, no tenant holds more than
half of them, so one tenant's streams cannot lock the others out. Streams already open are
never cut. Each gateway worker process counts its own.
"""

from __future__ import annotations

import grpc

from hopline.gateway.admission import Refusal, Tenancy
from hopline.gateway.errors import RequestError
from hopline.observability import metrics

MAX_STREAMS_ENV = "HOPLINE_GATEWAY_MAX_STREAMS"


class OpenStreams:
    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams  # 0: no limit
        self.open_by_tenant: dict[str, int] = {}
        self.total = 0
        self.tenancy = Tenancy()  # shared once a second tenant has opened a stream here

    def open(self, tenant: str) -> None:
        """A place for one stream of `tenant`; RequestError when there is none."""
        self._admit(tenant)
        self.total += 1
        self.open_by_tenant[tenant] = self.open_by_tenant.get(tenant, 0) + 1

    def close(self, tenant: str) -> None:
        self.total -= 1
        left = self.open_by_tenant[tenant] - 1
        if left:
            self.open_by_tenant[tenant] = left
        else:
            del self.open_by_tenant[tenant]

    def _admit(self, tenant: str) -> None:
        self.tenancy.seen(tenant)
        if not self.max_streams:
            return
        if self.total >= self.max_streams:
            raise _refused(
                f"the gateway holds {self.total} open streams, its limit "
                f"({MAX_STREAMS_ENV}): close streams you do not use, send requests on the "
                "ones you hold, or retry after a backoff"
            )
        held = self.open_by_tenant.get(tenant, 0)
        share = max(1, self.max_streams // 2)
        if self.tenancy.shared and held >= share:
            raise _refused(
                f"this tenant holds {held} open streams, half the gateway's "
                f"{self.max_streams} ({MAX_STREAMS_ENV}), the rest kept for its other "
                "tenants: send requests on the streams you hold, or close some"
            )


def _refused(message: str) -> RequestError:
    metrics.GATEWAY_REFUSED.labels(Refusal.STREAMS.value).inc()
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
