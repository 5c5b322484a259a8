# Settings and helpers shared by scripts/testenv/up and down (sourced).
# shellcheck shell=bash

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
# dockerd needs iptables and docker-proxy from the sbin directories.
export PATH=/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin

STATE_RUN=/run/cri-shim-testenv         # PID files of what up started
STATE_LIB=/var/lib/cri-shim-testenv     # registry storage, image build scratch
STATE_LOG=/var/log/cri-shim-testenv     # daemon logs

# Debian's client matches Debian's dockerd; another docker CLI may be earlier on PATH.
DOCKER_CLI=/usr/bin/docker
DOCKER_SOCKET=/var/run/docker.sock
REGISTRY=127.0.0.1:5000
BUSYBOX_REF=$REGISTRY/busybox:1.36
PAUSE_REF=$REGISTRY/pause:3.10

# systemd brings systemd-socket-activate (deploy tests); openssl makes the streaming TLS test
# certificate; runc runs the containers inside runv VMs; containernetworking-plugins puts the CNI
# plugins (bridge, host-local, portmap, loopback, ...) in /usr/lib/cni, and iproute2 the `ip`
# that the CNI tests make their network namespaces with. criu (~2 MB with its libraries) is what
# docker's and runv's checkpoint refusals quote (`criu check`); their tests use a stub of it.
APT_PACKAGES="docker.io docker-registry busybox-static gcc libc6-dev iptables curl procps ca-certificates systemd openssl runc containernetworking-plugins iproute2 criu"

say() { echo "testenv: $*" >&2; }
fail() { say "error: $*"; exit 1; }

dock() { "$DOCKER_CLI" -H "unix://$DOCKER_SOCKET" "$@"; }
engine_answers() { [ -S "$DOCKER_SOCKET" ] && timeout 10 "$DOCKER_CLI" -H "unix://$DOCKER_SOCKET" version >/dev/null 2>&1; }
registry_answers() { curl -fsS -m 5 "http://$REGISTRY/v2/" >/dev/null 2>&1; }
registry_holds() { # REPO TAG
    curl -fsS -m 5 -o /dev/null -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
        "http://$REGISTRY/v2/$1/manifests/$2" 2>/dev/null
}

# running NAME: the PID recorded for NAME is a live process.
running() {
    local f=$STATE_RUN/$1.pid
    [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

# launch NAME CMD...: start CMD in its own session, detached, and record its PID.
launch() {
    local name=$1
    shift
    mkdir -p "$STATE_RUN" "$STATE_LOG"
    setsid "$@" >>"$STATE_LOG/$name.log" 2>&1 </dev/null &
    echo $! >"$STATE_RUN/$name.pid"
    say "$name started, pid $!, log $STATE_LOG/$name.log"
}

# poll SECONDS CMD...: run CMD every half second until it succeeds.
poll() {
    local n=$(($1 * 2))
    shift
    while [ "$n" -gt 0 ]; do
        "$@" && return 0
        sleep 0.5
        n=$((n - 1))
    done
    return 1
}

# halt NAME SECONDS: TERM the recorded PID, KILL it after SECONDS.
halt() {
    local name=$1 secs=$2 f=$STATE_RUN/$1.pid pid
    [ -s "$f" ] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        poll "$secs" eval "! kill -0 $pid 2>/dev/null" || { say "$name still alive, KILL"; kill -KILL "$pid" 2>/dev/null || true; }
    fi
    rm -f "$f"
}
