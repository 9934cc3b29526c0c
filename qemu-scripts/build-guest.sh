#!/usr/bin/env bash
# Build the pvcm test guest: Debian's kernel + a busybox initramfs (+ pvcm-guest).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: qemu-scripts/build-guest.sh [options]

Builds a guest image for run-vm.sh: Debian's kernel (linux-image-amd64, unpacked with
dpkg -x) and an initramfs (cpio newc, gzip) with a static busybox (busybox-static),
an /init that mounts proc/sys/dev/hugetlbfs, reserves hugepages, runs the command
from the kernel command line (pvcm.cmd=<base64>) between the console markers
PVCM-BEGIN / PVCM-END rc=N, and powers off; plus a statically linked pvcm-guest
(every binary of the pvcm-guest package, built with +crt-static) when that package
has a binary. Without one the image is built anyway and a warning is printed.

Output goes to $PVCM_CACHE/guest/<key>/ (vmlinuz, initramfs.img, info);
$PVCM_CACHE/guest/current links to it. <key> hashes the kernel and busybox
versions, this script, the guest binaries and the extra files, so a re-run with
nothing changed reuses the image (cargo still checks pvcm-guest is up to date).

Options:
  --print-dir          print only the image directory on stdout
  --no-guest-bin       do not build or include pvcm-guest
  --guest-bin PATH     include PATH as /usr/bin/<name> instead of building
                       (repeatable; must be statically linked)
  --extra SRC[:DEST]   copy SRC into the initramfs at DEST (default /root/<name>);
                       repeatable; a directory is copied recursively
  --extra-list FILE    lines of SRC[:DEST], as --extra (# comments, blank lines ok)
  --module NAME        include kernel module NAME (+ its dependencies) and load it
                       at boot (repeatable; uio_pci_generic always is: pvcm-guest
                       waits on the device's INTx through it instead of polling)
  --force              rebuild even if cached
  -h, --help           this help

Environment: PVCM_CACHE (default ~/.cache/pvcm), PVCM_KERNEL_PKG (default
linux-image-amd64), CARGO (default cargo).
EOF
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

print_dir=0 guest_bin_mode=build force=0
guest_bins=() extras=()
# uio_pci_generic: pvcm-guest binds the pvcm device to it and sleeps on /dev/uioN until
# the device interrupts (INTx), instead of a timed poll (docs/scale.md, "Idle cost").
modules=(uio_pci_generic)
while [ $# -gt 0 ]; do
    case "$1" in
    --print-dir) print_dir=1 ;;
    --no-guest-bin) guest_bin_mode=none ;;
    --guest-bin)
        [ $# -ge 2 ] || die "--guest-bin needs a path"
        guest_bin_mode=given
        guest_bins+=("$2")
        shift
        ;;
    --extra)
        [ $# -ge 2 ] || die "--extra needs SRC[:DEST]"
        extras+=("$2")
        shift
        ;;
    --extra-list)
        [ $# -ge 2 ] || die "--extra-list needs a file"
        [ -f "$2" ] || die "--extra-list: no such file: $2"
        while IFS= read -r line || [ -n "$line" ]; do
            line="${line%%#*}"
            line="$(echo "$line" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')"
            [ -n "$line" ] && extras+=("$line")
        done <"$2"
        shift
        ;;
    --module)
        [ $# -ge 2 ] || die "--module needs a name"
        modules+=("$2")
        shift
        ;;
    --force) force=1 ;;
    -h | --help)
        usage
        exit 0
        ;;
    *) die "unknown option '$1' (see --help)" ;;
    esac
    shift
done

exec 3>&1 1>&2
t0="$(now_s)"
dl="$PVCM_CACHE/downloads"
mkdir -p "$dl/debs" "$PVCM_CACHE/guest"
apt_install cpio gzip xz-utils binutils python3

# ---- Debian packages: kernel and busybox-static (downloaded once, by version) ----

