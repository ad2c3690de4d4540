# Every Python image of Apogee: the six services' and the tools image apogee/cli, one final stage
# each. An image is its workspace distribution (PACKAGE) and only what it depends on, from
# uv.lock; its target stage sets how it runs. Build them all with scripts/images.sh, or one by
# hand from the repository root:
#   podman build --format docker --target broker --build-arg PACKAGE=apogee-broker \
#       -t apogee/broker:dev .
# (docker build works too; podman needs --format docker to keep the HEALTHCHECK). The target
# is the image's name, PACKAGE the distribution named in its pyproject.toml:
#   nameserver  apogee-nameserver   (services/nameserver)
#   broker      apogee-broker       (services/broker)
#   schedule    apogee-schedule     (services/schedule)
#   txn-checker apogee-txn-checker  (services/txn-checker)
#   operator    apogee-operator     (services/operator)
#   console     apogee-console      (services/console)
#   cli         apogee-cli          (libs/apogee-cli)
#   spark-example apogee-spark      (libs/apogee-spark; the image of examples/spark/job.yaml)
# The file sits at the root because the root is every image's build context: the workspace's
# manifests (pyproject.toml files, uv.lock) and the sources of libs/ and services/
# (.dockerignore lets in nothing else, and of the test kit only its pyproject.toml).
#
# Stages: `python` (Debian's python3, 3.11, which the images run), `uv` (uv, for the builds),
# `manifests` (every workspace member's pyproject.toml and uv.lock, without any source), `deps`
# (PACKAGE's third-party dependencies, exactly as uv.lock pins them, hashes checked, into the
# virtual environment /opt/venv), `app` (PACKAGE and the Apogee libraries it uses, into
# /opt/apogee, which a .pth file puts on the venv's path), `runtime` (python, the user 10001,
# /opt/venv, then /opt/apogee), and one stage per image on `runtime`. The stages up to
# `manifests` do not depend on PACKAGE, so they are built once for all the images; a change of
# source rebuilds only `app` and what follows it. The Spark example's image is a stage here too
# (on `python` rather than `runtime`: it runs Spark, with Java, as Spark's own user).
# Behind a TLS-intercepting proxy, hand the build its CA bundle as the secret `ca`
# (`--secret id=ca,src=<bundle>`); scripts/images.sh does.

ARG PACKAGE

FROM debian:bookworm-slim AS python
# Versions follow the Debian release (bookworm and its security updates), not pins.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc/* /usr/share/man/*

FROM python AS uv
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
ARG UV_VERSION=0.13.9
RUN --mount=type=secret,id=ca,target=/run/secrets/ca \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi \
    && python3 -m venv /opt/uv \
    && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}"
ENV PATH=/opt/uv/bin:$PATH \
    UV_PYTHON=/usr/bin/python3.11 \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1

# uv reads uv.lock only with every workspace member's pyproject.toml at hand (the root
# pyproject.toml's [tool.uv.workspace] members: libs/*, services/*, testkit). The test kit is a
# member for development only: its pyproject.toml comes in, its source never does.
FROM debian:bookworm-slim AS manifests
WORKDIR /src
COPY pyproject.toml uv.lock ./
COPY libs libs
COPY services services
COPY testkit/pyproject.toml testkit/
RUN find libs services -type f ! -name pyproject.toml -delete

FROM uv AS deps
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PACKAGE
WORKDIR /src
COPY --from=manifests /src ./
RUN --mount=type=secret,id=ca,target=/run/secrets/ca \
    --mount=type=cache,target=/root/.cache/uv \
    : "${PACKAGE:?build with --build-arg PACKAGE=<distribution> and --target <image>}" \
    && if [ -s /run/secrets/ca ]; then export SSL_CERT_FILE=/run/secrets/ca; fi \
    && uv export --frozen --no-dev --no-emit-workspace --package "${PACKAGE}" \
        --quiet -o /opt/requirements.txt \
    && uv venv --quiet /opt/venv \
    && uv pip install --quiet --python /opt/venv/bin/python --require-hashes --no-deps \
        -r /opt/requirements.txt \
    && echo /opt/apogee > /opt/venv/lib/python3.11/site-packages/apogee.pth

FROM deps AS app
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG PACKAGE
COPY libs libs
COPY services services
RUN --mount=type=secret,id=ca,target=/run/secrets/ca \
    --mount=type=cache,target=/root/.cache/uv \
    if [ -s /run/secrets/ca ]; then export SSL_CERT_FILE=/run/secrets/ca; fi \
    && uv export --frozen --no-dev --no-editable --no-hashes --package "${PACKAGE}" --quiet \
        | grep '^\./' > /opt/members.txt \
    && uv pip install --quiet --python /opt/venv/bin/python --no-deps --target /opt/apogee \
        -r /opt/members.txt

