"""OperatorSettings: the defaults (a Lease, the pod's namespace), the environment, refusals
naming the setting, the generated configuration reference, and the command's exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.service.leader_settings import LeadershipKind
from apogee.service.lease import LeaseLeadership
from apogee_operator.__main__ import main
from apogee_operator.app import OperatorApp
from apogee_operator.settings import config_reference, load_settings

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_defaults_and_the_environment() -> None:
    s = load_settings(env={})
    assert s.leadership is LeadershipKind.LEASE
    assert (s.lease_name, s.watch_namespace, s.resync_s) == ("apogee-operator", "", 60.0)
    env = {
        "APOGEE_OPERATOR_NAMESRV": "ns-0:9876;ns-1:9876",
        "APOGEE_OPERATOR_WATCH_NAMESPACE": "*",
        "APOGEE_OPERATOR_RESYNC_S": "30",
        "APOGEE_OPERATOR_LEASE_IDENTITY": "operator-7",
        "APOGEE_OPERATOR_LEASE_NAMESPACE": "apogee",
    }
    s = load_settings(env=env)
    assert s.nameservers == ["ns-0:9876", "ns-1:9876"]
    assert (s.watch_namespace, s.resync_s) == ("*", 30.0)
    app = OperatorApp(s)
    assert isinstance(app.leadership, LeaseLeadership)
    assert app.leadership.identity == "operator-7"
    assert app.leadership.store.where == "Lease apogee/apogee-operator"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"APOGEE_OPERATOR_WATCH_NAMESPACE": "Apogee"}, "watch_namespace: 'Apogee' is not"),
        ({"APOGEE_OPERATOR_RESYNC_S": "0"}, "resync_s: must be between 0.1 and 86400"),
        ({"APOGEE_OPERATOR_LEADERSHIP": "vote"}, "'vote' is not one of: file, lease"),
        (
            {"APOGEE_OPERATOR_LEASE_RENEW_DEADLINE_S": "30"},
            "lease_renew_deadline_s: must lie between",
        ),
    ],
)
def test_bad_settings_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(Exception, match=message):
        load_settings(env=env)


def test_bad_settings_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namesrv", "nowhere"]) == 2
    assert "namesrv: 'nowhere' is not host:port" in capsys.readouterr().err


def test_configuration_reference_matches_operator_settings() -> None:
    assert config_reference() in DOC.read_text(), (
        "docs/configuration.md is out of date: run `uv run python scripts/gen_config_docs.py`"
    )
