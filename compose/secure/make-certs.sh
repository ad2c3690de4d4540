#!/usr/bin/env bash
# Makes what docker-compose.secure.yml mounts: a CA of its own, one certificate for every
# Apogee service of docker-compose.yml, a client certificate, and the users and credentials
# files, with random secret keys. For a development machine: see README.md beside this script.
#
#   compose/secure/make-certs.sh [--force] [DIR]    # DIR: where to write (default: beside it)
#
# Writes into DIR:
#   ca/ca.key                       the CA's key (0600; never mounted)
#   tls/ca.crt tls/tls.crt tls/tls.key
#                                   the CA's certificate, and the services' certificate and key,
#                                   mounted on /etc/apogee/tls in every Apogee container
#   auth/users.toml                 the users: the services' identity (service = true), an
#                                   admin (admin = "write", every topic and group)
#   auth/credentials.toml           the services' own access key and secret key
#   auth/console-users.toml         the web console's own users: `admin` (role admin) and
#                                   `viewer` (role read), random passwords, scrypt
#                                   (all three mounted on /etc/apogee/auth)
#   client/credentials.toml         the admin's, for clients on this machine
#   client/console-passwords.txt    the console users' passwords
#   client/client.crt client/client.key
#                                   a client certificate (for APOGEE_TLS_CLIENT_AUTH=require)
#
# The services' certificate names the compose services (nameserver, broker-a, broker-b,
# schedule, txn-checker, console, prometheus), localhost, 127.0.0.1 and the brokers' advertised host
# (APOGEE_ADVERTISED_HOST, else <APOGEE_NET_PREFIX>.1, as docker-compose.yml computes it): run
# it again with --force after changing those. The containers run as uid 10001, which the
# mounted files do not belong to: the files they read are readable by every user here.
set -euo pipefail

force=0
if [ "${1:-}" = "--force" ]; then
  force=1
  shift
fi
dir="${1:-$(cd "$(dirname "$0")" && pwd)}"
days="${APOGEE_CERT_DAYS:-365}"
advertised="${APOGEE_ADVERTISED_HOST:-${APOGEE_NET_PREFIX:-10.89.213}.1}"

command -v openssl >/dev/null || { echo "make-certs.sh: openssl is not installed" >&2; exit 1; }
openssl kdf -help >/dev/null 2>&1 || {
  echo "make-certs.sh: needs OpenSSL 3 or later (openssl kdf: scrypt for the console's users)" >&2
  exit 1
}
if [ -e "$dir/tls/tls.crt" ] && [ "$force" -eq 0 ]; then
  echo "make-certs.sh: $dir/tls/tls.crt exists; --force makes everything anew (new secret keys too)" >&2
  exit 1
fi

mkdir -p "$dir/ca" "$dir/tls" "$dir/auth" "$dir/client"
chmod 0700 "$dir/ca" "$dir/client"
chmod 0755 "$dir/tls" "$dir/auth"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# a SAN entry per name: IP: for addresses, DNS: for the rest
san() {
  local out="" name
  for name in "$@"; do
    if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then
      out="$out,IP:$name"
    else
      out="$out,DNS:$name"
    fi
  done
  echo "${out#,}"
}

# the CA
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -subj "/CN=Apogee compose CA" -addext basicConstraints=critical,CA:TRUE \
  -addext keyUsage=critical,keyCertSign,cRLSign \
  -keyout "$dir/ca/ca.key" -out "$dir/tls/ca.crt" 2>/dev/null
chmod 0600 "$dir/ca/ca.key"
chmod 0644 "$dir/tls/ca.crt"

# issue NAME KEY CRT EXTENSIONS: a certificate signed by the CA
issue() {
  local cn="$1" key="$2" crt="$3" ext="$4"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$cn" \
    -keyout "$key" -out "$work/$cn.csr" 2>/dev/null
  printf '%b' "$ext" > "$work/$cn.ext"
  openssl x509 -req -in "$work/$cn.csr" -CA "$dir/tls/ca.crt" -CAkey "$dir/ca/ca.key" \
    -CAcreateserial -CAserial "$work/ca.srl" -days "$days" -out "$crt" \
    -extfile "$work/$cn.ext" 2>/dev/null
}