# What every image runs on: Debian's python3, the user 10001 (no home, no shell) that each
# image's USER names, the third-party packages (one layer) and Apogee's code (the last layer).
FROM python AS runtime
RUN groupadd --gid 10001 apogee \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin apogee
COPY --from=deps /opt/venv /opt/venv
COPY --from=app /opt/apogee /opt/apogee
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# The services: settings come from the environment (APOGEE_<SERVICE>_*, docs/configuration.md)
# or a config file (--config). They listen on 127.0.0.1 unless told otherwise: in a container,
# every address. SIGTERM to the exec-form entrypoint stops each gracefully.

# The nameserver (PACKAGE=apogee-nameserver). It keeps everything in memory and writes
# nothing, so it runs with a read-only root filesystem.
FROM runtime AS nameserver
ENV APOGEE_NAMESERVER_LISTEN=0.0.0.0:9876 \
    APOGEE_NAMESERVER_METRICS_LISTEN=0.0.0.0:9880
WORKDIR /var/lib/apogee
USER 10001:10001
EXPOSE 9876 9880
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "apogee.rpc.probe", "127.0.0.1:9876"]
ENTRYPOINT ["python", "-m", "apogee_nameserver"]

# The broker (PACKAGE=apogee-broker). The default data_dir, data/broker-a under the working
# directory /var/lib/apogee, lands on the volume /var/lib/apogee/data: the only place it writes
# (with /tmp), so it runs with a read-only root filesystem. The directory belongs to the user,
# so a new volume mounted there does too. Set APOGEE_BROKER_ADVERTISED_ADDRESS to an address
# clients reach (docs/deployment.md), APOGEE_BROKER_BROKER_NAME and APOGEE_BROKER_NAMESRV.
FROM runtime AS broker
RUN mkdir -p /var/lib/apogee/data \
    && chown 10001:10001 /var/lib/apogee/data
ENV APOGEE_BROKER_LISTEN=0.0.0.0:10911 \
    APOGEE_BROKER_METRICS_LISTEN=0.0.0.0:10912
WORKDIR /var/lib/apogee
USER 10001:10001
VOLUME ["/var/lib/apogee/data"]
EXPOSE 10911 10912
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "apogee.rpc.probe", "127.0.0.1:10911"]
ENTRYPOINT ["python", "-m", "apogee_broker"]

# The schedule service (PACKAGE=apogee-schedule); set APOGEE_SCHEDULE_NAMESRV. Its progress is
# kept at the brokers; it writes only its lock file, in /tmp, so it runs with a read-only root
# filesystem. Replicas choose their active one by that file, so they must share it (a shared
# volume); run one replica otherwise. The health check asks for apogee.schedule.Process,
# SERVING while the process runs, standby or active. SIGTERM lets deliveries in flight finish
# and commits the progress.
FROM runtime AS schedule
ENV APOGEE_SCHEDULE_LOCK_FILE=/tmp/schedule.lock \
    APOGEE_SCHEDULE_LISTEN=0.0.0.0:9700 \
    APOGEE_SCHEDULE_METRICS_LISTEN=0.0.0.0:9710
WORKDIR /var/lib/apogee
USER 10001:10001
EXPOSE 9700 9710
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "apogee.rpc.probe", "127.0.0.1:9700", "apogee.schedule.Process"]
ENTRYPOINT ["python", "-m", "apogee_schedule"]

# The transaction checker (PACKAGE=apogee-txn-checker); set APOGEE_TXN_CHECKER_NAMESRV. Its
# progress is kept at the brokers; it writes only its lock file, in /tmp, so it runs with a
# read-only root filesystem. Replicas choose their active one by that file, so they must share
# it (a shared volume); run one replica otherwise. The health check asks for
# apogee.txn_checker.Process, SERVING while the process runs, standby or active. SIGTERM
# commits what each broker's round processed.
FROM runtime AS txn-checker
ENV APOGEE_TXN_CHECKER_LOCK_FILE=/tmp/txn-checker.lock \
    APOGEE_TXN_CHECKER_LISTEN=0.0.0.0:9701 \
    APOGEE_TXN_CHECKER_METRICS_LISTEN=0.0.0.0:9711
WORKDIR /var/lib/apogee
USER 10001:10001
EXPOSE 9701 9711
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "apogee.rpc.probe", "127.0.0.1:9701", "apogee.txn_checker.Process"]
ENTRYPOINT ["python", "-m", "apogee_txn_checker"]