# deb_fetch PKG: download PKG's candidate .deb into $dl/debs (if not there); print path.
deb_fetch() {
    local pkg="$1" ver file
    ver="$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }')"
    if [ -z "$ver" ] || [ "$ver" = "(none)" ]; then
        apt_update_once
        ver="$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }')"
    fi
    [ -n "$ver" ] && [ "$ver" != "(none)" ] || die "apt knows no package $pkg"
    # .deb file names encode the epoch's colon as %3a.
    file="$dl/debs/${pkg}_${ver//:/%3a}_$(dpkg --print-architecture).deb"
    [ -f "$file" ] || file="$dl/debs/${pkg}_${ver//:/%3a}_all.deb"
    if [ ! -f "$file" ]; then
        log "apt-get download $pkg=$ver"
        (cd "$dl/debs" && apt-get download -qq "$pkg=$ver" >&2) || {
            apt_update_once
            (cd "$dl/debs" && apt-get download -qq "$pkg=$ver" >&2) || die "apt-get download $pkg=$ver failed"
        }
        file="$(ls "$dl/debs/${pkg}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n1)"
        [ -f "$file" ] || die "apt-get download $pkg=$ver produced no .deb"
    fi
    echo "$file"
}

# unpack_deb DEB: dpkg -x DEB into a cache dir named after it (once); print the dir.
unpack_deb() {
    local deb="$1" dir
    dir="$dl/unpacked/$(basename "$deb" .deb)"
    if [ ! -f "$dir/.unpacked" ]; then
        rm -rf "$dir"
        mkdir -p "$dir"
        dpkg -x "$deb" "$dir"
        touch "$dir/.unpacked"
    fi
    echo "$dir"
}

kernel_meta="${PVCM_KERNEL_PKG:-linux-image-amd64}"
kernel_pkg="$kernel_meta"
if [ "$kernel_meta" = linux-image-amd64 ]; then
    kernel_pkg="$(apt-cache depends "$kernel_meta" 2>/dev/null | awk '/Depends: linux-image-/ { print $2; exit }')"
    if [ -z "$kernel_pkg" ]; then
        apt_update_once
        kernel_pkg="$(apt-cache depends "$kernel_meta" 2>/dev/null | awk '/Depends: linux-image-/ { print $2; exit }')"
    fi
    [ -n "$kernel_pkg" ] || die "cannot resolve $kernel_meta to a linux-image-*-amd64 package"
    deb_fetch "$kernel_meta" >/dev/null # the brief's apt-get download of the metapackage
fi
kernel_deb="$(deb_fetch "$kernel_pkg")"
busybox_deb="$(deb_fetch busybox-static)"
kdir="$(unpack_deb "$kernel_deb")"
bbdir="$(unpack_deb "$busybox_deb")"
vmlinuz="$(ls "$kdir"/boot/vmlinuz-* 2>/dev/null | head -n1)"
[ -f "$vmlinuz" ] || die "no boot/vmlinuz-* in $kernel_deb"
kver="${vmlinuz##*/vmlinuz-}"
busybox="$bbdir/bin/busybox"
[ -x "$busybox" ] || die "no bin/busybox in $busybox_deb"

# ---- pvcm-guest, statically linked ----

guest_note=""
if [ "$guest_bin_mode" = build ]; then
    cargo="${CARGO:-cargo}"
    command -v "$cargo" >/dev/null || die "cargo not found (set CARGO or use --no-guest-bin)"
    bin_names="$(cd "$PVCM_REPO_DIR" && "$cargo" metadata --no-deps --format-version 1 2>/dev/null |
        python3 -c '
import json, sys
m = json.load(sys.stdin)
for p in m["packages"]:
    if p["name"] == "pvcm-guest":
        for t in p["targets"]:
            if "bin" in t["kind"]:
                print(t["name"])
')" || die "cargo metadata failed in $PVCM_REPO_DIR"
    if [ -z "$bin_names" ]; then
        guest_note="pvcm-guest has no binary yet: image built without it"
        warn "$guest_note"
    else
        log "cargo build --release -p pvcm-guest (static, x86_64-unknown-linux-gnu)"
        (cd "$PVCM_REPO_DIR" && RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
            "$cargo" build --release -p pvcm-guest --bins --target x86_64-unknown-linux-gnu >&2) ||
            die "cargo build of pvcm-guest failed"
        tdir="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/x86_64-unknown-linux-gnu/release"
        while read -r b; do
            [ -n "$b" ] || continue
            [ -x "$tdir/$b" ] || die "cargo built no $tdir/$b"
            guest_bins+=("$tdir/$b")
        done <<<"$bin_names"
    fi
fi
for b in "${guest_bins[@]}"; do
    [ -f "$b" ] || die "guest binary not found: $b"
    if readelf -l "$b" 2>/dev/null | grep 'Requesting program interpreter' >/dev/null; then
        die "$b is dynamically linked; the initramfs has no libc (build with -C target-feature=+crt-static)"
    fi
done

