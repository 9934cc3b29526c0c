#!/usr/bin/env bash
# Builds the Debian packages: pvcm-guest (for the VM) and pvcm-backend (for the host).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: packaging/build-debs.sh [--out DIR] [--no-build] [--version VERSION]

Builds the Debian packages from a release build of the workspace, with dpkg-deb and
dpkg's helpers (dpkg-shlibdeps for the library dependencies, md5sums, a changelog,
debug symbols split off with objcopy):

  pvcm-guest_VERSION_ARCH.deb    the VM's side: pvcm-guestd (the rdma_cm device through
      CUSE) and pvcm-guest (the CLI); the pvcm-guestd systemd unit and its defaults file;
      the modprobe.d rule keeping the kernel's rdma_ucm, rdma_cm and ib_cm out, a
      drop-in for rdma-core's rdma-load-modules@.service that leaves them out; the
      modules-load.d entry for cuse and uio_pci_generic; the udev rule giving the
      rdma_cm node mode 0666; man pages; docs/apps.md.
  pvcm-backend_VERSION_ARCH.deb  the host's side: pvcm-backend, its systemd unit
      (Type=notify) reading /etc/pvcm/backend.toml, a full example config, man pages
      (pvcm-backend(8), pvcm-backend.toml(5), pvcm-qp1-divert(8)), the docs.
  pvcm-guest-dbgsym, pvcm-backend-dbgsym: their binaries' debug symbols
      (/usr/lib/debug/.build-id/).

Options:
  --out DIR          where the packages go (default: target/debian)
  --no-build         use the binaries already in target/release
  --version VERSION  the packages' version (default: the workspace's, Cargo.toml)
  -h, --help         this help

Installs help2man and binutils with apt when missing.
EOF
}

# shellcheck source-path=SCRIPTDIR source=../qemu-scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../qemu-scripts/lib.sh"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"

out="$repo/target/debian" build=1 version=""
parse_options --out=out --version=version --no-build:build=0 -- "$@"

command -v help2man >/dev/null || apt_install help2man
command -v objcopy >/dev/null || apt_install binutils
for t in dpkg-deb dpkg-shlibdeps; do
    command -v "$t" >/dev/null || apt_install dpkg-dev
done

[ -n "$version" ] || version="$(awk -F'"' '/^version = / { print $2; exit }' "$repo/Cargo.toml")"
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
# The changelog's date, and the files' times: the last commit's, for builds that repeat.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}"
maint="pvcm developers <pvcm@example.com>"

# roff TEXT: the text as roff lines (backslashes, leading dots and quotes escaped).
roff() { sed -e 's/\\/\\e/g' -e "s/^[.']/\\\\\\&&/" -e 's/^$/.PP/' -e 's/^/.br\n/'; }

# subcommands PROG: the subcommand names in PROG --help's Commands list (help left out).
subcommands() {
    "$@" --help | awk '/^Commands:/ { on = 1; next } on && /^$/ { exit }
        on && /^  [a-z]/ { if ($1 != "help") print $1 }'
}

# subhelp PROG [SUB...]: a man-page section with every subcommand's --help, nested.
subhelp() {
    local sub
    for sub in $(subcommands "$@"); do
        printf '.SS "%s"\n' "${*##*/} $sub"
        "$@" "$sub" --help | roff
        subhelp "$@" "$sub"
    done
}

# manpage PROG SECTION 'NAME LINE' DEST [EXTRA]: a man page from PROG --help, with a
# SUBCOMMANDS section (each one's --help) and the roff sections in EXTRA (FILES, SEE
# ALSO) appended.
manpage() {
    local inc
    inc="$stage/$(basename "$1").h2m"
    {
        if [ -n "$(subcommands "$1")" ]; then
            echo "[SUBCOMMANDS]"
            subhelp "$1"
        fi
        [ -z "${5:-}" ] || cat "$5"
    } >"$inc"
    mkdir -p "$(dirname "$4")"
    help2man --no-info --no-discard-stderr --section "$2" --name "$3" --include "$inc" \
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
Copyright: 2026 the pvcm developers
License: Apache-2.0 or BSD-3-Clause

License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0 (also LICENSE-APACHE in the source).

License: BSD-3-Clause
EOF
        sed -e 's/^$/./' -e 's/^/ /' "$repo/LICENSE-BSD-3-Clause"
    } >"$1"
}

