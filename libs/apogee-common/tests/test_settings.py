"""Settings: defaults < config file < environment < command line, with errors naming the source."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import doc, env_name, load

pytestmark = pytest.mark.unit


class Mode(enum.Enum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class Demo:
    name: str = doc("broker-a", "a name")
    port: int = doc(10911, "a port")
    ratio: float = doc(0.5, "a ratio")
    enabled: bool = doc(False, "a switch")
    mode: Mode = doc(Mode.ASYNC, "an enum")
    peers: tuple[str, ...] = doc(("127.0.0.1:9876",), "a list")
    data: Path = doc(Path("data"), "a path")


def test_defaults() -> None:
    assert load(Demo, "demo") == Demo()


def test_each_layer_wins_over_the_one_before(tmp_path: Path) -> None:
    cfg = tmp_path / "demo.toml"
    cfg.write_text('[demo]\nname = "from-file"\nport = 1\nmode = "sync"\npeers = ["a:1", "b:2"]\n')
    env = {"APOGEE_DEMO_PORT": "2", "APOGEE_DEMO_ENABLED": "yes", "APOGEE_DEMO_PEERS": "x:1;y:2"}
    s = load(Demo, "demo", cfg, env, name=None, ratio="0.25")
    assert s == Demo(
        name="from-file",
        port=2,
        ratio=0.25,
        enabled=True,
        mode=Mode.SYNC,
        peers=("x:1", "y:2"),
    )
    assert env_name("demo", "port") == "APOGEE_DEMO_PORT"


def test_flat_file_without_table(tmp_path: Path) -> None:
    cfg = tmp_path / "flat.toml"
    cfg.write_text('name = "flat"\ndata = "/var/lib/apogee"\n')
    s = load(Demo, "demo", cfg)
    assert s.name == "flat"
    assert s.data == Path("/var/lib/apogee")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"APOGEE_DEMO_PORT": "abc"}, "APOGEE_DEMO_PORT: 'abc' is not an integer"),
        ({"APOGEE_DEMO_RATIO": "x"}, "APOGEE_DEMO_RATIO: 'x' is not a number"),
        (
            {"APOGEE_DEMO_ENABLED": "maybe"},
            "APOGEE_DEMO_ENABLED: 'maybe' is not a boolean (true/false)",
        ),
        ({"APOGEE_DEMO_MODE": "fast"}, "APOGEE_DEMO_MODE: 'fast' is not one of: sync, async"),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load(Demo, "demo", env=env)
    assert str(caught.value) == message


def test_unknown_key_in_file_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "demo.toml"
    cfg.write_text("[demo]\nprot = 1\n")
    with pytest.raises(InvalidArgumentError, match="prot: is not a demo setting"):
        load(Demo, "demo", cfg)


def test_unreadable_file(tmp_path: Path) -> None:
    cfg = tmp_path / "demo.toml"
    cfg.write_text("[demo\n")
    with pytest.raises(InvalidArgumentError, match="unreadable"):
        load(Demo, "demo", cfg)
    with pytest.raises(InvalidArgumentError, match="unreadable"):
        load(Demo, "demo", tmp_path / "missing.toml")


def test_other_services_tables_are_ignored(tmp_path: Path) -> None:
    cfg = tmp_path / "all.toml"
    cfg.write_text("[demo]\nport = 5\n[other]\nport = 6\n")
    assert load(Demo, "demo", cfg).port == 5
