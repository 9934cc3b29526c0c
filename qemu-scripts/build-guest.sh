#!/usr/bin/env bash
# Build the pvcm test guest: Debian's kernel + a busybox initramfs (+ pvcm-guest), and
# with --rdma the RDMA flavour (modules, rdma-core userland from Debian's .debs).
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: qemu-scripts/build-guest.sh [--rdma [--rdma-suite SUITE]] [options]

Builds a guest image for run-vm.sh and the network lab (qemu-scripts/netlab): Debian's
kernel (linux-image-amd64, unpacked with dpkg -x) and an initramfs (cpio newc, gzip)
with a static busybox (busybox-static), an /init that mounts proc/sys/dev/hugetlbfs,
reserves hugepages, runs the command from the kernel command line (pvcm.cmd=<base64>)
between the console markers PVCM-BEGIN / PVCM-END rc=N, and powers off; plus a
statically linked pvcm-guest (every binary of the pvcm-guest package, built with
+crt-static) when that package has a binary. Without one the image is built anyway
and a warning is printed.

Two flavours (each cached under its own key):
  default  the above, with uio_pci_generic (what e2e.sh and run-vm.sh boot)
  --rdma   also an RDMA guest: kernel modules under /lib/modules/<kver> with their
           dependencies and a modules.dep, so modprobe works (virtio_pci virtio_net
           crc32_generic rdma_rxe ib_uverbs ib_umad ib_cm iw_cm rdma_cm rdma_ucm fuse
           cuse 9p 9pnet_virtio), and the rdma-core userland of a Debian suite
           from .debs (apt-get download + dpkg -x, never the host's files):
           rdmacm-utils, ibverbs-utils, perftest, ip and rdma (iproute2), strace,
           the rxe provider, glibc and the dynamic loader, libgcc_s, and every
           library their NEEDED entries reach (dependencies of the listed packages
           are fetched as the closure finds them). The kernel stays Debian 12's
           whatever the suite.

The RDMA userland's suite (--rdma-suite, or PVCM_RDMA_SUITE): bookworm (Debian 12,
rdma-core 44, the default), trixie (Debian 13, rdma-core 56) or sid (unstable). Its
packages are looked up and downloaded with a private apt configuration and state
under $PVCM_CACHE/apt/<suite>/ (sources at deb.debian.org, lists, no dpkg status),
never the host's; its lists are refreshed when a week old or when a download fails.

Kernel command line of the /init (both flavours; the network, RDMA and share
parameters need --rdma):
  pvcm.cmd=BASE64        the command (sh), base64; run-vm.sh's overlay /pvcm/cmd.sh
                         wins when present
  pvcm.timeout=SECS      bound the command inside the guest
  pvcm.shell             a shell on the console after the command
  pvcm.hugepages=N       top up the hugepages the kernel's hugepages=N reserved
  pvcm.printk=N          console log level while the command runs (default 1)
  pvcm.name=NAME         the guest's hostname (default: pvcm.agent's NAME)
  pvcm.ip=ADDR/NN[,ADDR/NN...]
                         IPv4 and/or IPv6 addresses of eth0 (virtio-net); an IPv6
                         address turns IPv6 on as pvcm.ipv6=1 does
  pvcm.mtu=N             eth0's MTU (rxe's active MTU follows: 1500 gives 1024)
  pvcm.ipv6=1            keep IPv6 on eth0 (default: off, for quiet captures)
  pvcm.rxe=1             rdma_rxe on eth0: rdma link add rxe0 type rxe netdev eth0,
                         then wait until port 1 is ACTIVE and a RoCE v2 GID exists
                         for every pvcm.ip address (the GID table is printed if not);
                         ib_uverbs and ib_umad are loaded too
  pvcm.cm=kernel         load the kernel CM: ib_cm, rdma_cm, rdma_ucm
  pvcm.cm=pvcm           keep the kernel CM out: /etc/modprobe.d/pvcm.conf has
                         "install M /bin/false" and "blacklist M" for ib_cm, rdma_cm
                         and rdma_ucm; cuse is loaded; the init checks the three are
                         absent and prints "pvcm-init: kernel CM absent: ..."
  pvcm.share=TAG         mount the 9p share TAG (virtio-9p, 9p2000.L) at /host
  pvcm.agent=NAME        instead of the command, a request loop: every file
                         /host/q/NAME.*.sh is run with sh (stdin /dev/null), its
                         output goes to the same name .out and its exit status to
                         .rc (written last, atomically by rename), one at a time,
                         until /host/flag.stop exists. The file /host/flag.ready.NAME
                         says the loop runs. A request that must outlive its step
                         starts its work in the background itself. Needs pvcm.share.
A setup step that fails prints "pvcm-init: setup failed: REASON" and ends with
PVCM-END rc=254 without running the command or the agent.