# changelog PKG: /usr/share/doc/PKG/changelog.gz, Debian's format (a native package's).
changelog() {
    mkdir -p "$1/usr/share/doc/$2"
    {
        printf 'pvcm (%s) unstable; urgency=medium\n\n' "$version"
        printf '  * Built from the pvcm source tree (its git history lists the changes).\n\n'
        printf ' -- %s  %s\n' "$maint" "$(date -R -u -d "@$SOURCE_DATE_EPOCH")"
    } | gzip -9n >"$1/usr/share/doc/$2/changelog.gz"
}

# docs PKGROOT PKG FILE...: docs/FILE into /usr/share/doc/PKG, with every docs/*.md they
# link to (and those link to, ...); links to files outside docs/ become plain text.
docs() {
    local root="$1" pkg="$2" f l new
    shift 2
    local -A want=()
    for f in "$@"; do want[$f]=1; done
    new=1
    while [ "$new" = 1 ]; do
        new=0
        for f in "${!want[@]}"; do
            for l in $(grep -o '](\([a-z0-9_-]*\.md\)' "$repo/docs/$f" | sed 's/^](//' | sort -u); do
                if [ -f "$repo/docs/$l" ] && [ -z "${want[$l]:-}" ]; then
                    want[$l]=1
                    new=1
                fi
            done
        done
    done
    for f in "${!want[@]}"; do
        install -D -m 644 /dev/null "$root/usr/share/doc/$pkg/$f"
        # [text](../x/y) -> text (x/y in the pvcm source)
        perl -pe 's{\[([^\]]*)\]\(\.\./([^)#]*)(#[^)]*)?\)}{$1 ($2 in the pvcm source)}g' \
            "$repo/docs/$f" >"$root/usr/share/doc/$pkg/$f"
    done
}

# split_debug PKGROOT PKG BINARY...: strips the binaries (as dh_strip does) and puts
# their debug symbols into PKG-dbgsym's root, by build ID.
split_debug() {
    local root="$1" pkg="$2" b id dbg="$stage/$2-dbgsym"
    shift 2
    for b in "$@"; do
        id="$(readelf -n "$root/$b" | awk '/Build ID:/ { print $3; exit }')"
        [ -n "$id" ] || die "$b has no build ID"
        mkdir -p "$dbg/usr/lib/debug/.build-id/${id:0:2}"
        local d="$dbg/usr/lib/debug/.build-id/${id:0:2}/${id:2}.debug"
        objcopy --only-keep-debug --compress-debug-sections "$root/$b" "$d"
        chmod 644 "$d"
        strip --remove-section=.comment --remove-section=.note --strip-unneeded "$root/$b"
        objcopy --add-gnu-debuglink="$d" "$root/$b"
    done
    mkdir -p "$dbg/usr/share/doc"
    ln -s "$pkg" "$dbg/usr/share/doc/$pkg-dbgsym"
    mkdir -p "$dbg/DEBIAN"
    cat >"$dbg/DEBIAN/control" <<EOF
Package: $pkg-dbgsym
Source: pvcm
Version: $version
Architecture: $arch
Maintainer: $maint
Section: debug
Priority: optional
Depends: $pkg (= $version)
Description: debug symbols for $pkg
 The separate debug symbols of the $pkg binaries, for gdb and
 core dumps.
EOF
}

# shlibs PKGROOT BINARY...: the Depends dpkg-shlibdeps computes for the binaries.
shlibs() {
    local root="$1" d="$stage/shlibs" b args=()
    shift
    mkdir -p "$d/debian"
    printf 'Source: pvcm\n\nPackage: pvcm\nArchitecture: any\n' >"$d/debian/control"
    for b in "$@"; do args+=("-e$root/$b"); done
    (cd "$d" && dpkg-shlibdeps -O "${args[@]}") | sed -n 's/^shlibs:Depends=//p'
}

