"""Rewrite docs/configuration.md from the settings classes of every package."""

from __future__ import annotations

from pathlib import Path

from apogee.common.configdoc import HEADER
from apogee.store.config import config_reference as store_reference

SECTIONS = [store_reference]


def main() -> None:
    target = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    target.write_text(HEADER + "\n".join(section() for section in SECTIONS))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