Output goes to $PVCM_CACHE/guest/<key>/ (vmlinuz, initramfs.img, info; --rdma adds
vmlinux, the kernel's ELF image, which QEMU boots faster through its PVH entry);
$PVCM_CACHE/guest/current (default flavour), current-rdma (--rdma, bookworm) or
current-rdma-<suite> links to it. <key> hashes the flavour, the kernel, busybox and
(--rdma) the suite and its userland package versions, this script, the guest binaries and the extra files, so a re-run with
nothing changed reuses the image (cargo still checks pvcm-guest is up to date).

Options:
  --rdma               build the RDMA flavour (see above)
  --rdma-suite SUITE   the RDMA userland's Debian suite: bookworm, trixie or sid
  --print-dir          print only the image directory on stdout
  --no-guest-bin       do not build or include pvcm-guest
  --guest-bin PATH     include PATH as /usr/bin/<name> instead of building
                       (repeatable; must be statically linked)
  --extra SRC[:DEST]   copy SRC into the initramfs at DEST (default /root/<name>);
                       repeatable; a directory is copied recursively
  --extra-list FILE    lines of SRC[:DEST], as --extra (# comments, blank lines ok)
  --deb FILE           install the Debian package FILE into the image (dpkg -x;
                       repeatable; the RDMA flavour): the pvcm-guest package, so the
                       image runs what the package installs (PVCM_GUEST_DEBS, a
                       space-separated list, adds the same)
  --module NAME        include kernel module NAME (+ its dependencies) and load it
                       at boot (repeatable; uio_pci_generic always is: pvcm-guest
                       waits on the device's INTx through it instead of polling)
  --force              rebuild even if cached
  -h, --help           this help

Environment: PVCM_CACHE (default ~/.cache/pvcm), PVCM_KERNEL_PKG (default
linux-image-amd64), PVCM_RDMA_SUITE (default bookworm), CARGO (default cargo).
EOF
}

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

print_dir=0 guest_bin_mode=build force=0 flavour=default rdma_suite="${PVCM_RDMA_SUITE:-bookworm}"
guest_bins=() extras=() debs=()
# shellcheck disable=SC2206 # a list of paths, split on spaces on purpose
[ -n "${PVCM_GUEST_DEBS:-}" ] && debs=($PVCM_GUEST_DEBS)
# uio_pci_generic: pvcm-guest binds the pvcm device to it and sleeps on /dev/uioN until
# the device interrupts (INTx), instead of a timed poll (docs/scale.md, "Idle cost").
modules=(uio_pci_generic)
# Option handlers: --guest-bin, --deb, --extra-list.
guest_bin() {
    guest_bin_mode=given
    guest_bins+=("$2")
}
deb_file() {
    [ -f "$2" ] || die "--deb: no such file: $2"
    debs+=("$2")
}
extra_list() {
    local line
    [ -f "$2" ] || die "--extra-list: no such file: $2"
    while IFS= read -r line || [ -n "$line" ]; do
        line="${line%%#*}"
        line="$(echo "$line" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//')"
        if [ -n "$line" ]; then extras+=("$line"); fi
    done <"$2"
}
parse_options --print-dir:print_dir=1 --rdma:flavour=rdma --rdma-suite=rdma_suite \
    --no-guest-bin:guest_bin_mode=none \
    '--guest-bin=guest_bin()' '--extra=extras[]' '--deb=deb_file()' '--extra-list=extra_list()' \
    '--module=modules[]' --force:force=1 -- "$@"

# Packages go into the RDMA flavour only (they need its glibc and userland).
[ "$flavour" = rdma ] || debs=()
case "$rdma_suite" in
bookworm | trixie | sid) ;;
*) die "--rdma-suite $rdma_suite: bookworm, trixie or sid" ;;
esac
exec 3>&1 1>&2
t0="$(now_s)"
dl="$PVCM_CACHE/downloads"
mkdir -p "$dl/debs" "$PVCM_CACHE/guest"
apt_install cpio gzip xz-utils binutils python3

# ---- Debian packages: kernel and busybox-static (downloaded once, by version) ----