# The operator (PACKAGE=apogee-operator, the kubernetes client among its dependencies); set
# APOGEE_OPERATOR_NAMESRV. It keeps no state: the resources are in the Kubernetes API server,
# the topics at the brokers. It talks to the API server as its pod's service account (the Helm
# chart's Role: Topics, ConsumerGroups, Leases); replicas choose their active one by a Lease.
# The health check asks for apogee.operator.Process, SERVING while the process runs, standby or
# active. SIGTERM lets a reconcile in flight finish and releases the Lease.
FROM runtime AS operator
ENV APOGEE_OPERATOR_LOCK_FILE=/tmp/operator.lock \
    APOGEE_OPERATOR_LISTEN=0.0.0.0:9702 \
    APOGEE_OPERATOR_METRICS_LISTEN=0.0.0.0:9712
WORKDIR /var/lib/apogee
USER 10001:10001
EXPOSE 9702 9712
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "apogee.rpc.probe", "127.0.0.1:9702", "apogee.operator.Process"]
ENTRYPOINT ["python", "-m", "apogee_operator"]

# The web console (PACKAGE=apogee-console); set APOGEE_CONSOLE_NAMESRV. It keeps nothing on
# disk (sessions live in the process; its pages are package data under /opt/apogee), so it
# runs with a read-only root filesystem. It serves HTTP on 8080 (HTTPS when
# APOGEE_CONSOLE_TLS_CERT_FILE and _KEY_FILE are set) and its own Prometheus metrics on 8081.
# The health check GETs /healthz (200 while the process serves; /readyz also asks a
# nameserver) with Python's urllib, as the image has no curl; over HTTPS when
# APOGEE_CONSOLE_TLS_CERT_FILE is set, trusting APOGEE_PROBE_TLS_CA (else the console's own CA
# file); the name in the certificate is not checked, since the check calls 127.0.0.1.
# docker-compose.yml repeats this check, character for character (e2e/test_compose.py checks).
FROM runtime AS console
ENV APOGEE_CONSOLE_LISTEN=0.0.0.0:8080 \
    APOGEE_CONSOLE_METRICS_LISTEN=0.0.0.0:8081
WORKDIR /var/lib/apogee
USER 10001:10001
EXPOSE 8080 8081
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, ssl, urllib.request as u; e = os.environ; tls = bool(e.get('APOGEE_CONSOLE_TLS_CERT_FILE')); c = ssl.create_default_context(cafile=e.get('APOGEE_PROBE_TLS_CA') or e.get('APOGEE_CONSOLE_TLS_CA_FILE') or None) if tls else None; c and setattr(c, 'check_hostname', False); u.urlopen(('https' if tls else 'http') + '://127.0.0.1:' + e.get('APOGEE_CONSOLE_LISTEN', ':8080').rpartition(':')[2] + '/healthz', timeout=4, context=c).read()"]
ENTRYPOINT ["python", "-m", "apogee_console"]

# The tools image (PACKAGE=apogee-cli): the `apogee` command. It runs no service: it is the
# image of the Helm chart's `helm test` pod and of throw-away client pods
# (`kubectl run ... --image=apogee/cli:<version> -- topic list`). The command takes the
# nameservers from APOGEE_NAMESRV (or --namesrv) and writes nothing when it talks to a
# cluster, so it runs with a read-only root filesystem; HOME=/tmp puts whatever a command keeps
# under $HOME on a writable /tmp (a tmpfs or an emptyDir). /opt/apogee/bin holds the command.
FROM runtime AS cli
ENV PATH=/opt/apogee/bin:$PATH \
    HOME=/tmp
WORKDIR /tmp
USER 10001:10001
# A command, not a service: nothing listens, so there is nothing to check.
HEALTHCHECK NONE
ENTRYPOINT ["apogee"]
CMD ["--help"]

# The image of examples/spark/job.yaml (PACKAGE=apogee-spark; scripts/images.sh spark-example):
# Debian's Java 17 and Python 3.11, Spark (the pyspark wheel, which carries Spark's jars, its
# Kubernetes scheduler among them) and apogee-spark with exactly what uv.lock pins, and the
# examples under /opt/apogee/examples/spark. Not built by the tests: it is 1.2 GB.
FROM python AS spark-example
# Spark needs a JRE, ps (its scripts call it) and an init that reaps what it forks.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps tini \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /usr/share/doc/* /usr/share/man/* \
    && useradd --uid 185 --create-home spark
COPY --from=deps /opt/venv /opt/venv
COPY --from=app /opt/apogee /opt/apogee
RUN ln -s /opt/venv/lib/python3.11/site-packages/pyspark /opt/spark
COPY examples/spark /opt/apogee/examples/spark
# Spark's executor entrypoint for Kubernetes: executor pods run the image with the argument
# "executor" and their settings in the environment
COPY --chmod=0755 examples/spark/executor-entrypoint.sh /opt/entrypoint.sh
ENV PATH=/opt/venv/bin:$PATH \
    SPARK_HOME=/opt/spark \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    PYTHONUNBUFFERED=1
USER 185
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/entrypoint.sh"]