# the services' certificate: server and client (the services present it to each other)
names=(nameserver broker-a broker-b schedule txn-checker console prometheus localhost 127.0.0.1)
if [[ " ${names[*]} " != *" $advertised "* ]]; then
  names+=("$advertised")
fi
issue apogee "$dir/tls/tls.key" "$dir/tls/tls.crt" \
  "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=$(san "${names[@]}")\n"
chmod 0644 "$dir/tls/tls.crt" "$dir/tls/tls.key"

# a client certificate for clients on this machine
issue apogee-client "$dir/client/client.key" "$dir/client/client.crt" \
  "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n"
chmod 0600 "$dir/client/client.key" "$dir/client/client.crt"

# the users, with random secret keys
service_secret="$(openssl rand -hex 24)"
admin_secret="$(openssl rand -hex 24)"
cat > "$dir/auth/users.toml" <<TOML
# Made by compose/secure/make-certs.sh; the format: docs/security.md. The services read this
# file again within a second of a change (add users here).

# The services' own identity (brokers, schedule, txn-checker): every right, and what only
# services may do.
[[users]]
access_key = "apogee-service"
secret_key = "$service_secret"
service = true

# An administrator, for clients on this machine (client/credentials.toml).
[[users]]
access_key = "apogee-admin"
secret_key = "$admin_secret"
admin = "write"
[users.topics]
"*" = "PUB|SUB"
[users.groups]
"*" = "SUB"
TOML
cat > "$dir/auth/credentials.toml" <<TOML
access_key = "apogee-service"
secret_key = "$service_secret"
TOML
cat > "$dir/client/credentials.toml" <<TOML
access_key = "apogee-admin"
secret_key = "$admin_secret"
TOML
chmod 0644 "$dir/auth/users.toml" "$dir/auth/credentials.toml"
chmod 0600 "$dir/client/credentials.toml"

# the console's own users: [[users]] entries as `python -m apogee_console.passwd NAME --role R`
# prints them (password = "scrypt$n=16384,r=8,p=1$<salt>$<key>", base64), made here with
# OpenSSL 3's `openssl kdf` alone
console_user() {
  local name="$1" role="$2" password="$3" salt_hex salt key
  openssl rand 16 > "$work/salt"
  salt_hex="$(od -An -tx1 "$work/salt" | tr -d ' \n')"
  salt="$(openssl base64 -A < "$work/salt")"
  key="$(openssl kdf -binary -keylen 32 -kdfopt "pass:$password" -kdfopt "hexsalt:$salt_hex" \
    -kdfopt n:16384 -kdfopt r:8 -kdfopt p:1 SCRYPT | openssl base64 -A)"
  printf '[[users]]\nname = "%s"\npassword = "scrypt$n=16384,r=8,p=1$%s$%s"\nrole = "%s"\n\n' \
    "$name" "$salt" "$key" "$role"
}
admin_password="$(openssl rand -hex 12)"
viewer_password="$(openssl rand -hex 12)"
{
  echo "# Made by compose/secure/make-certs.sh: the web console's own users (docs/deployment.md,"
  echo "# the console). Add one with: python -m apogee_console.passwd NAME --role read|admin"
  echo "# (the password on its standard input); the console reads this file again on a change."
  echo
  console_user admin admin "$admin_password"
  console_user viewer read "$viewer_password"
} > "$dir/auth/console-users.toml"
chmod 0644 "$dir/auth/console-users.toml"
cat > "$dir/client/console-passwords.txt" <<TEXT
web console (https://127.0.0.1:8080/): user admin (role admin), password $admin_password
web console (https://127.0.0.1:8080/): user viewer (role read), password $viewer_password
TEXT
chmod 0600 "$dir/client/console-passwords.txt"

echo "make-certs.sh: wrote $dir/{ca,tls,auth,client}; certificate for: ${names[*]}"