# deb_fetch PKG [APT-OPTION...]: download PKG's candidate .deb into $dl/debs (if not
# there); print its path. With no options, the host's apt answers (the kernel and
# busybox); the RDMA userland passes the suite's private apt options ($suite_apt).
deb_fetch() {
    local pkg="$1" ver file
    shift
    ver="$(apt-cache "$@" policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }')"
    if [ -z "$ver" ] || [ "$ver" = "(none)" ]; then
        apt_refresh "$@"
        ver="$(apt-cache "$@" policy "$pkg" 2>/dev/null | awk '/Candidate:/ { print $2 }')"
    fi
    [ -n "$ver" ] && [ "$ver" != "(none)" ] || die "apt knows no package $pkg"
    # .deb file names encode the epoch's colon as %3a.
    file="$dl/debs/${pkg}_${ver//:/%3a}_$(dpkg --print-architecture).deb"
    [ -f "$file" ] || file="$dl/debs/${pkg}_${ver//:/%3a}_all.deb"
    if [ ! -f "$file" ]; then
        log "apt-get download $pkg=$ver"
        (cd "$dl/debs" && apt-get download -qq -o APT::Sandbox::User=root "$@" "$pkg=$ver" >&2) || {
            apt_refresh "$@"
            (cd "$dl/debs" && apt-get download -qq -o APT::Sandbox::User=root "$@" "$pkg=$ver" >&2) || die "apt-get download $pkg=$ver failed"
        }
        file="$(ls "$dl/debs/${pkg}_${ver//:/%3a}_"*.deb 2>/dev/null | head -n1)"
        [ -f "$file" ] || die "apt-get download $pkg=$ver produced no .deb"
    fi
    echo "$file"
}

# apt_refresh [APT-OPTION...]: apt-get update, once a run: the host's (no options) or
# the suite's private one.
suite_updated=0
apt_refresh() {
    if [ $# = 0 ]; then
        apt_update_once
    elif [ "$suite_updated" = 0 ]; then
        log "apt-get update ($rdma_suite, private state under $suite_apt_dir)"
        apt-get "$@" update -qq >&2 || die "apt-get update for $rdma_suite failed"
        suite_updated=1
    fi
}

# The suite's private apt: sources.list, lists, archives and an empty dpkg status under
# $PVCM_CACHE/apt/<suite>; the host's sources, preferences and state are not read.
# $suite_apt holds the options every apt-get and apt-cache call of the userland passes.
suite_apt_dir="$PVCM_CACHE/apt/$rdma_suite"
suite_apt=(-o "Dir::Etc::SourceList=$suite_apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=$suite_apt_dir/empty" -o "Dir::Etc::Preferences=$suite_apt_dir/empty/none"
    -o "Dir::Etc::PreferencesParts=$suite_apt_dir/empty" -o "Dir::State=$suite_apt_dir/state"
    -o "Dir::State::status=$suite_apt_dir/status" -o "Dir::Cache=$suite_apt_dir/cache"
    -o APT::Architecture=amd64 -o APT::Architectures::=amd64 -o Acquire::Languages=none
    -o Debug::NoLocking=1)
suite_apt_init() {
    local s="$rdma_suite" lists
    mkdir -p "$suite_apt_dir"/{empty,state/lists/partial,cache/archives/partial}
    # One build at a time uses a suite's apt state (apt's own locks are off for it):
    # the lock is held until this script exits.
    exec {suite_apt_lock}>"$suite_apt_dir/.lock"
    flock "$suite_apt_lock"
    [ -f "$suite_apt_dir/status" ] || : >"$suite_apt_dir/status"
    {
        case "$s" in
        sid) echo "deb http://deb.debian.org/debian sid main" ;;
        *)
            echo "deb http://deb.debian.org/debian $s $s-updates main"
            echo "deb http://deb.debian.org/debian-security $s-security main"
            ;;
        esac
    } >"$suite_apt_dir/sources.list.new"
    if ! cmp -s "$suite_apt_dir/sources.list.new" "$suite_apt_dir/sources.list"; then
        mv "$suite_apt_dir/sources.list.new" "$suite_apt_dir/sources.list"
        rm -f "$suite_apt_dir"/state/lists/*_Packages*
    fi
    rm -f "$suite_apt_dir/sources.list.new"
    lists="$(find "$suite_apt_dir/state/lists" -maxdepth 1 -name '*_Packages*' -mtime -7 | head -n1)"
    [ -n "$lists" ] || apt_refresh "${suite_apt[@]}"
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
        python3 "$PVCM_SCRIPTS_DIR/e2e/checks.py" bin-targets pvcm-guest)" || die "cargo metadata failed in $PVCM_REPO_DIR"
    if [ -z "$bin_names" ]; then
        guest_note="pvcm-guest has no binary yet: image built without it"
        warn "$guest_note"
    else
        log "cargo build --release -p pvcm-guest (static, x86_64-unknown-linux-gnu)"
        (cd "$PVCM_REPO_DIR" && RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
            "$cargo" build --release -p pvcm-guest --bins --target x86_64-unknown-linux-gnu >&2) ||
            die "cargo build of pvcm-guest failed"
        tdir="${CARGO_TARGET_DIR:-$PVCM_REPO_DIR/target}/x86_64-unknown-linux-gnu/release"
        for b in $bin_names; do
            [ -x "$tdir/$b" ] || die "cargo built no $tdir/$b"
            guest_bins+=("$tdir/$b")
        done
    fi
fi
for b in "${guest_bins[@]}"; do
    [ -f "$b" ] || die "guest binary not found: $b"
    if readelf -l "$b" 2>/dev/null | grep 'Requesting program interpreter' >/dev/null; then
        die "$b is dynamically linked; the initramfs has no libc (build with -C target-feature=+crt-static)"
    fi
done

# ---- modules ----

moddir="$kdir/lib/modules/$kver"
# Debian's package ships no modules.dep (its postinst runs depmod): make one.
if [ ! -f "$moddir/modules.dep" ]; then
    apt_install kmod
    depmod -b "$kdir" "$kver" || die "depmod -b $kdir $kver failed"
fi
[ -f "$moddir/modules.dep" ] || die "no modules.dep in $moddir"

# mod_closure ARRAY SEEN NAME: append NAME's module file (relative to $moddir) to the
# array ARRAY, its dependencies first, skipping what the associative array SEEN has.
mod_closure() {
    local -n _out="$1" _seen="$2"
    local name="$3" line path dep
    line="$(grep -E "(^|/)${name//[-_]/[-_]}\.ko(\.xz|\.zst|\.gz)?:" "$moddir/modules.dep" | head -n1)" ||
        true
    [ -n "$line" ] || die "kernel $kver has no module $name (built in? see $moddir/modules.builtin)"
    path="${line%%:*}"
    [ -n "${_seen[$path]:-}" ] && return 0
    _seen["$path"]=1
    for dep in ${line#*:}; do
        dep="$(basename "$dep")"
        mod_closure "$1" "$2" "${dep%%.ko*}"
    done
    _out+=("$path")
}
builtin_mod() { grep -Eq "/${1//[-_]/[-_]}\.ko" "$moddir/modules.builtin" 2>/dev/null; }

# Loaded with insmod at boot, in order (both flavours).
mod_files=()
# shellcheck disable=SC2034 # used through mod_closure's nameref
declare -A seen=()
for m in "${modules[@]}"; do
    if builtin_mod "$m"; then
        log "module $m is built into $kver; nothing to load"
        continue
    fi
    mod_closure mod_files seen "$m"
done

# The RDMA flavour's module tree (/lib/modules/<kver>, for modprobe). crc32_generic:
# rxe needs the crc32 shash for the ICRC ("rdma link add" fails with ENOENT without it).
rdma_modules=(virtio_pci virtio_net crc32_generic rdma_rxe ib_uverbs ib_umad ib_cm iw_cm
    rdma_cm rdma_ucm fuse cuse 9p 9pnet_virtio uio_pci_generic)
rdma_mod_files=()
if [ "$flavour" = rdma ]; then
    # shellcheck disable=SC2034 # used through mod_closure's nameref
    declare -A rseen=()
    for m in "${rdma_modules[@]}"; do
        builtin_mod "$m" || mod_closure rdma_mod_files rseen "$m"
    done
fi

# ---- RDMA flavour: the suite's rdma-core userland, from .debs ----

# The packages asked for; their dependencies join when the library closure needs them.
# librdmacm1 is librdmacm1t64 from trixie on (the 64-bit time_t transition's name):
# suite_pkgs maps each name to the one the suite has.
rdma_pkgs=(rdmacm-utils ibverbs-utils ibverbs-providers librdmacm1 libibverbs1 perftest
    iproute2 libnl-3-200 libnl-route-3-200 libc6 libgcc-s1 dash strace)
suite_pkgs() {
    local p known
    known="$(apt-cache "${suite_apt[@]}" pkgnames 2>/dev/null)"
    for p in "${rdma_pkgs[@]}"; do
        if grep -qx "$p" <<<"$known"; then
            echo "$p"
        elif grep -qx "${p}t64" <<<"$known"; then
            echo "${p}t64"
        else
            die "the $rdma_suite suite has no package $p (nor ${p}t64)"
        fi
    done
}
declare -A pkg_dir=()
pkg_order=()
add_pkg() { # add_pkg PKG: download and unpack PKG once
    local deb
    [ -n "${pkg_dir[$1]:-}" ] && return 0
    deb="$(deb_fetch "$1" "${suite_apt[@]}")"
    pkg_dir[$1]="$(unpack_deb "$deb")"
    pkg_order+=("$1")
}
pkg_find() { # pkg_find /PATH: print the unpacked package dir that has /PATH
    local p d
    for p in "${pkg_order[@]}"; do
        d="${pkg_dir[$p]}"
        if [ -e "$d$1" ] || [ -L "$d$1" ]; then
            echo "$d"
            return 0
        fi
    done
    return 1
}
pkg_resolve() { # pkg_resolve /PATH: follow symlinks inside the unpacked packages only
    local path="$1" d t i
    for ((i = 0; i < 16; i++)); do
        d="$(pkg_find "$path")" || return 1
        if [ -L "$d$path" ]; then
            t="$(readlink "$d$path")"
            case "$t" in /*) path="$t" ;; *) path="$(dirname "$path")/$t" ;; esac
            path="$(realpath -m -s "$path")"
        else
            echo "$d$path"
            return 0
        fi
    done
    return 1
}
pkg_deps() { # pkg_deps PKG: PKG's Depends and Pre-Depends (first of alternatives)
    apt-cache "${suite_apt[@]}" depends --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances "$1" 2>/dev/null |
        awk '$1 == "Depends:" || $1 == "PreDepends:" { print $2 }' | grep -v '^<' || true
}
lib_dirs=(/lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64)
# The files of the image: "/PATH SRC" lines (SRC a regular file in an unpacked .deb).
rdma_files=()
declare -A rdma_have=()
add_file() { # add_file /PATH: put /PATH (its target, as a file) into the image
    local src
    [ -n "${rdma_have[$1]:-}" ] && return 0
    src="$(pkg_resolve "$1")" || return 1
    rdma_have[$1]=1
    rdma_files+=("$1 $src")
}
# find_lib SONAME PKG: set found_lib to the library's /PATH: from the packages so far, or
# else from PKG's dependencies, breadth first, each fetched and unpacked as it is
# visited. Not in a subshell: it adds packages.
found_lib=""
find_lib() {
    local n="$1" d i p dp queue=("$2")
    local -A visited=(["$2"]=1)
    for d in "${lib_dirs[@]}"; do
        if pkg_find "$d/$n" >/dev/null; then
            found_lib="$d/$n"
            return 0
        fi
    done
    for ((i = 0; i < ${#queue[@]} && i < 100; i++)); do
        p="${queue[$i]}"
        for dp in $(pkg_deps "$p"); do
            [ -n "${visited[$dp]:-}" ] && continue
            visited[$dp]=1
            queue+=("$dp")
            [ -n "${pkg_dir[$dp]:-}" ] || log "$n (for $2): trying dependency $dp of $p"
            add_pkg "$dp"
            for d in "${lib_dirs[@]}"; do
                if [ -e "${pkg_dir[$dp]}$d/$n" ] || [ -L "${pkg_dir[$dp]}$d/$n" ]; then
                    found_lib="$d/$n"
                    return 0
                fi
            done
        done
    done
    return 1
}
owner_of() { # owner_of SRC: the package whose unpacked dir holds SRC
    local p
    for p in "${pkg_order[@]}"; do
        case "$1" in "${pkg_dir[$p]}"/*) echo "$p"; return 0 ;; esac
    done
    return 1
}
add_elf() { # add_elf /PATH: the ELF file and, recursively, every library it needs
    local n src
    [ -n "${rdma_have[$1]:-}" ] && return 0
    add_file "$1" || die "no $1 in the unpacked packages (${pkg_order[*]})"
    src="${rdma_files[-1]#* }"
    for n in $(readelf -d "$src" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        find_lib "$n" "$(owner_of "$src")" || die "$1 needs $n, which no package it depends on has"
        add_elf "$found_lib"
    done
}
# The resolved closure is cached ("pkg NAME DIR" and "file /PATH SRC" lines) under a key
# of this script and the listed packages' candidate versions (one apt-cache call), so a
# re-run need not walk it again.
closure_load() {
    local kind a b
    while read -r kind a b; do
        [ -e "$b" ] || return 1
        case "$kind" in
        pkg)
            pkg_dir[$a]="$b"
            pkg_order+=("$a")
            ;;
        file)
            rdma_have[$a]=1
            rdma_files+=("$a $b")
            ;;
        esac
    done <"$1"
    [ "${#rdma_files[@]}" -gt 0 ]
}
closure_save() {
    local p
    {
        for p in "${pkg_order[@]}"; do echo "pkg $p ${pkg_dir[$p]}"; done
        printf 'file %s\n' "${rdma_files[@]}"
    } >"$1.tmp"
    mv "$1.tmp" "$1"
}
resolve_userland() {
    local p f b d provider
    for p in "${rdma_pkgs[@]}"; do add_pkg "$p"; done
    # Every ELF program of the tools packages; ip and rdma from iproute2.
    for p in rdmacm-utils ibverbs-utils perftest; do
        while IFS= read -r f; do
            readelf -h "${pkg_dir[$p]}$f" >/dev/null 2>&1 && rdma_bins+=("$f")
        done < <(cd "${pkg_dir[$p]}" && find ./usr/bin ./usr/sbin -type f 2>/dev/null | sed 's|^\.||' | sort)
    done
    for b in ip rdma; do
        f=""
        for d in /bin /sbin /usr/bin /usr/sbin; do
            if [ -f "${pkg_dir[iproute2]}$d/$b" ] && [ ! -L "${pkg_dir[iproute2]}$d/$b" ]; then
                f="$d/$b"
                break
            fi
        done
        [ -n "$f" ] || die "iproute2 has no $b"
        rdma_bins+=("$f")
    done
    [ "${#rdma_bins[@]}" -gt 10 ] || die "too few rdma-core programs found: ${rdma_bins[*]}"
    # strace, for the apps suite's ptrace checks (strace -p on a waiting program).
    rdma_bins+=(/usr/bin/strace)
    for b in "${rdma_bins[@]}"; do add_elf "$b"; done
    # The rxe provider (dlopened by libibverbs) and its driver file; libgcc_s, which
    # glibc dlopens for pthread_exit/pthread_cancel (rping aborts without it); the loader.
    provider="$(cd "${pkg_dir[ibverbs-providers]}" &&
        find usr/lib/x86_64-linux-gnu/libibverbs -name 'librxe-rdmav*.so' 2>/dev/null | sort | head -n1)"
    [ -n "$provider" ] || die "ibverbs-providers has no librxe-rdmav*.so"
    add_elf "/$provider"
    add_file /etc/libibverbs.d/rxe.driver || die "ibverbs-providers has no rxe.driver"
    add_elf "$(usr_path /lib/x86_64-linux-gnu/libgcc_s.so.1)"
    add_elf "$(usr_path /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2)"
    # /bin/sh: Debian's busybox-static runs its own applet for any command of that name,
    # whatever PATH says (FEATURE_SH_STANDALONE), so under busybox sh "ip" would never be
    # iproute2's and "modprobe" never the wrapper below. dash looks commands up in PATH.
    add_elf "$(usr_path /bin/dash)"
}
# usr_path /PATH: /PATH, or /usr/PATH where the packages have it there (trixie's
# packages ship their files under /usr).
usr_path() {
    if pkg_find "/usr$1" >/dev/null && ! pkg_find "$1" >/dev/null; then
        echo "/usr$1"
    else
        echo "$1"
    fi
}
# in_image /PATH: /PATH or /usr/PATH, whichever the image's userland has.
in_image() {
    if [ -n "${rdma_have[$1]:-}" ]; then echo "$1"; else echo "/usr$1"; fi
}
rdma_bins=()
if [ "$flavour" = rdma ]; then
    apt_install binutils kmod libc-bin
    suite_apt_init
    mapfile -t rdma_pkgs < <(suite_pkgs)
    versions="$(apt-cache "${suite_apt[@]}" policy "${rdma_pkgs[@]}" 2>/dev/null | awk '
        /^[^ ].*:$/ { p = substr($0, 1, length($0) - 1) }
        /^  Candidate:/ { print p "=" $2 }')"
    closure="$PVCM_CACHE/guest/rdma-closure.$({
        sha256sum <"${BASH_SOURCE[0]}"
        echo "suite=$rdma_suite"
        echo "$versions"
    } | short_hash)"
    if [ "$force" = 0 ] && [ -f "$closure" ] && closure_load "$closure"; then
        :
    else
        pkg_dir=() pkg_order=() rdma_have=() rdma_files=()
        resolve_userland
        closure_save "$closure"
    fi
fi

# modprobe for the RDMA image: busybox's modprobe ignores the "install MODULE COMMAND"
# lines of /etc/modprobe.d (pvcm.cm=pvcm keeps the kernel CM out with them).
read -r -d '' MODPROBE_WRAPPER <<'WRAP' || true
#!/bin/sh
# modprobe of the pvcm RDMA image (qemu-scripts/build-guest.sh --rdma): busybox's
# modprobe, plus what it ignores: an "install MODULE COMMAND" line of
# /etc/modprobe.d/*.conf for a module named on the command line runs COMMAND instead,
# and COMMAND's status is modprobe's (so "install M /bin/false" keeps M out).
remove=0
for a in "$@"; do
    case "$a" in -r | --remove | -*r*) remove=1 ;; esac
done
if [ "$remove" = 0 ]; then
    for a in "$@"; do
        case "$a" in -* | *=*) continue ;; esac
        cmd="$(cat /etc/modprobe.d/*.conf 2>/dev/null | awk -v m="$a" '
            BEGIN { gsub("-", "_", m) }
            $1 == "install" { n = $2; gsub("-", "_", n)
                if (n == m) { $1 = ""; $2 = ""; sub(/^ +/, ""); print; exit } }')"
        if [ -n "$cmd" ]; then
            sh -c "$cmd"
            exit $?
        fi
    done
fi
exec /bin/busybox modprobe "$@"
WRAP

# ---- the /init script ----

read -r -d '' INIT_SCRIPT <<'INIT' || true
#!/bin/sh
# pvcm test guest init (generated by qemu-scripts/build-guest.sh; its --help lists the
# kernel command line parameters)
set -f
export PATH=/usr/bin:/usr/sbin:/bin:/sbin HOME=/root TERM=dumb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/hugepages /tmp /run
mount -t devpts devpts /dev/pts 2>/dev/null
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
say() { echo "pvcm-init: $*"; }

# Hugepages: the kernel's hugepages=N does it at boot; pvcm.hugepages=N tops it up.
hp="$(arg pvcm.hugepages)" && [ -n "$hp" ] && echo "$hp" >/proc/sys/vm/nr_hugepages

for m in $(cat /etc/pvcm-modules 2>/dev/null); do
    insmod "/lib/modules/$m" || echo "pvcm-init: insmod $m failed"
done

# ---- RDMA flavour: network, rxe, kernel CM or not, the share ----
fail=""
setup_fail() { [ -n "$fail" ] || fail="$*"; say "setup failed: $*"; }
mp() { # mp MODULE...: modprobe each, or record the failure
    for m in "$@"; do
        modprobe "$m" || { setup_fail "modprobe $m"; return 1; }
    done
}
kver="$(uname -r)"
[ -f "/lib/modules/$kver/modules.dep" ] && echo /sbin/modprobe >/proc/sys/kernel/modprobe
ips="$(arg pvcm.ip)" || ips=""
mtu="$(arg pvcm.mtu)" || mtu=""
ipv6="$(arg pvcm.ipv6)" || ipv6=0
rxe="$(arg pvcm.rxe)" || rxe=0
cm="$(arg pvcm.cm)" || cm=""
share="$(arg pvcm.share)" || share=""
agent="$(arg pvcm.agent)" || agent=""
name="$(arg pvcm.name)" || name="$agent"
[ -n "$name" ] && hostname "$name"
case "$ips" in *:*) ipv6=1 ;; esac
CM_MODS="ib_cm rdma_cm rdma_ucm"

if [ -n "$ips$share$cm" ] || [ "$rxe" = 1 ]; then
    [ -f "/lib/modules/$kver/modules.dep" ] ||
        setup_fail "pvcm.ip/rxe/cm/share need the RDMA image (build-guest.sh --rdma)"
fi
# The kernel CM stays out before anything could load it (modprobe and the kernel's
# request_module both read /etc/modprobe.d). A kernel-CM VM booted from an image with
# the pvcm-guest package in it sets the package's rule aside, as removing the package
# would.
if [ -z "$fail" ] && [ "$cm" = kernel ]; then
    for f in /lib/modprobe.d/pvcm-guest.conf /etc/modprobe.d/pvcm-guest.conf; do
        [ -f "$f" ] || continue
        mv "$f" "$f.off"
        say "pvcm.cm=kernel: the pvcm-guest package's modprobe rule set aside"
    done
fi
if [ -z "$fail" ] && [ "$cm" = pvcm ]; then
    mkdir -p /etc/modprobe.d
    for m in $CM_MODS; do
        echo "install $m /bin/false"
        echo "blacklist $m"
    done >/etc/modprobe.d/pvcm.conf
fi
if [ -z "$fail" ] && { [ -n "$ips$share" ] || [ "$rxe" = 1 ]; }; then
    mp virtio_pci
fi
if [ -z "$fail" ] && [ -n "$share" ]; then
    mp 9pnet_virtio 9p && mkdir -p /host &&
        { mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "$share" /host ||
            setup_fail "mount 9p share $share at /host"; }
fi
if [ -z "$fail" ] && { [ -n "$ips" ] || [ "$rxe" = 1 ]; }; then
    mp virtio_net
    i=0
    while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    [ -e /sys/class/net/eth0 ] || setup_fail "no eth0"
fi
if [ -z "$fail" ] && [ -e /sys/class/net/eth0 ]; then
    if [ "$ipv6" != 1 ]; then
        for c in all default eth0; do echo 1 >/proc/sys/net/ipv6/conf/$c/disable_ipv6; done
    fi
    [ -n "$mtu" ] && { ip link set eth0 mtu "$mtu" || setup_fail "mtu $mtu"; }
    ip link set eth0 up || setup_fail "eth0 up"
    for a in $(echo "$ips" | tr , ' '); do
        case "$a" in
        *:*) ip -6 addr add "$a" dev eth0 nodad || setup_fail "address $a" ;;
        *) ip addr add "$a" dev eth0 || setup_fail "address $a" ;;
        esac
    done
    i=0
    while ! grep -q 1 /sys/class/net/eth0/carrier 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
fi
if [ -z "$fail" ] && [ "$cm" = kernel ]; then
    mp $CM_MODS
elif [ -z "$fail" ] && [ "$cm" = pvcm ]; then
    mp cuse
    for m in $CM_MODS; do
        [ ! -d "/sys/module/$m" ] || setup_fail "$m is loaded"
    done
    [ -n "$fail" ] || say "kernel CM absent: $CM_MODS not loaded, blocked in /etc/modprobe.d/pvcm.conf"
elif [ -n "$cm" ]; then
    setup_fail "pvcm.cm=$cm: kernel or pvcm"
fi

# gid ADDR: the GID of an address as sysfs prints it (IPv4 as ::ffff:a.b.c.d).
gid() {
    echo "$1" | awk '
    /\./ { split($0, o, "."); printf "0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x\n", o[1], o[2], o[3], o[4]; next }
    {
        n = split($0, h, ":"); z = 0
        for (i = 1; i <= n; i++) if (h[i] != "") z++
        out = ""; done = 0
        for (i = 1; i <= n; i++) {
            if (h[i] == "") {
                if (done) continue
                done = 1
                for (k = 0; k < 8 - z; k++) out = out "0000:"
                continue
            }
            out = out sprintf("%4s:", h[i])
        }
        gsub(/ /, "0", out)
        print tolower(substr(out, 1, length(out) - 1))
    }'
}
gid_table() {
    set +f
    for f in /sys/class/infiniband/rxe0/ports/1/gids/*; do
        read -r g <"$f" 2>/dev/null || continue
        [ "$g" = 0000:0000:0000:0000:0000:0000:0000:0000 ] && continue
        n="${f##*/}"
        read -r t </sys/class/infiniband/rxe0/ports/1/gid_attrs/types/"$n" 2>/dev/null || t="?"
        echo "  gid $n $g $t"
    done
    set -f
}
if [ -z "$fail" ] && [ "$rxe" = 1 ]; then
    mp crc32_generic rdma_rxe ib_uverbs ib_umad
    if [ -z "$fail" ]; then
        rdma link add rxe0 type rxe netdev eth0 || setup_fail "rdma link add rxe0"
    fi
    if [ -z "$fail" ]; then
        p=/sys/class/infiniband/rxe0/ports/1
        i=0
        while ! grep -q ACTIVE $p/state 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
        grep -q ACTIVE $p/state 2>/dev/null || setup_fail "rxe0 port 1 not ACTIVE: $(cat $p/state 2>/dev/null)"
        want=""
        for a in $(echo "$ips" | tr , ' '); do want="$want $(gid "${a%/*}")"; done
        i=0
        while [ -z "$fail" ]; do
            table="$(gid_table)"
            missing=""
            for g in $want; do
                case "$table" in *" $g RoCE v2"*) ;; *) missing="$missing $g" ;; esac
            done
            [ -z "$missing" ] && break
            if [ $i -ge 100 ]; then
                setup_fail "no RoCE v2 GID for:$missing"
                echo "rxe0 GID table:"
                echo "$table"
            fi
            i=$((i + 1))
            sleep 0.1
        done
    fi
fi
if [ -n "$fail" ]; then
    dmesg | grep -iE 'rxe|rdma|infiniband|ib_|_cm|crc32|virtio|eth0|9p' | tail -n 40
fi

# Keep kernel messages out of the command's output (dmesg still has them).
lvl="$(arg pvcm.printk)" || lvl=1
echo "$lvl" >/proc/sys/kernel/printk
if [ -e /sys/class/net/eth0 ] && [ -z "$fail" ]; then
    say "ready name=${name:-} ip=$ips mac=$(cat /sys/class/net/eth0/address)$([ "$rxe" = 1 ] && gid_table | awk '{ printf " gid%s=%s", $2, $3 }')"
fi

# agent NAME: run /host/q/NAME.*.sh requests until /host/flag.stop exists.
agent() {
    me="$1"
    mkdir -p /host/q
    echo ready >"/host/flag.ready.$me.tmp" && mv "/host/flag.ready.$me.tmp" "/host/flag.ready.$me"
    say "agent $me: serving /host/q/$me.*.sh"
    set +f
    while [ ! -e /host/flag.stop ]; do
        for f in /host/q/"$me".*.sh; do
            [ -e "$f" ] || continue
            n="${f%.sh}"
            mv "$f" "$n.run" 2>/dev/null || continue
            sh "$n.run" >"$n.out" 2>&1 </dev/null
            echo $? >"$n.rc.tmp"
            mv "$n.rc.tmp" "$n.rc"
        done
        sleep 0.1
    done
    set -f
    say "agent $me: /host/flag.stop, stopping"
}

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
if [ -n "$fail" ]; then
    say "setup failed: $fail"
    (exit 254)
elif [ -n "$agent" ] && [ -z "$share" ]; then
    say "pvcm.agent needs pvcm.share"
    (exit 254)
elif [ -n "$agent" ]; then
    agent "$agent" </dev/null 2>&1
elif t="$(arg pvcm.timeout)" && [ -n "$t" ]; then
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
    echo "flavour=$flavour"
    echo "kernel=$(basename "$kernel_deb") busybox=$(basename "$busybox_deb")"
    sha256sum <"${BASH_SOURCE[0]}"
    echo "modules=${mod_files[*]}"
    if [ "$flavour" = rdma ]; then
        echo "rdma_suite=$rdma_suite"
        echo "rdma_modules=${rdma_mod_files[*]}"
        for p in "${pkg_order[@]}"; do echo "deb $(basename "${pkg_dir[$p]}")"; done
        printf 'file %s\n' "${rdma_files[@]}"
    fi
    for b in "${guest_bins[@]}"; do echo "bin $(basename "$b") $(sha256sum <"$b")"; done
    for e in "${extras[@]}"; do echo "extra $e"; done
    [ "${#extra_srcs[@]}" -gt 0 ] && hash_paths "${extra_srcs[@]}"
    for d in "${debs[@]}"; do echo "deb-installed $(basename "$d") $(sha256sum <"$d")"; done
    true
} | short_hash)"
out="$PVCM_CACHE/guest/$key"
link=current
[ "$flavour" = rdma ] && link=current-rdma
[ "$flavour" = rdma ] && [ "$rdma_suite" != bookworm ] && link="current-rdma-$rdma_suite"

if [ "$force" = 0 ] && [ -f "$out/.pvcm-built" ]; then
    ln -sfn "$key" "$PVCM_CACHE/guest/$link"
    [ -n "$guest_note" ] && warn "$guest_note"
    if [ "$print_dir" = 1 ]; then echo "$out" >&3; else log "up to date: $out ($(elapsed "$t0") s)"; fi
    exit 0
fi

# ---- assemble the initramfs ----

log "assembling the $flavour initramfs (kernel $kver, $(basename "$busybox_deb" .deb))"
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
if [ "$flavour" = rdma ]; then
    # Modules under /lib/modules/<kver>, uncompressed, with a modules.dep of their own.
    rmod="$root/lib/modules/$kver"
    mkdir -p "$rmod"
    for f in modules.builtin modules.builtin.modinfo modules.order; do
        [ -f "$moddir/$f" ] && cp "$moddir/$f" "$rmod/"
    done
    for mf in "${rdma_mod_files[@]}"; do
        dst="$rmod/${mf%.xz}"
        dst="${dst%.zst}"
        dst="${dst%.gz}"
        mkdir -p "$(dirname "$dst")"
        case "$mf" in
        *.xz) xz -dc "$moddir/$mf" >"$dst" ;;
        *.zst) zstd -qdc "$moddir/$mf" >"$dst" ;;
        *.gz) gzip -dc "$moddir/$mf" >"$dst" ;;
        *) cp "$moddir/$mf" "$dst" ;;
        esac
    done
    depmod -b "$root" "$kver" || die "depmod of the image's module tree failed"
    # The userland: each file at its path, symlinks resolved inside the packages.
    for line in "${rdma_files[@]}"; do
        path="${line%% *}" src="${line#* }"
        mkdir -p "$root$(dirname "$path")"
        rm -f "$root$path" # a busybox applet of the same name
        cp "$src" "$root$path"
    done
    mkdir -p "$root/lib64"
    [ -e "$root/lib64/ld-linux-x86-64.so.2" ] ||
        ln -s "$(in_image /lib/x86_64-linux-gnu/ld-linux-x86-64.so.2)" "$root/lib64/ld-linux-x86-64.so.2"
    printf '%s\n' /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu >"$root/etc/ld.so.conf"
    ldconfig -r "$root" || die "ldconfig -r $root failed"
    echo "root:x:0:" >"$root/etc/group"
    echo "127.0.0.1 localhost" >"$root/etc/hosts"
    echo "hosts: files" >"$root/etc/nsswitch.conf"
    mkdir -p "$root/etc/modprobe.d" "$root/dev/infiniband"
    # Packages to install as they are (the pvcm-guest package: its service, unit,
    # modprobe rule, udev rule), over the userland.
    for d in "${debs[@]}"; do
        dpkg -x "$d" "$root" || die "dpkg -x $d failed"
    done
    ln -sfn "$(in_image /bin/dash)" "$root/bin/sh"
    rm -f "$root/sbin/modprobe"
    printf '%s\n' "$MODPROBE_WRAPPER" >"$root/sbin/modprobe"
    chmod 755 "$root/sbin/modprobe"
    # A busybox applet elsewhere in PATH must not shadow a real program (ip).
    for line in "${rdma_files[@]}"; do
        path="${line%% *}"
        case "$path" in */bin/* | */sbin/*) ;; *) continue ;; esac
        for d in /bin /sbin /usr/bin /usr/sbin; do
            [ "$d/${path##*/}" != "$path" ] && [ -L "$root$d/${path##*/}" ] &&
                [ "$(readlink "$root$d/${path##*/}")" = /bin/busybox ] && rm -f "$root$d/${path##*/}"
        done
    done
fi
{
    echo "flavour=$flavour"
    echo "kernel=$kver ($(basename "$kernel_deb"))"
    echo "busybox=$(basename "$busybox_deb")"
    if [ "$flavour" = rdma ]; then
        echo "rdma_suite=$rdma_suite"
        for p in "${pkg_order[@]}"; do echo "deb=$(basename "${pkg_dir[$p]}")"; done
    fi
    for b in "${guest_bins[@]}"; do echo "bin=/usr/bin/$(basename "$b")"; done
    for d in "${debs[@]}"; do echo "installed=$(basename "$d")"; done
    [ -n "$guest_note" ] && echo "note=$guest_note"
    echo "key=$key"
} >"$root/etc/pvcm-image-info"

(cd "$root" && find . -print0 | LC_ALL=C sort -z |
    cpio --null -o -H newc --owner=0:0 --reproducible --quiet) | gzip -n -6 >"$tmp/initramfs.img"
cp "$vmlinuz" "$tmp/vmlinuz"
if [ "$flavour" = rdma ]; then
    # The kernel's ELF image too (netlab.kernel_image): QEMU boots it through its PVH
    # entry point, which skips the bzImage's self-decompression (seconds under TCG). Only
    # when the ELF has the PVH note (Xen ELF note type 18, XEN_ELFNOTE_PHYS32_ENTRY); else
    # vmlinuz it is.
    netlab_py netlab.kernel_image "$vmlinuz" "$tmp/vmlinux" || true
    if [ -f "$tmp/vmlinux" ] && ! readelf -n "$tmp/vmlinux" 2>/dev/null | grep -q 'Unknown note type: (0x00000012)\|XEN_ELFNOTE_PHYS32_ENTRY'; then
        warn "the kernel's ELF image has no PVH entry note; the rdma image boots vmlinuz"
        rm -f "$tmp/vmlinux"
    fi
fi
cp "$root/etc/pvcm-image-info" "$tmp/info"
rm -rf "$root"
echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ) build_seconds=$(elapsed "$t0")" >"$tmp/.pvcm-built"
rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$tmp" "$out"
trap - EXIT
ln -sfn "$key" "$PVCM_CACHE/guest/$link"
log "$flavour guest image $out: kernel $kver, initramfs $(du -h "$out/initramfs.img" | cut -f1), $(elapsed "$t0") s"
[ -n "$guest_note" ] && warn "$guest_note"
if [ "$print_dir" = 1 ]; then echo "$out" >&3; fi