# deb PKGROOT: builds the package rooted at PKGROOT into $out, with its md5sums.
deb() {
    local root="$1" name size
    name="$(awk '/^Package:/ { print $2 }' "$root/DEBIAN/control")"
    size="$(du -sk --exclude=DEBIAN "$root" | cut -f1)"
    echo "Installed-Size: $size" >>"$root/DEBIAN/control"
    find "$root" -type d -exec chmod 755 {} +
    (cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | LC_ALL=C sort -z |
        xargs -0r md5sum) >"$root/DEBIAN/md5sums"
    chmod 644 "$root/DEBIAN/md5sums" "$root/DEBIAN/control"
    [ ! -f "$root/DEBIAN/conffiles" ] || chmod 644 "$root/DEBIAN/conffiles"
    find "$root" -newermt "@$SOURCE_DATE_EPOCH" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
    dpkg-deb --root-owner-group -Zxz --build "$root" "$out/${name}_${version}_${arch}.deb" >/dev/null
    log "built $out/${name}_${version}_${arch}.deb"
}

# systemd_scripts PKGROOT UNIT ENABLE: postinst, prerm and postrm in debhelper's manner
# (dh_installsystemd): stop on remove, restart on upgrade (if running), mask state
# cleaned on purge; ENABLE=1 enables the unit on first install. EXTRA_POSTINST and
# EXTRA_POSTRM_PURGE are added to postinst (configure) and postrm (purge).
systemd_scripts() {
    local root="$1" unit="$2" enable="$3"
    cat >"$root/DEBIAN/postinst" <<EOF
#!/bin/sh
set -e
if [ "\$1" = configure ] || [ "\$1" = abort-upgrade ] || [ "\$1" = abort-deconfigure ] || [ "\$1" = abort-remove ]; then
${EXTRA_POSTINST:-    :}
$(if [ "$enable" = 1 ]; then
        # Enabled on the first install (was-enabled is true without a state), kept as
        # the admin left it afterwards.
        cat <<EOS
    if command -v deb-systemd-helper >/dev/null; then
        deb-systemd-helper unmask '$unit' >/dev/null || true
        if deb-systemd-helper --quiet was-enabled '$unit'; then
            deb-systemd-helper enable '$unit' >/dev/null || true
        else
            deb-systemd-helper update-state '$unit' >/dev/null || true
        fi
    fi
EOS
    else
        # Not enabled on install; kept as the admin left it afterwards.
        cat <<EOS
    if command -v deb-systemd-helper >/dev/null; then
        if deb-systemd-helper debian-installed '$unit'; then
            deb-systemd-helper unmask '$unit' >/dev/null || true
            if deb-systemd-helper --quiet was-enabled '$unit'; then
                deb-systemd-helper enable '$unit' >/dev/null || true
            fi
        fi
        deb-systemd-helper update-state '$unit' >/dev/null || true
    fi
EOS
    fi)
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        if [ -n "\$2" ]; then
            # An upgrade: the new binary takes over if the service was running.
            deb-systemd-invoke try-restart '$unit' >/dev/null || true
$(if [ "$enable" = 1 ]; then
        printf '        else\n'
        printf "            deb-systemd-invoke start '%s' >/dev/null || true\n" "$unit"
    fi)
        fi
    fi
fi
exit 0
EOF
    cat >"$root/DEBIAN/prerm" <<EOF
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "\$1" = remove ]; then
    deb-systemd-invoke stop '$unit' >/dev/null || true
fi
exit 0
EOF
    cat >"$root/DEBIAN/postrm" <<EOF
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
if [ "\$1" = remove ] && command -v deb-systemd-helper >/dev/null; then
    deb-systemd-helper mask '$unit' >/dev/null || true
