#!/usr/bin/env bash
# Builds the Debian packages: pvcm-guest (for the VM) and pvcm-backend (for the host).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: packaging/build-debs.sh [--out DIR] [--no-build]

Builds two Debian packages from a release build of the workspace, with dpkg-deb:

  pvcm-guest_VERSION_amd64.deb    the VM's side: pvcm-guestd (the rdma_cm device through
      CUSE) and pvcm-guest (the CLI); the pvcm-guestd systemd unit and its defaults file;
      the modprobe.d rule that keeps the kernel's rdma_ucm, rdma_cm and ib_cm out; the
      modules-load.d entry for cuse and uio_pci_generic; the hugepages sysctl; the udev
      rule giving the rdma_cm node mode 0666; man pages; docs/apps.md.
  pvcm-backend_VERSION_amd64.deb  the host's side: pvcm-backend, its systemd unit
      (Type=notify) reading /etc/pvcm/backend.toml, a full example config, a man page,
      the docs.

Options:
  --out DIR    where the packages go (default: target/debian)
  --no-build   use the binaries already in target/release
  -h, --help   this help

Installs help2man (for the man pages) with apt when missing. VERSION is the
workspace's (Cargo.toml).
EOF
}

# shellcheck source-path=SCRIPTDIR source=../qemu-scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../qemu-scripts/lib.sh"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

out="$repo/target/debian" build=1
while [ $# -gt 0 ]; do
    case "$1" in
    --out)
        [ $# -ge 2 ] || die "--out needs a directory"
        out="$2"
        shift
        ;;
    --no-build) build=0 ;;
    -h | --help)
        usage
        exit 0
        ;;
    *) die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

command -v help2man >/dev/null || apt_install help2man
command -v dpkg-deb >/dev/null || die "dpkg-deb not found (Debian's dpkg)"

version="$(awk -F'"' '/^version = / { print $2; exit }' "$repo/Cargo.toml")"
[ -n "$version" ] || die "no version in $repo/Cargo.toml"
arch="$(dpkg --print-architecture)"
target="${CARGO_TARGET_DIR:-$repo/target}/release"
if [ "$build" = 1 ]; then
    log "cargo build --release (pvcm-guest, pvcm-backend)"
    (cd "$repo" && cargo build --release --locked -q -p pvcm-guest --bins -p pvcm-backend --bin pvcm-backend) ||
        die "cargo build failed"
fi
for b in pvcm-guestd pvcm-guest pvcm-backend; do
    [ -x "$target/$b" ] || die "no $target/$b (build first, or drop --no-build)"
done

mkdir -p "$out"
out="$(cd "$out" && pwd)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

# manpage PROG SECTION 'NAME LINE' DEST: a man page from PROG --help.
manpage() {
    mkdir -p "$(dirname "$4")"
    help2man --no-info --no-discard-stderr --section "$2" --name "$3" \
        --version-string "$version" "$1" | gzip -9n >"$4"
}

# copyright DEST: the license statement for /usr/share/doc/PKG/copyright, with the
# BSD text (LICENSE-BSD-3-Clause) and Debian's copy of the Apache license.
copyright() {
    {
        cat <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: pvcm

Files: *
Copyright: the pvcm developers
License: Apache-2.0 or BSD-3-Clause

License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0 (also LICENSE-APACHE in the source).

License: BSD-3-Clause
EOF
        sed -e 's/^$/./' -e 's/^/ /' "$repo/LICENSE-BSD-3-Clause"
    } >"$1"
}

# deb PKGROOT: builds the package rooted at PKGROOT into $out.
deb() {
    local root="$1" name
    name="$(awk '/^Package:/ { print $2 }' "$root/DEBIAN/control")"
    local size
    size="$(du -sk --exclude=DEBIAN "$root" | cut -f1)"
    echo "Installed-Size: $size" >>"$root/DEBIAN/control"
    find "$root" -type d -exec chmod 755 {} +
    dpkg-deb --root-owner-group -Zxz --build "$root" "$out/${name}_${version}_${arch}.deb" >/dev/null
    log "built $out/${name}_${version}_${arch}.deb"
}

# ---- pvcm-guest ----
g="$stage/pvcm-guest"
install -D -m 755 "$target/pvcm-guestd" "$g/usr/sbin/pvcm-guestd"
install -D -m 755 "$target/pvcm-guest" "$g/usr/bin/pvcm-guest"
strip --strip-debug "$g/usr/sbin/pvcm-guestd" "$g/usr/bin/pvcm-guest"
install -D -m 644 "$here/guest/pvcm-guestd.service" "$g/lib/systemd/system/pvcm-guestd.service"
install -D -m 644 "$here/guest/pvcm-guestd.default" "$g/etc/default/pvcm-guestd"
install -D -m 644 "$here/guest/pvcm-guest.modprobe.conf" "$g/etc/modprobe.d/pvcm-guest.conf"
install -D -m 644 "$here/guest/pvcm-guest.modules-load.conf" "$g/usr/lib/modules-load.d/pvcm-guest.conf"
install -D -m 644 "$here/guest/pvcm-guest.sysctl.conf" "$g/usr/lib/sysctl.d/60-pvcm-guest.conf"
install -D -m 644 "$here/guest/60-pvcm-guest.rules" "$g/usr/lib/udev/rules.d/60-pvcm-guest.rules"
install -D -m 644 "$repo/docs/apps.md" "$g/usr/share/doc/pvcm-guest/apps.md"
copyright "$g/usr/share/doc/pvcm-guest/copyright"
manpage "$target/pvcm-guestd" 8 "pvcm guest CM service (the rdma_cm device through CUSE)" \
    "$g/usr/share/man/man8/pvcm-guestd.8.gz"
