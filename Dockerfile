# The cri-shim image: Python 3.11 from Debian 12, the shim in a virtualenv, tini as PID 1.
#
#   docker build --build-arg BASE_IMAGE=debian:bookworm-slim -t cri-shim:0.1.0 .
#
# BASE_IMAGE must be Debian 12 (bookworm) or derived from it: both stages take
# python3 from its apt sources, and the virtualenv built in the first runs on
# the interpreter of the second. Without registry access, build a base locally
# with deploy/build-base-image.sh (debootstrap + docker import) and pass its tag.
# deploy/build-image.sh does both and works behind a TLS-intercepting proxy.
# See deploy/README.md for how to run it on a node (mounts, privileges).

ARG BASE_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------- build
FROM ${BASE_IMAGE} AS build
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv binutils \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/image/ /tmp/image-extra/
COPY . /src
# extra-ca.crt (optional) is trusted for this stage's downloads only.
RUN set -eu; \
    if [ -f /tmp/image-extra/extra-ca.crt ]; then export PIP_CERT=/tmp/image-extra/extra-ca.crt; fi; \
    python3 -m venv /opt/cri-shim; \
    /opt/cri-shim/bin/pip install --no-cache-dir --no-compile --disable-pip-version-check /src; \
    /opt/cri-shim/bin/pip uninstall -y --disable-pip-version-check pip setuptools; \
    rm -f /opt/cri-shim/bin/activate* /opt/cri-shim/bin/Activate.ps1; \
    find /opt/cri-shim -name '__pycache__' -prune -exec rm -rf {} +; \
    # The wheels' extensions carry their symbol tables (uvloop's: 12 of its 14 MB),
    # and some wheels ship their Cython/C sources and their own tests.
    find /opt/cri-shim -name '*.so' -exec strip --strip-unneeded {} +; \
    find /opt/cri-shim \( -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' -o -name '*.c' -o -name '*.h' \) -delete; \
    rm -rf /opt/cri-shim/lib/python3.11/site-packages/certifi/tests; \
    install -m 0644 /src/deploy/healthcheck.py /opt/cri-shim/healthcheck.py; \
    /opt/cri-shim/bin/cri-shim version

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 tini \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
        /usr/share/doc /usr/share/man /usr/share/locale \
        /usr/lib/python3.11/ensurepip /usr/lib/python3.11/idlelib /usr/lib/python3.11/lib2to3 \
        /usr/lib/python3.11/pydoc_data /usr/lib/python3.11/tkinter /usr/lib/python3.11/turtledemo \
        /usr/lib/python3.11/test /usr/lib/python3.11/unittest /usr/lib/python3.11/_pydecimal.py
COPY --from=build /opt/cri-shim /opt/cri-shim
# Byte-compiled once here, where the interpreter is the one that runs them:
# a read-only root filesystem then costs no start-up time.
RUN python3 -m compileall -q -j 0 /opt/cri-shim/lib > /dev/null \
    && ln -s /opt/cri-shim/bin/cri-shim /usr/local/bin/cri-shim \
    && mkdir -p /run/cri-shim /var/lib/cri-shim /var/log/pods /etc/cri-shim

ENV PATH=/opt/cri-shim/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CRI_SHIM_HEALTH_TARGET=unix:///run/cri-shim/cri-shim.sock

# Volumes a node mounts (same paths inside and out: the Engine resolves the
# bind mounts the shim asks for on the host):
#   /run/cri-shim        the CRI socket, for the kubelet and crictl
#   /var/lib/cri-shim    the shim's persisted records (must survive the container)
#   /var/log/pods        the container logs the kubelet reads
#   /var/run/docker.sock the Docker Engine (docker handler)
#   /sys/fs/cgroup:ro    container statistics
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["/opt/cri-shim/bin/python", "/opt/cri-shim/healthcheck.py"]

# -s: tini reaps orphans also when it is not PID 1 (--pid host, hostPID: true).
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "/opt/cri-shim/bin/cri-shim"]
CMD ["serve", "--listen", "unix:///run/cri-shim/cri-shim.sock", "--state-dir", "/var/lib/cri-shim", \
     "--default-handler", "docker"]

LABEL org.opencontainers.image.title="cri-shim" \
      org.opencontainers.image.description="Kubernetes CRI v1 shim: docker, runv and fake runtimes behind one gRPC server" \
      org.opencontainers.image.licenses="Apache-2.0"
