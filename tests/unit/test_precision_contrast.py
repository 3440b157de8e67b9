"""`make bench`'s precision scenario measures model compute a second time with the other thread
setting: sleeping against spinning, whichever the inference service does not use."""

from hopline.bench.precision import _other_spin
from hopline.model.session import Spin


def test_spinning_service_is_contrasted_with_sleeping_threads() -> None:
    assert _other_spin(Spin.RUN) is Spin.OFF
    assert _other_spin(Spin.ALWAYS) is Spin.OFF


def test_sleeping_service_is_contrasted_with_spinning_threads() -> None:
    assert _other_spin(Spin.OFF) is Spin.RUN
