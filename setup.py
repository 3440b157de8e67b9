"""Finds hopline's packages: the repository root is `hopline`, each folder below a subpackage.

Everything else (metadata, dependencies, the package-dir rule) is in pyproject.toml; this
file only spares a hand-kept package list.
"""

from setuptools import find_packages, setup

# Top-level folders that hold Python code; tests/ and the non-Python folders stay out.
CODE_FOLDERS = (
    "runtime",
    "model",
    "services",
    "gateway",
    "cache",
    "observability",
    "protos",
    "cli",
    "bench",
)

setup(
    packages=[
        "hopline",
        *(
            f"hopline.{name}"
            for name in find_packages(include=[f"{folder}*" for folder in CODE_FOLDERS])
        ),
    ]
)