manpage "$target/pvcm-guest" 1 "pvcm guest CM command line" "$g/usr/share/man/man1/pvcm-guest.1.gz"
mkdir -p "$g/DEBIAN"
cat >"$g/DEBIAN/control" <<EOF
Package: pvcm-guest
Version: $version
Architecture: $arch
Maintainer: pvcm developers <pvcm@example.invalid>
Section: net
Priority: optional
Depends: libc6 (>= 2.36), kmod
Recommends: rdma-core, ibverbs-providers, librdmacm1, rdmacm-utils
Description: pvcm guest CM service: unmodified rdma_cm programs in a pvcm VM
 pvcm-guestd serves the Linux rdma_cm character device (/dev/infiniband/rdma_cm)
 through CUSE, so the distribution's librdmacm and the programs on it (rping,
 ucmatose, cmtime, perftest -R, ...) run unchanged in a VM with a pvcm device; their
 connection management is carried by the pvcm device to the host's pvcm-backend,
 their data by the VM's own RDMA device.
EOF
printf '%s\n' /etc/default/pvcm-guestd /etc/modprobe.d/pvcm-guest.conf >"$g/DEBIAN/conffiles"
cat >"$g/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
        systemctl enable pvcm-guestd.service || true
    fi
    udevadm control --reload-rules 2>/dev/null || true
    sysctl -q -p /usr/lib/sysctl.d/60-pvcm-guest.conf 2>/dev/null || true
fi
exit 0
EOF
cat >"$g/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
    systemctl --no-reload disable --now pvcm-guestd.service || true
fi
exit 0
EOF
chmod 755 "$g/DEBIAN/postinst" "$g/DEBIAN/prerm"
deb "$g"

# ---- pvcm-backend ----
h="$stage/pvcm-backend"
install -D -m 755 "$target/pvcm-backend" "$h/usr/sbin/pvcm-backend"
strip --strip-debug "$h/usr/sbin/pvcm-backend"
install -D -m 755 "$repo/qemu-scripts/qp1-divert.sh" "$h/usr/sbin/pvcm-qp1-divert"
install -D -m 755 "$here/host/pvcm-libvirt-hook" "$h/etc/libvirt/hooks/qemu.d/pvcm"
install -D -m 755 "$here/host/qemu-ifup" "$h/usr/lib/pvcm/qemu-ifup"
install -D -m 755 "$here/host/qemu-ifdown" "$h/usr/lib/pvcm/qemu-ifdown"
install -D -m 644 "$here/host/pvcm-backend.service" "$h/lib/systemd/system/pvcm-backend.service"
install -D -m 644 "$here/host/backend.toml" "$h/etc/pvcm/backend.toml"
install -D -m 644 "$here/host/backend.example.toml" \
    "$h/usr/share/doc/pvcm-backend/examples/backend.toml"
for d in daemon.md deploy.md operations.md troubleshooting.md umad.md packet-port.md \
    security.md restart.md migration.md; do
    [ -f "$repo/docs/$d" ] && install -D -m 644 "$repo/docs/$d" "$h/usr/share/doc/pvcm-backend/$d"
done
copyright "$h/usr/share/doc/pvcm-backend/copyright"
manpage "$target/pvcm-backend" 8 "pvcm host daemon (para-virtual IB CM devices over vhost-user)" \
    "$h/usr/share/man/man8/pvcm-backend.8.gz"
mkdir -p "$h/DEBIAN"
cat >"$h/DEBIAN/control" <<EOF
Package: pvcm-backend
Version: $version
Architecture: $arch
Maintainer: pvcm developers <pvcm@example.invalid>
Section: net
Priority: optional
Depends: libc6 (>= 2.36)
Recommends: iproute2, nftables, python3
Description: pvcm host daemon: para-virtual InfiniBand CM endpoints for VMs
 pvcm-backend serves one vhost-user socket per VM and multiplexes the VMs' CM MADs
 onto the host's RoCEv2 port (its own soft port, a device's QP1 through umad, or QP1
 frames diverted from the VMs' own NICs), rewriting their comm IDs and keeping each
 ID exactly as long as the protocol needs it. pvcm-qp1-divert and the libvirt hook
 divert the QP1 frames of VMs with their own RDMA NIC both ways (iproute2's tc and
 nftables, recommended).
EOF
printf '%s\n' /etc/pvcm/backend.toml /etc/libvirt/hooks/qemu.d/pvcm >"$h/DEBIAN/conffiles"
cat >"$h/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
exit 0
EOF
chmod 755 "$h/DEBIAN/postinst"
deb "$h"