# ---- modules (optional) ----

mod_files=()
if [ "${#modules[@]}" -gt 0 ]; then
    moddir="$kdir/lib/modules/$kver"
    # Debian's package ships no modules.dep (its postinst runs depmod): make one.
    if [ ! -f "$moddir/modules.dep" ]; then
        apt_install kmod
        depmod -b "$kdir" "$kver" || die "depmod -b $kdir $kver failed"
    fi
    [ -f "$moddir/modules.dep" ] || die "no modules.dep in $moddir"
    declare -A seen=()
    add_mod() { # depth-first: dependencies first
        local name="$1" line path dep
        line="$(grep -E "(^|/)${name//[-_]/[-_]}\.ko(\.xz|\.zst|\.gz)?:" "$moddir/modules.dep" | head -n1)" ||
            true
        [ -n "$line" ] || die "kernel $kver has no module $name (built in? see $moddir/modules.builtin)"
        path="${line%%:*}"
        [ -n "${seen[$path]:-}" ] && return 0
        seen[$path]=1
        for dep in ${line#*:}; do
            dep="$(basename "$dep")"
            add_mod "${dep%%.ko*}"
        done
        mod_files+=("$path")
    }
    for m in "${modules[@]}"; do
        if grep -Eq "/${m//[-_]/[-_]}\.ko" "$moddir/modules.builtin" 2>/dev/null; then
            log "module $m is built into $kver; nothing to load"
            continue
        fi
        add_mod "$m"
    done
fi

# ---- the /init script ----

read -r -d '' INIT_SCRIPT <<'INIT' || true
#!/bin/sh
# pvcm test guest init (generated by qemu-scripts/build-guest.sh)
set -f
export PATH=/usr/bin:/usr/sbin:/bin:/sbin HOME=/root TERM=dumb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/hugepages /tmp /run
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t hugetlbfs hugetlbfs /dev/hugepages
ip link set lo up 2>/dev/null

arg() { # arg NAME: value of NAME=... on the kernel command line
    for w in $(cat /proc/cmdline); do
        case "$w" in "$1="*) echo "${w#*=}"; return 0 ;; esac
    done
    return 1
}

# Hugepages: the kernel's hugepages=N does it at boot; pvcm.hugepages=N tops it up.
hp="$(arg pvcm.hugepages)" && [ -n "$hp" ] && echo "$hp" >/proc/sys/vm/nr_hugepages

for m in $(cat /etc/pvcm-modules 2>/dev/null); do
    insmod "/lib/modules/$m" || echo "pvcm-init: insmod $m failed"
done

# Keep kernel messages out of the command's output (dmesg still has them).
lvl="$(arg pvcm.printk)" || lvl=1
echo "$lvl" >/proc/sys/kernel/printk

# The command: /pvcm/cmd.sh (run-vm.sh's overlay initramfs) or pvcm.cmd=<base64>.
if [ -f /pvcm/cmd.sh ]; then
    cp /pvcm/cmd.sh /tmp/pvcm-cmd.sh
elif c="$(arg pvcm.cmd)"; then
    echo "$c" | base64 -d >/tmp/pvcm-cmd.sh || echo "echo 'pvcm-init: bad base64 in pvcm.cmd'; exit 125" >/tmp/pvcm-cmd.sh
else
    echo "echo 'pvcm-init: no pvcm.cmd on the kernel command line'; exit 0" >/tmp/pvcm-cmd.sh
fi
cd /root
echo "PVCM-BEGIN"
if t="$(arg pvcm.timeout)" && [ -n "$t" ]; then
    timeout "$t" sh /tmp/pvcm-cmd.sh </dev/null 2>&1
else
    sh /tmp/pvcm-cmd.sh </dev/null 2>&1
fi
rc=$?
echo "PVCM-END rc=$rc"
if arg pvcm.shell >/dev/null; then
    echo "pvcm-init: pvcm.shell given: starting a shell (exit it to power off)"
    setsid sh -c 'exec sh </dev/console >/dev/console 2>&1'
fi
sync
poweroff -f
INIT

# ---- cache key ----

hash_paths() { # content hash of files/dirs (paths and bytes)
    local p
    for p in "$@"; do
        if [ -d "$p" ]; then
            (cd "$p" && find . -type f -print0 | sort -z | xargs -0 -r sha256sum)
        else
            sha256sum <"$p"
        fi
    done | sha256sum | cut -c1-64
}
extra_srcs=()
for e in "${extras[@]}"; do
    src="${e%%:*}"
    [ -e "$src" ] || die "extra file not found: $src"
    extra_srcs+=("$src")
done
key="$({
    echo "kernel=$(basename "$kernel_deb") busybox=$(basename "$busybox_deb")"
    sha256sum <"${BASH_SOURCE[0]}"
    echo "modules=${mod_files[*]}"
    for b in "${guest_bins[@]}"; do echo "bin $(basename "$b") $(sha256sum <"$b")"; done
    for e in "${extras[@]}"; do echo "extra $e"; done
    [ "${#extra_srcs[@]}" -gt 0 ] && hash_paths "${extra_srcs[@]}"
    true
} | short_hash)"
out="$PVCM_CACHE/guest/$key"

