#!/bin/sh
# Installs the Debian packages the project builds and tests with.  Idempotent:
# it installs only what is missing and says what that is.
set -eu
pkgs="build-essential cmake pkg-config libzmq3-dev libhiredis-dev libprotobuf-c-dev
      protobuf-c-compiler redis-server libcjson-dev docker-compose"
missing=""
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
