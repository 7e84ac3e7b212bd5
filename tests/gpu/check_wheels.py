"""Check a folder of wheels for the GPU machine: one version per project, every need met.

Usage: python check_wheels.py WHEEL_DIR [IMAGE_PACKAGE ...]

Every ``Requires-Dist`` of every wheel, its marker evaluated for CPython 3.12 on x86-64 Linux
(extras not asked for are skipped), must be met by a wheel in WHEEL_DIR (version included) or
be one of IMAGE_PACKAGE, which the machine's image holds. Prints the needs left to the image;
exits 1 naming each unmet need or duplicate project.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

__all__ = ["main", "unmet"]

TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
          "platform_machine": "x86_64", "os_name": "posix"}


def _requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    return [Requirement(line) for line in metadata.get_all("Requires-Dist") or []]


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({**TARGET, "extra": ""})


def unmet(wheels: list[Path], image: set[str]) -> tuple[list[str], list[str]]:
    """(problems, needs left to the image) of ``wheels``."""
    carried: dict[str, Version] = {}
    problems: list[str] = []
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in carried:
            problems.append(f"{name}: two versions ({carried[name]} and {version}); pip would refuse the install")
        carried[name] = version
    from_image: list[str] = []
    for wheel in wheels:
        for req in filter(_applies, _requires(wheel)):
            need = canonicalize_name(req.name)
            if need in carried:
                if not req.specifier.contains(carried[need], prereleases=True):
                    problems.append(f"{wheel.name} needs {req}, the carried wheel is {carried[need]}")
            elif need in image:
                from_image.append(f"{wheel.name}: {req}")
            else:
                problems.append(f"{wheel.name} needs {req}: neither carried nor in the image")
    return problems, from_image


def main(argv: list[str]) -> int:
    folder, image = Path(argv[0]), {canonicalize_name(n) for n in argv[1:]}
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        print(f"check_wheels: no wheels in {folder}", file=sys.stderr)
        return 1
    problems, from_image = unmet(wheels, image)
    print("carried:", ", ".join(w.name for w in wheels))
    print("left to the image:\n  " + "\n  ".join(from_image))
    for problem in problems:
        print("check_wheels:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
