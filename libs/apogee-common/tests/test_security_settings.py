"""The security settings every service inherits: loaded like the service's own fields (file and
environment), documented, and checked with the setting and the rule named."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from apogee.common.configdoc import render_class
from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import SecuritySettings, doc, load

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True, slots=True)
class DemoSettings(SecuritySettings):
    listen: str = doc("127.0.0.1:1", "Where.")

    def __post_init__(self) -> None:
        self.check_security(calls_services=True)


def test_the_fields_load_from_file_and_environment_and_are_documented(tmp_path: Path) -> None:
    config = tmp_path / "demo.toml"
    config.write_text('[demo]\ntls_cert_file = "/tls/tls.crt"\ntls_key_file = "/tls/tls.key"\n')
    s = load(
        DemoSettings,
        "demo",
        config,
        {"APOGEE_DEMO_TLS_CA_FILE": "/tls/ca.crt", "APOGEE_DEMO_TLS_CLIENT_AUTH": "require"},
    )
    assert (s.tls_cert_file, s.tls_key_file, s.tls_ca_file, s.tls_client_auth) == (
        "/tls/tls.crt",
        "/tls/tls.key",
        "/tls/ca.crt",
        "require",
    )
    assert s.listen == "127.0.0.1:1"
    assert (s.auth_enabled, s.auth_max_skew_s) == (False, 900.0)
    table = render_class(DemoSettings, "Demo", "A demo.")
    for f in dataclasses.fields(SecuritySettings):
        assert f.metadata["doc"]
        assert f"| `{f.name}` |" in table


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls_cert_file": "c"}, "tls_key_file: must name the key of tls_cert_file"),
        ({"tls_key_file": "k"}, "tls_cert_file: must name the certificate of tls_key_file"),
        ({"tls_ca_file": "ca"}, "tls_ca_file: has no effect without tls_cert_file (TLS is off)"),
        ({"tls_server_name": "x"}, "tls_server_name: has no effect without tls_cert_file"),
        (
            {"tls_cert_file": "c", "tls_key_file": "k", "tls_client_auth": "maybe"},
            "tls_client_auth: 'maybe' is not one of none, optional, require",
        ),
        (
            {"tls_cert_file": "c", "tls_key_file": "k", "tls_client_auth": "require"},
            "tls_ca_file: must name the CA of client certificates when tls_client_auth is require",
        ),
        ({"auth_max_skew_s": 0.0}, "auth_max_skew_s: must be above 0, got 0.0"),
        ({"auth_enabled": True}, "auth_users_file: must name the users file when auth_enabled"),
        (
            {"auth_enabled": True, "auth_users_file": "users.toml"},
            "auth_credentials_file: must name this service's access key file when auth_enabled",
        ),
    ],
)
def test_bad_values_name_the_setting(values: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        DemoSettings(**values)
    assert str(err.value).startswith(message)


def test_good_combinations() -> None:
    DemoSettings(tls_cert_file="c", tls_key_file="k")
    DemoSettings(tls_cert_file="c", tls_key_file="k", tls_ca_file="ca", tls_client_auth="optional")
    DemoSettings(auth_enabled=True, auth_users_file="u.toml", auth_credentials_file="me.toml")
    # a service that calls no other needs no credentials of its own
    SecuritySettings(auth_enabled=True, auth_users_file="u.toml").check_security()