fi
if [ "\$1" = purge ]; then
    if command -v deb-systemd-helper >/dev/null; then
        deb-systemd-helper purge '$unit' >/dev/null || true
        deb-systemd-helper unmask '$unit' >/dev/null || true
    fi
${EXTRA_POSTRM_PURGE:-    :}
fi
exit 0
EOF
    chmod 755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm" "$root/DEBIAN/postrm"
}

# ---- pvcm-guest ----
g="$stage/pvcm-guest"
install -D -m 755 "$target/pvcm-guestd" "$g/usr/sbin/pvcm-guestd"
install -D -m 755 "$target/pvcm-guest" "$g/usr/bin/pvcm-guest"
split_debug "$g" pvcm-guest usr/sbin/pvcm-guestd usr/bin/pvcm-guest
install -D -m 644 "$here/guest/pvcm-guestd.service" "$g/lib/systemd/system/pvcm-guestd.service"
install -D -m 644 "$here/guest/pvcm-guestd.default" "$g/etc/default/pvcm-guestd"
install -D -m 644 "$here/guest/pvcm-guest.modprobe.conf" "$g/lib/modprobe.d/pvcm-guest.conf"
install -D -m 755 "$here/guest/rdma-load-modules" "$g/usr/lib/pvcm-guest/rdma-load-modules"
install -D -m 644 "$here/guest/rdma-load-modules.conf" \
    "$g/lib/systemd/system/rdma-load-modules@.service.d/pvcm-guest.conf"
install -D -m 644 "$here/guest/pvcm-guest.modules-load.conf" "$g/usr/lib/modules-load.d/pvcm-guest.conf"
install -D -m 644 "$here/guest/60-pvcm-guest.rules" "$g/lib/udev/rules.d/60-pvcm-guest.rules"
install -D -m 644 "$here/guest/pvcm-guest.lintian-overrides" "$g/usr/share/lintian/overrides/pvcm-guest"
docs "$g" pvcm-guest apps.md
copyright "$g/usr/share/doc/pvcm-guest/copyright"
changelog "$g" pvcm-guest
manpage "$target/pvcm-guestd" 8 "pvcm guest CM service (the rdma_cm device through CUSE)" \
    "$g/usr/share/man/man8/pvcm-guestd.8.gz" "$here/guest/pvcm-guestd.h2m"
manpage "$target/pvcm-guest" 1 "pvcm guest CM command line" \
    "$g/usr/share/man/man1/pvcm-guest.1.gz" "$here/guest/pvcm-guest.h2m"
mkdir -p "$g/DEBIAN"
cat >"$g/DEBIAN/control" <<EOF
Package: pvcm-guest
Source: pvcm
Version: $version
Architecture: $arch
Maintainer: $maint
Section: net
Priority: optional
Depends: $(shlibs "$g" usr/sbin/pvcm-guestd usr/bin/pvcm-guest), kmod
Recommends: rdma-core, ibverbs-providers, librdmacm1, rdmacm-utils
Description: pvcm guest CM service: unmodified rdma_cm programs in a pvcm VM
 pvcm-guestd serves the Linux rdma_cm character device
 (/dev/infiniband/rdma_cm) through CUSE, so the distribution's librdmacm and
 the programs on it (rping, ucmatose, cmtime, perftest -R, ...) run unchanged
 in a VM with a pvcm device; their connection management is carried by the
 pvcm device to the host's pvcm-backend, their data by the VM's own RDMA
 device.
EOF
printf '%s\n' /etc/default/pvcm-guestd >"$g/DEBIAN/conffiles"
EXTRA_POSTINST='    udevadm control --reload-rules 2>/dev/null || true' \
    systemd_scripts "$g" pvcm-guestd.service 1
deb "$g"
deb "$stage/pvcm-guest-dbgsym"

