#!/usr/bin/env bash
# Build the patched QEMU 10.0.2 for pvcm's generic vhost-user-device route.
set -euo pipefail

# Bump when the build recipe changes in a way the patch and flags do not show
# (lib.sh's pvcm_qemu_key reads this line).
# shellcheck disable=SC2034
RECIPE_VERSION=1

# Configure flags: x86_64 system emulation, TCG (+ KVM, free to build, used only with
# run-vm.sh --kvm), vhost-user and 9p host directory sharing (virtfs; its xattr calls
# come from glibc with --enable-attr); everything else off.
CONFIGURE_FLAGS=(
    --target-list=x86_64-softmmu
    --without-default-features
    --disable-fdt
    --enable-tcg
    --enable-kvm
    --enable-vhost-user
    --enable-virtfs
    --enable-attr
    --enable-pixman
    --disable-docs
    --disable-tools
    --disable-guest-agent
    --disable-install-blobs
    --disable-download
    --disable-werror
    --disable-debug-info
    --firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu
)
# Wheels QEMU's configure installs into its build venv (pythondeps.toml of 10.0.2).
WHEELS=(meson==1.5.0 pycotap==1.3.1)

usage() {
    cat <<'EOF'
Usage: qemu-scripts/build-qemu.sh [--print-path] [--force] [--jobs N] [--keep-build]

Builds QEMU 10.0.2 from Debian's source package (PVCM_DEB_SUITE, default
bookworm-backports) with pvcm's patch (qemu-scripts/patches/): the generic
vhost-user-device and vhost-user-device-pci become user-creatable, and virtio IDs
QEMU has no name for (pvcm uses 63) do not abort QEMU. Target x86_64-softmmu only,
TCG (+KVM), vhost-user and virtfs (-virtfs / -fsdev: 9p host directory sharing), no
FDT, no tools, no docs. Firmware (SeaBIOS, option ROMs)
comes from Debian's seabios and qemu-system-data packages, installed if missing.

Installs into $PVCM_CACHE/qemu/<key>/ (PVCM_CACHE defaults to ~/.cache/pvcm), where
<key> hashes the Debian version, the patch, the configure flags and this recipe; a
re-run with the same key is instant. $PVCM_CACHE/qemu/current links to the last build.
Needs root the first time (apt-get) and network access to Debian and PyPI.

Options:
  --print-path   print only the path of qemu-system-x86_64 on stdout (build if needed)
  --force        rebuild even if the stamp says the build is current
  --jobs N       parallel compile jobs (default: nproc)
  --keep-build   keep the source/build tree (default: removed after install)
  -h, --help     this help
EOF
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

print_path=0 force=0 keep=0 jobs="$(nproc)"
parse_options --print-path:print_path=1 --force:force=1 --keep-build:keep=1 --jobs=jobs -- "$@"

key="$(pvcm_qemu_key)"
prefix="$PVCM_CACHE/qemu/$key"
stamp="$prefix/.pvcm-built"
qemu_bin="$prefix/bin/qemu-system-x86_64"

runtime_firmware() {
    # SeaBIOS (bios-256k.bin) and QEMU's option ROMs (linuxboot_dma.bin, kvmvapic.bin),
    # which Debian's +ds source package does not carry, in the versions made for 10.0.
    if [ ! -f /usr/share/seabios/bios-256k.bin ] || [ ! -f /usr/share/qemu/linuxboot_dma.bin ]; then
        ensure_deb_suite
        apt_install "seabios/$PVCM_DEB_SUITE" "qemu-system-data/$PVCM_DEB_SUITE"
    fi
}

if [ "$force" = 0 ] && [ -f "$stamp" ] && [ -x "$qemu_bin" ]; then
    runtime_firmware
    ln -sfn "$key" "$PVCM_CACHE/qemu/current"
    if [ "$print_path" = 1 ]; then
        echo "$qemu_bin"
    else
        log "up to date: $qemu_bin ($(sed -n 's/^build_seconds=//p' "$stamp") s to build, key $key)"
    fi
    exit 0
fi

# Everything below logs to stderr, so --print-path's stdout stays one line.
exec 3>&1 1>&2
t0="$(now_s)"
log "building patched QEMU $PVCM_QEMU_VERSION (key $key) into $prefix"

ensure_deb_suite
apt_install ninja-build pkgconf libglib2.0-dev libpixman-1-dev zlib1g-dev flex bison \
    python3-venv bzip2 xz-utils patch dpkg-dev ca-certificates
runtime_firmware

dl="$PVCM_CACHE/downloads"
mkdir -p "$dl/wheels"

# 1. Debian's source package. The mirror may serve only the upstream tarball (the .dsc
#    can 404); apt checks what it does fetch against the signed Sources index, and we
#    check the tarball again below.
orig="$dl/qemu_${PVCM_QEMU_VERSION}+ds.orig.tar.xz"
expected_sha="$(apt-cache showsrc qemu 2>/dev/null | awk -v v="$PVCM_QEMU_DEB_VERSION" '
    /^Version:/ { ver = $2 }
    /^Checksums-Sha256:/ { on = 1; next }
    /^[^ ]/ { on = 0 }
    on && ver == v && $3 ~ /orig\.tar\.xz$/ && !found { print $1; found = 1 }')"
