"""Export settings that cannot work fail the start naming their variable
(observability/tracing.py:check_export_settings): the SDK's messages named none, and an
endpoint's port past 65535 exported to the port modulo 65536, another listener's (an
observability probe: spans of 'modport' arrived on 87138 - 65536)."""

from __future__ import annotations

import pytest

from hopline.observability.tracing import check_export_settings


@pytest.mark.parametrize(
    ("environ", "said"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:87138"}, "port must be 1 to 65535"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:0"}, "port must be 1 to 65535"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:x"}, "port must be 1 to 65535"),
        ({"OTEL_BSP_SCHEDULE_DELAY": "abc"}, "OTEL_BSP_SCHEDULE_DELAY='abc': must be a number"),
        ({"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE='0': must be positive"),
        ({"OTEL_BSP_SCHEDULE_DELAY": "0"}, "OTEL_BSP_SCHEDULE_DELAY='0': must be positive"),
        ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"}, "is above OTEL_BSP_MAX_QUEUE_SIZE .2048."),
        ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1.5"}, "must be a whole number"),
    ],
)
def test_a_setting_that_cannot_work_is_named(environ: dict[str, str], said: str) -> None:
    with pytest.raises(ValueError, match=said) as refused:
        check_export_settings(environ)
    assert next(iter(environ)) in str(refused.value)


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://[::1]:4317"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4317"},
        # The traces-only variable is the one used when set.
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://a:4317",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "x:1x",
        },
        {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_BSP_MAX_QUEUE_SIZE": "2048"},
        {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096", "OTEL_BSP_MAX_QUEUE_SIZE": "8192"},
    ],
)
def test_settings_that_work_pass(environ: dict[str, str]) -> None:
    check_export_settings(environ)
