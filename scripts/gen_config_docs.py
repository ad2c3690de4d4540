"""Rewrite docs/configuration.md from the settings classes of every package."""

from __future__ import annotations

from pathlib import Path

from apogee.client.consumer.config import config_reference as consumer_reference
from apogee.client.producer.config import config_reference as producer_reference
from apogee.common.configdoc import HEADER
from apogee.store.config import config_reference as store_reference
from apogee_broker.settings import config_reference as broker_reference
from apogee_console.settings import config_reference as console_reference
from apogee_nameserver.settings import config_reference as nameserver_reference
from apogee_operator.settings import config_reference as operator_reference
from apogee_schedule.settings import config_reference as schedule_reference
from apogee_txn_checker.settings import config_reference as txn_checker_reference

SECTIONS = [
    store_reference,
    nameserver_reference,
    broker_reference,
    schedule_reference,
    txn_checker_reference,
    operator_reference,
    console_reference,
    producer_reference,
    consumer_reference,
]


def main() -> None:
    target = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    target.write_text(HEADER + "\n".join(section() for section in SECTIONS))
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
