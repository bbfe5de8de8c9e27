#!/bin/sh
# Installs the Debian packages the project builds and tests with.  Idempotent:
# it installs only what is missing and says what that is.
set -eu
# The second line is what tests use as real peers: curl and the Prometheus
# server and promtool (gateway, metrics), clang's libFuzzer (fuzzers), kubectl
# (rendering the Kubernetes manifests), Python's ZeroMQ and protobuf (the
# Python client).
pkgs="build-essential cmake pkg-config libzmq3-dev libhiredis-dev libprotobuf-c-dev
      protobuf-c-compiler redis-server libcjson-dev libmicrohttpd-dev docker-compose
      curl prometheus clang libclang-rt-14-dev python3-zmq python3-protobuf
      protobuf-compiler"
missing=""
# kubectl from Debian's kubernetes-client, unless some other package has put
# one on the PATH already (the two conflict over /usr/bin/kubectl).
command -v kubectl >/dev/null 2>&1 || pkgs="$pkgs kubernetes-client"
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
    # shellcheck disable=SC2086 # unquoted: the list on one line
    echo "install-deps: all packages present:" $pkgs
    exit 0
fi
echo "install-deps: installing:$missing (apt-get; a minute or more on a fresh machine)"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
# apt's "Unpacking"/"Setting up" lines are the progress.
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends $missing
echo "install-deps: done"