[ -n "$expected_sha" ] || die "apt does not know qemu $PVCM_QEMU_DEB_VERSION in $PVCM_DEB_SUITE (apt-get update? sources?)"
if [ ! -f "$orig" ] || [ "$(sha256sum "$orig" | cut -d' ' -f1)" != "$expected_sha" ]; then
    log "apt-get source --download-only qemu/$PVCM_DEB_SUITE"
    (cd "$dl" && apt-get source -qq --download-only "qemu=$PVCM_QEMU_DEB_VERSION" >&2) ||
        log "apt-get source reported errors (the mirror may lack the .dsc); checking the tarball"
    [ -f "$orig" ] || die "could not download $(basename "$orig") with apt-get source"
    [ "$(sha256sum "$orig" | cut -d' ' -f1)" = "$expected_sha" ] ||
        die "$(basename "$orig") does not match the sha256 in Debian's Sources index"
fi

# 2. meson and pycotap wheels for configure's offline venv (the +ds tarball drops
#    python/wheels).
for w in "${WHEELS[@]}"; do
    name="${w%%==*}" ver="${w##*==}"
    if ! ls "$dl/wheels/${name}-${ver}-"*.whl >/dev/null 2>&1; then
        log "pip download $w"
        pip_py=python3
        python3 -m pip --version >/dev/null 2>&1 || pip_py=/usr/bin/python3
        "$pip_py" -m pip download -q --no-deps --only-binary=:all: -d "$dl/wheels" "$w" >&2 ||
            die "pip download $w failed (is PyPI reachable?)"
    fi
done

# 3. Unpack, patch, configure, build, install.
work="$PVCM_CACHE/qemu/build-$key"
rm -rf "$work"
mkdir -p "$work"
log "unpacking $(basename "$orig")"
tar -C "$work" -xJf "$orig"
src="$work/qemu-$PVCM_QEMU_VERSION"
[ -d "$src" ] || die "unexpected tarball layout: no qemu-$PVCM_QEMU_VERSION/ in $orig"
for p in "$PVCM_SCRIPTS_DIR"/patches/qemu-"$PVCM_QEMU_VERSION"-*.patch; do
    log "applying $(basename "$p")"
    patch -d "$src" -p1 --forward --quiet <"$p" || die "patch $(basename "$p") does not apply"
done
mkdir -p "$src/python/wheels"
cp "$dl"/wheels/*.whl "$src/python/wheels/"

mkdir -p "$src/build"
log "configure ${CONFIGURE_FLAGS[*]}"
(cd "$src/build" && ../configure --prefix="$prefix" --python=/usr/bin/python3 \
    "${CONFIGURE_FLAGS[@]}" >"$work/configure.log" 2>&1) || {
    tail -n 60 "$work/configure.log"
    die "configure failed; full log: $work/configure.log"
}
t_build="$(now_s)"
# Only what the install needs: the emulator and trace-events-all (not the ~950 test
# and tool objects "ninja all" would build; this saves about a third of the time).
log "ninja -j$jobs qemu-system-x86_64 (log: $work/build.log)"
(cd "$src/build" && ninja -j"$jobs" qemu-system-x86_64 trace/trace-events-all >"$work/build.log" 2>&1) || {
    tail -n 60 "$work/build.log"
    die "build failed; full log: $work/build.log"
}
compile_s="$(elapsed "$t_build")"
rm -rf "$prefix"
(cd "$src/build" && ./pyvenv/bin/meson install --no-rebuild >"$work/install.log" 2>&1) || {
    tail -n 40 "$work/install.log"
    die "install failed; full log: $work/install.log"
}
[ -x "$qemu_bin" ] || die "install did not produce $qemu_bin"

# Smoke check: the patched device types must be there and creatable.
"$qemu_bin" -device help 2>&1 | grep '"vhost-user-device-pci"' >/dev/null ||
    die "$qemu_bin does not list vhost-user-device-pci (patch not effective?)"
"$qemu_bin" -device vhost-user-device-pci,help >/dev/null 2>&1 ||
    die "$qemu_bin: vhost-user-device-pci,help failed"
"$qemu_bin" -device help 2>&1 | grep '"virtio-9p-pci"' >/dev/null ||
    die "$qemu_bin does not list virtio-9p-pci (configure without virtfs?)"

total_s="$(elapsed "$t0")"
cp "$PVCM_SCRIPTS_DIR"/patches/qemu-"$PVCM_QEMU_VERSION"-*.patch "$prefix/"
cat >"$stamp" <<EOF
key=$key
debian_version=$PVCM_QEMU_DEB_VERSION
built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)
build_seconds=$total_s
compile_seconds=$compile_s
jobs=$jobs
configure_flags=${CONFIGURE_FLAGS[*]}
EOF
ln -sfn "$key" "$PVCM_CACHE/qemu/current"
[ "$keep" = 1 ] || rm -rf "$work"
log "built $qemu_bin in ${total_s} s (compile ${compile_s} s, -j$jobs)"
if [ "$print_path" = 1 ]; then
    echo "$qemu_bin" >&3
fi