# ---- pvcm-backend ----
h="$stage/pvcm-backend"
install -D -m 755 "$target/pvcm-backend" "$h/usr/sbin/pvcm-backend"
split_debug "$h" pvcm-backend usr/sbin/pvcm-backend
install -D -m 755 "$repo/qemu-scripts/qp1-divert.sh" "$h/usr/sbin/pvcm-qp1-divert"
sed -i '1s|^#!/usr/bin/env bash$|#!/bin/bash|' "$h/usr/sbin/pvcm-qp1-divert"
install -D -m 755 "$here/host/pvcm-libvirt-hook" "$h/etc/libvirt/hooks/qemu.d/pvcm"
install -D -m 755 "$here/host/qemu-ifup" "$h/usr/lib/pvcm/qemu-ifup"
install -D -m 755 "$here/host/qemu-ifdown" "$h/usr/lib/pvcm/qemu-ifdown"
install -D -m 644 "$here/host/pvcm-backend.service" "$h/lib/systemd/system/pvcm-backend.service"
install -D -m 644 "$here/host/backend.toml" "$h/etc/pvcm/backend.toml"
install -D -m 644 "$here/host/backend.example.toml" \
    "$h/usr/share/doc/pvcm-backend/examples/backend.toml"
docs "$h" pvcm-backend daemon.md deploy.md operations.md troubleshooting.md umad.md \
    packet-port.md security.md restart.md migration.md
copyright "$h/usr/share/doc/pvcm-backend/copyright"
changelog "$h" pvcm-backend
manpage "$target/pvcm-backend" 8 "pvcm host daemon (para-virtual IB CM devices over vhost-user)" \
    "$h/usr/share/man/man8/pvcm-backend.8.gz" "$here/host/pvcm-backend.h2m"
install -D -m 644 "$here/host/pvcm-backend.toml.5" "$h/usr/share/man/man5/pvcm-backend.toml.5"
sed -i "s/@VERSION@/$version/" "$h/usr/share/man/man5/pvcm-backend.toml.5"
gzip -9n "$h/usr/share/man/man5/pvcm-backend.toml.5"
manpage "$h/usr/sbin/pvcm-qp1-divert" 8 "divert a VM's RoCE QP1 frames to a host device" \
    "$h/usr/share/man/man8/pvcm-qp1-divert.8.gz" "$here/host/pvcm-qp1-divert.h2m"
mkdir -p "$h/DEBIAN"
# Recommends: the umad port talks to the kernel's ib_umad directly (no libibumad, no
# verbs); rdma-core loads ib_umad for RDMA devices and gives /dev/infiniband/umad* its
# udev rules. iproute2 and nftables: pvcm-qp1-divert and the libvirt hook; python3:
# the libvirt hook (a hook that cannot run stops the VM's start).
cat >"$h/DEBIAN/control" <<EOF
Package: pvcm-backend
Source: pvcm
Version: $version
Architecture: $arch
Maintainer: $maint
Section: net
Priority: optional
Depends: $(shlibs "$h" usr/sbin/pvcm-backend)
Recommends: rdma-core, iproute2, nftables, python3
Suggests: qemu-system-x86, libvirt-daemon-system
Description: pvcm host daemon: para-virtual InfiniBand CM endpoints for VMs
 pvcm-backend serves one vhost-user socket per VM and multiplexes the VMs' CM
 MADs onto the host's RoCEv2 port (its own soft port, a device's QP1 through
 umad, or QP1 frames diverted from the VMs' own NICs), rewriting their comm IDs
 and keeping each ID exactly as long as the protocol needs it.
 pvcm-qp1-divert and the libvirt hook divert the QP1 frames of VMs with their
 own RDMA NIC both ways (iproute2's tc and nftables, recommended).
EOF
printf '%s\n' /etc/pvcm/backend.toml /etc/libvirt/hooks/qemu.d/pvcm >"$h/DEBIAN/conffiles"
# Purge: the daemon's state (/var/lib/pvcm: its journal) and what is left of /etc/pvcm.
EXTRA_POSTRM_PURGE='    rm -rf /var/lib/pvcm
    rmdir /etc/pvcm 2>/dev/null || true' \
    systemd_scripts "$h" pvcm-backend.service 0
deb "$h"
deb "$stage/pvcm-backend-dbgsym"
