#!/usr/bin/env bash
# Build the container images, one per service and the tools image, from the repository root:
#
#   scripts/images.sh                      # every service in services/, and cli
#   scripts/images.sh broker               # only some (names as in services/)
#   scripts/images.sh cli                  # the `apogee` command (libs/apogee-cli)
#   scripts/images.sh prometheus           # the Debian-based Prometheus of compose's monitoring profile
#   scripts/images.sh etcd                 # the Debian-based etcd of docker-compose.replicas.yml
#   scripts/images.sh spark-example        # Spark with apogee-spark, for examples/spark/job.yaml
#   ENGINE=docker scripts/images.sh        # podman by default, docker when podman is missing
#   QUIET=1 scripts/images.sh              # print only the tags built (and errors)
#
# Each image is tagged apogee/<name>:<version> (the version in its pyproject.toml) and
# apogee/<name>:dev. The services' images and cli are stages of the one Dockerfile at the
# root: `--target <name> --build-arg PACKAGE=<the distribution its pyproject.toml names>`.
# Builds run one after the other: the stages they share are built by the first and reused by
# the others (the Spark example's too). Their FROM, debian:bookworm-slim, is taken from
# the engine's local images when it has it (scripts/container_engine.sh makes it on a machine
# that reaches no registry). When a CA
# bundle is found ($SSL_CERT_FILE or Debian's), it is handed to the builds as the secret `ca`,
# for package indexes reached through a TLS-intercepting proxy. What the images hold:
# docs/deployment.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SERVICES=()
for manifest in services/*/pyproject.toml; do
  service="${manifest#services/}"
  SERVICES+=("${service%/pyproject.toml}")
done

# The first `<key> = "..."` of a pyproject.toml (its [project] table comes first).
project_field() {
  sed -nE "s/^$1 = \"([^\"]+)\"/\1/p" "$2" | head -n 1
}

if [ -z "${ENGINE:-}" ]; then
  if command -v podman >/dev/null 2>&1; then
    ENGINE=podman
  elif command -v docker >/dev/null 2>&1; then
    ENGINE=docker
  else
    echo "images.sh: neither podman nor docker is installed (scripts/container_engine.sh installs podman)" >&2
    exit 1
  fi
fi

args=(build)
case "$ENGINE" in
  *podman*) args+=(--format docker --layers) ;; # docker format keeps HEALTHCHECK
  *docker*) export DOCKER_BUILDKIT=1 ;;
esac
[ -n "${QUIET:-}" ] && args+=(--quiet)
ca="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
[ -s "$ca" ] && args+=(--secret "id=ca,src=$ca")

names=("$@")
[ "${#names[@]}" -eq 0 ] && names=("${SERVICES[@]}" cli)

for name in "${names[@]}"; do
  stage=()
  if [ "$name" = prometheus ] || [ "$name" = etcd ]; then
    dockerfile="compose/$name/Dockerfile"
    version=dev
  elif [ "$name" = spark-example ]; then
    dockerfile=Dockerfile
    version="$(project_field version libs/apogee-spark/pyproject.toml)"
    stage=(--target spark-example --build-arg PACKAGE=apogee-spark)
  elif [ "$name" = cli ] || [ -f "services/$name/pyproject.toml" ]; then
    manifest="services/$name/pyproject.toml"
    [ "$name" = cli ] && manifest=libs/apogee-cli/pyproject.toml
    dockerfile=Dockerfile
    version="$(project_field version "$manifest")"
    stage=(--target "$name" --build-arg "PACKAGE=$(project_field name "$manifest")")
  else
    echo "images.sh: no image named '$name' (services: ${SERVICES[*]}; or cli, prometheus, etcd, spark-example)" >&2
    exit 2
  fi
  tags=(-t "apogee/$name:dev")
  if [ "$version" = dev ]; then
    version=""
  else
    tags+=(-t "apogee/$name:$version")
  fi
  if [ -n "${QUIET:-}" ]; then
    "$ENGINE" "${args[@]}" "${tags[@]}" -f "$dockerfile" "${stage[@]}" . >/dev/null
  else
    echo "==> apogee/$name ($dockerfile${stage[*]:+ ${stage[*]}}, $ENGINE)"
    "$ENGINE" "${args[@]}" "${tags[@]}" -f "$dockerfile" "${stage[@]}" .
  fi
  echo "built apogee/$name:dev${version:+ apogee/$name:$version}"
done
