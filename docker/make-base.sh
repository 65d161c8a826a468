#!/bin/sh
# Makes a Debian bookworm base image with no container registry: debootstrap fetches the packages
# from Debian's mirror, the host's CA bundle and resolver go in (so apt and pip inside trust the same
# roots and find the same names), and the tree is imported as one layer.
#   sudo docker/make-base.sh                      -> image specvox-base:bookworm
#   podman build --build-arg BASE=localhost/specvox-base:bookworm -f docker/Dockerfile -t specvox .
# Where a registry is reachable none of this is needed: the Dockerfile's default base is
# debian:bookworm-slim. Needs root, debootstrap and podman (or docker: ENGINE=docker).
set -eu
IMAGE=${1:-specvox-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ENGINE=${ENGINE:-podman}
DIR=$(mktemp -d /tmp/specvox-base.XXXXXX)
trap 'rm -rf "$DIR"' EXIT

debootstrap --variant=minbase bookworm "$DIR" "$MIRROR"
mkdir -p "$DIR/etc/ssl/certs" "$DIR/usr/local/share/ca-certificates"
cp /etc/ssl/certs/ca-certificates.crt "$DIR/etc/ssl/certs/ca-certificates.crt"
# The host's own CAs (e.g. a proxy's) too, where update-ca-certificates finds them when the image
# installs Debian's ca-certificates and rebuilds the bundle.
cp /usr/local/share/ca-certificates/*.crt "$DIR/usr/local/share/ca-certificates/" 2>/dev/null || true
cp /etc/resolv.conf "$DIR/etc/resolv.conf"
# bookworm-updates and security, as debian:bookworm-slim has them.
cat > "$DIR/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
# What debian:bookworm-slim drops: apt's package lists and caches (the Dockerfile runs apt-get update).
rm -rf "$DIR"/var/lib/apt/lists/* "$DIR"/var/cache/apt/*.bin "$DIR"/var/cache/apt/archives/*.deb
tar -C "$DIR" -c . | "$ENGINE" import --change 'CMD ["/bin/bash"]' - "$IMAGE"
echo "make-base: $IMAGE"
