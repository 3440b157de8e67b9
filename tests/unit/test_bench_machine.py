"""The machine line of `make bench`'s report (bench/machine.py), read from /proc and /sys
trees written here: the CPU, and what an idle core does, which moves every c=1 row on a VM."""

from __future__ import annotations

from pathlib import Path

from hopline.bench import machine
from hopline.bench.suite_report import markdown


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_first_cpus_model_name_is_the_machines(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "cpuinfo",
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n\n"
        "processor\t: 1\nmodel name\t: Another One\n",
    )
    assert machine.cpu_model(tmp_path) == "Intel(R) Xeon(R) Processor"
    assert machine.cpu_model(tmp_path / "missing") == "unknown"


def test_a_vm_with_haltpoll_says_how_long_its_guest_polls(tmp_path: Path) -> None:
    _write(tmp_path, f"{machine.CPUIDLE}/current_driver", "haltpoll\n")
    _write(tmp_path, f"{machine.CPUIDLE}/current_governor_ro", "haltpoll\n")
    _write(tmp_path, machine.HALT_POLL, "0\n")
    assert machine.idle_setting(tmp_path) == "haltpoll/haltpoll, guest halt polling 0 ns"
    _write(tmp_path, machine.HALT_POLL, "200000\n")
    assert machine.idle_setting(tmp_path).endswith("guest halt polling 200000 ns")


def test_a_machine_without_haltpoll_names_its_driver_only(tmp_path: Path) -> None:
    _write(tmp_path, f"{machine.CPUIDLE}/current_driver", "intel_idle\n")
    _write(tmp_path, f"{machine.CPUIDLE}/current_governor", "menu\n")
    assert machine.idle_setting(tmp_path) == "intel_idle/menu"
    assert machine.idle_setting(tmp_path / "missing") == "none/none"


def test_the_report_names_the_machine_under_its_title() -> None:
    """A record from before bench/machine.py has no machine: its report has no such line."""
    doc: dict[str, object] = {
        "date": "2026-12-04T12:00:00+00:00",
        "host": "vm",
        "cores": 2,
        "scenarios": {},
        "targets_met": [],
    }
    assert "idle:" not in markdown(doc)
    doc["machine"] = {"cpu": "Xeon", "kernel": "6.18", "idle": "haltpoll/haltpoll"}
    lines = markdown(doc).splitlines()
    assert lines[2] == "CPU Xeon, kernel 6.18, idle: haltpoll/haltpoll"
