#!/usr/bin/env bash
# Makes a local stand-in for the official python:3.11-slim base image, for machines that reach no
# image registry (only Debian's mirror and PyPI): debootstrap a Debian bookworm with python3 (3.11),
# put a virtual environment at /opt/venv first on PATH (so `python` and `pip install` work as in the
# official image, without --break-system-packages), and import it with podman (or docker).
#
#   docker/base/make_base.sh                      # -> mcsd-base:bookworm
#   docker/base/make_base.sh --tag my-base:1 --engine docker --mirror http://deb.debian.org/debian
#   scripts/image_smoke.sh --base mcsd-base:bookworm ...   # then build the Dockerfile on it
#
# The extra CA certificates of this host (/usr/local/share/ca-certificates, e.g. a TLS-intercepting
# egress proxy's) are added to the image's trust store, and pip/requests/ssl are pointed at that
# store, so that pip inside the build trusts the same servers as pip on the host.  Needs root,
# debootstrap and about 500 MB in a temporary directory; the image is about 150 MB.
set -euo pipefail

TAG=mcsd-base:bookworm
ENGINE=
MIRROR=http://deb.debian.org/debian
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates

usage() {
    cat <<EOF
Usage: $0 [--tag IMAGE] [--engine podman|docker] [--mirror URL] [--suite SUITE]

  --tag IMAGE       name of the imported image (default: $TAG)
  --engine NAME     podman or docker (default: podman if it runs, else docker)
  --mirror URL      Debian mirror for debootstrap (default: $MIRROR)
  --suite SUITE     Debian suite (default: $SUITE; its python3 must match the torch wheel, 3.11)
  -h, --help        this text
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG=${2:?--tag needs a value}; shift 2 ;;
        --engine) ENGINE=${2:?--engine needs a value}; shift 2 ;;
        --mirror) MIRROR=${2:?--mirror needs a value}; shift 2 ;;
        --suite) SUITE=${2:?--suite needs a value}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "$0: unknown option: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [ -z "$ENGINE" ]; then
    if command -v podman >/dev/null && podman info >/dev/null 2>&1; then ENGINE=podman
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
    else echo "$0: neither podman nor docker can run here" >&2; exit 1
    fi
fi
command -v debootstrap >/dev/null || { echo "$0: debootstrap is missing (apt-get install -y debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "$0: debootstrap needs root" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/mcsd-base.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOTFS=$WORK/rootfs
start=$(date +%s)

echo "== debootstrap $SUITE ($PACKAGES) from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -30 "$WORK/debootstrap.log" >&2; exit 1; }

# The host's extra CAs, so TLS through an intercepting proxy works inside builds as it does here.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >/dev/null
fi

echo "== /opt/venv"
chroot "$ROOTFS" /usr/bin/python3 -m venv /opt/venv
# Slim it as the official image is: no apt lists, docs, man pages or caches.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* \
    "$ROOTFS"/usr/share/info/* "$ROOTFS"/var/cache/debconf/*-old "$ROOTFS"/var/log/*.log \
    "$ROOTFS"/root/.cache
find "$ROOTFS" -name __pycache__ -type d -prune -exec rm -rf {} +

echo "== import as $TAG ($ENGINE)"
bundle=/etc/ssl/certs/ca-certificates.crt
tar -C "$ROOTFS" --numeric-owner -c . | "$ENGINE" import \
    --change "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "ENV PIP_CERT=$bundle" \
    --change "ENV REQUESTS_CA_BUNDLE=$bundle" \
    --change "ENV SSL_CERT_FILE=$bundle" \
    --change 'CMD ["python3"]' \
    - "$TAG" >/dev/null

"$ENGINE" run --rm --network host "$TAG" python -c \
    'import sys, ssl; print("python", sys.version.split()[0], "at", sys.prefix)'
echo "== $TAG made in $(( $(date +%s) - start ))s, $("$ENGINE" image inspect --format '{{.Size}}' "$TAG") bytes"