if [ "$force" = 0 ] && [ -f "$out/.pvcm-built" ]; then
    ln -sfn "$key" "$PVCM_CACHE/guest/current"
    [ -n "$guest_note" ] && warn "$guest_note"
    if [ "$print_dir" = 1 ]; then echo "$out" >&3; else log "up to date: $out ($(elapsed "$t0") s)"; fi
    exit 0
fi

# ---- assemble the initramfs ----

log "assembling initramfs (kernel $kver, $(basename "$busybox_deb" .deb))"
tmp="$(mktemp -d "$PVCM_CACHE/guest/.tmp.XXXXXX")"
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,run,root,etc,pvcm,lib/modules}
cp "$busybox" "$root/bin/busybox"
for applet in $("$busybox" --list-full); do
    [ -e "$root/$applet" ] || ln -s /bin/busybox "$root/$applet"
done
printf '%s\n' "$INIT_SCRIPT" >"$root/init"
chmod 755 "$root/init"
for b in "${guest_bins[@]}"; do
    # Without DWARF (symbols stay, for backtraces): a third of the size, a faster boot.
    objcopy --strip-debug "$b" "$root/usr/bin/$(basename "$b")" 2>/dev/null ||
        cp "$b" "$root/usr/bin/$(basename "$b")"
    chmod 755 "$root/usr/bin/$(basename "$b")"
done
: >"$root/etc/pvcm-modules"
for mf in "${mod_files[@]}"; do
    dst="$root/lib/modules/$(basename "$mf")"
    case "$mf" in
    *.xz) xz -dc "$kdir/lib/modules/$kver/$mf" >"${dst%.xz}"; dst="${dst%.xz}" ;;
    *.zst) zstd -qdc "$kdir/lib/modules/$kver/$mf" >"${dst%.zst}"; dst="${dst%.zst}" ;;
    *.gz) gzip -dc "$kdir/lib/modules/$kver/$mf" >"${dst%.gz}"; dst="${dst%.gz}" ;;
    *) cp "$kdir/lib/modules/$kver/$mf" "$dst" ;;
    esac
    basename "$dst" >>"$root/etc/pvcm-modules"
done
for e in "${extras[@]}"; do
    src="${e%%:*}"
    if [ "$src" = "$e" ]; then dst="/root/$(basename "$src")"; else dst="${e#*:}"; fi
    mkdir -p "$root/$(dirname "$dst")"
    cp -a "$src" "$root/$dst"
done
echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
{
    echo "kernel=$kver ($(basename "$kernel_deb"))"
    echo "busybox=$(basename "$busybox_deb")"
    for b in "${guest_bins[@]}"; do echo "bin=/usr/bin/$(basename "$b")"; done
    [ -n "$guest_note" ] && echo "note=$guest_note"
    echo "key=$key"
} >"$root/etc/pvcm-image-info"

(cd "$root" && find . -print0 | LC_ALL=C sort -z |
    cpio --null -o -H newc --owner=0:0 --reproducible --quiet) | gzip -n -6 >"$tmp/initramfs.img"
cp "$vmlinuz" "$tmp/vmlinuz"
cp "$root/etc/pvcm-image-info" "$tmp/info"
rm -rf "$root"
echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ) build_seconds=$(elapsed "$t0")" >"$tmp/.pvcm-built"
rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$tmp" "$out"
trap - EXIT
ln -sfn "$key" "$PVCM_CACHE/guest/current"
log "guest image $out: kernel $kver, initramfs $(du -h "$out/initramfs.img" | cut -f1), $(elapsed "$t0") s"
[ -n "$guest_note" ] && warn "$guest_note"
if [ "$print_dir" = 1 ]; then echo "$out" >&3; fi
