"""`make bench`'s precision scenario measures model compute a second time with the other thread
setting: sleeping against spinning, whichever the inference service does not use."""

from hopline.bench.precision import _other_spin, _speedups
from hopline.model.spin import Spin


def test_spinning_service_is_contrasted_with_sleeping_threads() -> None:
    assert _other_spin(Spin.RUN) is Spin.OFF
    assert _other_spin(Spin.ALWAYS) is Spin.OFF


def test_sleeping_service_is_contrasted_with_spinning_threads() -> None:
    assert _other_spin(Spin.OFF) is Spin.RUN


def test_int8_speedups_for_the_bound_are_the_second_models() -> None:
    compute = {
        "models": {
            "support-intents/1 (fp32)": {"batch_1": {"speedup_over_first": 1.0}},
            "support-intents/2 (int8)": {
                "batch_1": {"speedup_over_first": 1.8},
                "batch_32": {"speedup_over_first": 1.4},
            },
        }
    }
    assert _speedups(compute) == {"batch_1": 1.8, "batch_32": 1.4}
    assert _speedups(None) == {}
