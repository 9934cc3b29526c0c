#!/usr/bin/env bash
# Checks the Debian packages for real, in a Debian 12 (bookworm) chroot made with
# debootstrap (cached under $PVCM_CACHE/chroot; this machine's root is never touched):
# builds them twice (the second with a higher version), runs lintian, installs the
# first, runs the installed programs, upgrades to the second, removes and purges both,
# and checks what the maintainer scripts did with the services (a recording systemctl
# stands in for systemd, which does not run in a chroot), that no process is left and
# that nothing of the packages stays behind. Needs root. Run by .ci/run.
#   packaging/test-debs.sh [--no-build]
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../qemu-scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../qemu-scripts/lib.sh"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
need_root "packaging/test-debs.sh (debootstrap, chroot)"
out="$(mktemp -d)"
root="$out/root"
cleanup() {
    local m
    for m in "$root/dev/pts" "$root/dev" "$root/proc"; do
        mountpoint -q "$m" 2>/dev/null && umount -l "$m"
    done
    rm -rf "$out"
}
trap cleanup EXIT
command -v debootstrap >/dev/null || apt_install debootstrap
command -v lintian >/dev/null || apt_install lintian
command -v systemd-analyze >/dev/null || apt_install systemd
command -v python3 >/dev/null || apt_install python3

version="$(awk -F'"' '/^version = / { print $2; exit }' "$repo/Cargo.toml")"
bash "$here/build-debs.sh" --out "$out/v1" "$@"
# The upgrade: the same binaries under a higher version.
bash "$here/build-debs.sh" --out "$out/v2" --no-build --version "$version+upgrade1"

fail=0
check() { # check DESCRIPTION COMMAND...
    if "${@:2}" >"$out/check.log" 2>&1; then
        echo "PASS  $1"
    else
        echo "FAIL  $1"
        sed 's/^/      /' "$out/check.log"
        fail=1
    fi
}
in_root() { chroot "$root" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LC_ALL=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"; }

for d in "$out"/v1/*.deb; do
    echo "== $(basename "$d")"
    dpkg-deb --info "$d" | sed -n 's/^ *\(Package\|Version\|Depends\|Recommends\|Installed-Size\):/  \1:/p'
done
check "lintian: no error or warning (overrides justified in the package)" \
    lintian --fail-on error,warning -L '>=warning' "$out"/v1/*.deb
g1="$(echo "$out"/v1/pvcm-guest_*.deb)" h1="$(echo "$out"/v1/pvcm-backend_*.deb)"
has() { dpkg-deb -c "$1" | awk '{ print $6 }' | grep -qx "$2"; }
check "pvcm-guest ships the service, its unit, the modprobe rule (not a conffile), the drop-in, the udev rule" \
    bash -c "$(declare -f has); has $g1 ./usr/sbin/pvcm-guestd && has $g1 ./lib/systemd/system/pvcm-guestd.service &&
             has $g1 ./lib/modprobe.d/pvcm-guest.conf &&
             has $g1 './lib/systemd/system/rdma-load-modules@.service.d/pvcm-guest.conf' &&
             has $g1 ./lib/udev/rules.d/60-pvcm-guest.rules &&
             ! dpkg-deb --ctrl-tarfile $g1 | tar -xO ./conffiles | grep -q modprobe"
check "pvcm-guest sets no sysctl (an admin's vm.nr_hugepages stays)" \
    bash -c "! dpkg-deb -c $g1 | grep -q sysctl"
# The unit's hugepages step, run against a stand-in for /proc/sys/vm/nr_hugepages.
hugepages() { # hugepages BEFORE WANT: the pool after the step
    local f="$out/nr_hugepages" cmd
    echo "$1" >"$f"
    cmd="$(sed -n "s|^ExecStartPre=/bin/sh -c '\(.*nr_hugepages.*\)'\$|\1|p" \
        "$here/guest/pvcm-guestd.service" | sed -e 's/\$\$/$/g' -e "s|/proc/sys/vm/nr_hugepages|$f|g")"
    [ -n "$cmd" ] || return 1
    PVCM_GUESTD_HUGEPAGES="$2" sh -c "$cmd" && cat "$f"
}
check "pvcm-guestd's start raises the hugepage pool to PVCM_GUESTD_HUGEPAGES, never lowers it" \
    bash -c "$(declare -f hugepages); out=$out here=$here
             [ \"\$(hugepages 2 8)\" = 8 ] && [ \"\$(hugepages 64 8)\" = 64 ] && [ \"\$(hugepages 0 '')\" = 0 ]"
check "pvcm-backend ships the daemon, its unit, its config and an example, man pages" \
    bash -c "$(declare -f has); has $h1 ./usr/sbin/pvcm-backend && has $h1 ./etc/pvcm/backend.toml &&
             has $h1 ./usr/share/doc/pvcm-backend/examples/backend.toml &&
             has $h1 ./usr/share/doc/pvcm-backend/deploy.md &&
             has $h1 ./usr/share/man/man8/pvcm-backend.8.gz && has $h1 ./usr/share/man/man5/pvcm-backend.toml.5.gz &&
             has $h1 ./usr/sbin/pvcm-qp1-divert && has $h1 ./etc/libvirt/hooks/qemu.d/pvcm"
check "md5sums, a changelog, stripped binaries and their symbols in -dbgsym packages" \
    bash -c "for p in $g1 $h1; do dpkg-deb --ctrl-tarfile \$p | tar -t | grep -qx ./md5sums || exit 1
               dpkg-deb -c \$p | grep -q '/usr/share/doc/[a-z-]*/changelog.gz\$' || exit 1; done
             dpkg-deb -x $h1 $out/x && ! readelf -S $out/x/usr/sbin/pvcm-backend | grep -q '\.debug_info\|\.symtab' &&
             dpkg-deb -c $out/v1/pvcm-backend-dbgsym_*.deb | grep -q '/usr/lib/debug/.build-id/.*\.debug\$' &&
             dpkg-deb -c $out/v1/pvcm-guest-dbgsym_*.deb | grep -q '/usr/lib/debug/.build-id/.*\.debug\$'"
check "Depends come from dpkg-shlibdeps (libc6 from the binaries' symbols)" \
    bash -c "dpkg-deb -f $h1 Depends | grep -q 'libc6 (>= ' && dpkg-deb -f $g1 Depends | grep -q 'libc6 (>= '"
# Every relative link in a shipped document leads to a shipped file.
doclinks() {
    local f l bad=0
    rm -rf "$out/docs" && dpkg-deb -x "$1" "$out/docs"
    while IFS= read -r f; do
        for l in $(grep -o '](\([^)#: ]*\)' "$f" | sed 's/^](//' | sort -u); do
            [ -n "$l" ] || continue
            [ -e "$(dirname "$f")/$l" ] || {
                echo "${f#"$out"/docs}: links to $l, not shipped"
                bad=1
            }
        done
    done < <(find "$out/docs/usr/share/doc" -name '*.md')
    return $bad
}
check "pvcm-guest's docs link only to shipped files" doclinks "$g1"
check "pvcm-backend's docs link only to shipped files" doclinks "$h1"
man_has() { # man_has DEB PAGE WORD...: the page (man -l) has every WORD
    rm -rf "$out/man" && dpkg-deb -x "$1" "$out/man"
    local text
    text="$(MANWIDTH=200 man -l "$out/man/$2" 2>/dev/null)"
    shift 2
    for w in "$@"; do grep -q -- "$w" <<<"$text" || {
        echo "no '$w'"
        return 1
    }; done
}
check "man pages: every subcommand and option, FILES, SEE ALSO; the config in section 5" \
    bash -c "$(declare -f man_has); out=$out
             man_has $h1 usr/share/man/man8/pvcm-backend.8.gz SUBCOMMANDS 'pvcm-backend stat' 'pvcm-backend check-config' \
                 'pvcm-backend vm add' 'pvcm-backend vm quota' --state-dir --metrics FILES 'SEE ALSO' &&
             man_has $h1 usr/share/man/man5/pvcm-backend.toml.5.gz '\[\[vm\]\]' FILES 'SEE ALSO' &&
             man_has $g1 usr/share/man/man8/pvcm-guestd.8.gz FILES 'SEE ALSO' &&
             man_has $g1 usr/share/man/man1/pvcm-guest.1.gz SUBCOMMANDS FILES 'SEE ALSO'"

# ---- the chroot: Debian 12 minbase with systemd's tools, kmod and udev ----
cache="${PVCM_CACHE:-$HOME/.cache/pvcm}/chroot"
include="systemd,kmod,udev,procps"
base="$cache/bookworm-minbase-$(echo "$include" | short_hash).tar"
if [ ! -f "$base" ]; then
    log "debootstrap bookworm (once; cached as $base)"
    mkdir -p "$cache"
    debootstrap --variant=minbase --include="$include" bookworm "$out/boot" \
        "${PVCM_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$out/debootstrap.log" 2>&1 ||
        die "debootstrap failed ($(tail -1 "$out/debootstrap.log"))"
    tar -C "$out/boot" -cf "$base.tmp" . && mv "$base.tmp" "$base"
    rm -rf "${out:?}/boot"
fi
mkdir -p "$root"
tar -C "$root" -xf "$base"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
# systemd does not run here: the maintainer scripts see /run/systemd/system and a
# systemctl that records what it is asked (deb-systemd-invoke and
# deb-systemd-helper are the real ones).
mkdir -p "$root/run/systemd/system" "$root/usr/local/sbin"
cat >"$root/usr/local/sbin/systemctl" <<'EOF'
#!/bin/sh
echo "$*" >>/var/log/systemctl.log
case " $* " in
*" is-enabled "*) echo enabled ;;
*" is-active "*) exit 3 ;;
esac
exit 0
EOF
chmod 755 "$root/usr/local/sbin/systemctl"
snapshot() { # the chroot's files, less what changes anyway
    (cd "$root" && find . -xdev \( -path ./proc -o -path ./dev -o -path ./run -o -path ./tmp \
        -o -path ./var/log -o -path ./var/cache -o -path ./var/lib/dpkg -o -path ./var/lib/apt \) \
        -prune -o -print | LC_ALL=C sort)
}
snapshot >"$out/before"
calls() { cat "$root/var/log/systemctl.log" 2>/dev/null; : >"$root/var/log/systemctl.log"; }
cp "$out"/v1/*.deb "$out"/v2/*.deb "$root/tmp/"
v1() { echo "/tmp/$1_${version}_$(dpkg --print-architecture).deb"; }
v2() { echo "/tmp/$1_${version}+upgrade1_$(dpkg --print-architecture).deb"; }

check "both packages and their -dbgsym install (dpkg -i in the chroot)" \
    in_root dpkg -i "$(v1 pvcm-guest)" "$(v1 pvcm-backend)" "$(v1 pvcm-guest-dbgsym)" "$(v1 pvcm-backend-dbgsym)"
c="$(calls)"
echo "$c" >"$out/install.calls"
check "install: pvcm-guestd enabled and started, pvcm-backend left off (it needs VMs configured)" \
    bash -c "cat $out/install.calls; grep -q 'start pvcm-guestd.service' <<<'$c' && ! grep -q 'start pvcm-backend' <<<'$c' &&
             grep -q 'preset pvcm-guestd.service' <<<'$c' && ! grep -q 'pvcm-backend.service' $out/install.calls"
check "systemd-analyze verify pvcm-guestd.service and pvcm-backend.service" \
    bash -c "cd $root && systemd-analyze verify --man=no --root=$root lib/systemd/system/pvcm-guestd.service \
             lib/systemd/system/pvcm-backend.service"
check "the installed pvcm-guestd, pvcm-guest and pvcm-backend run (--version)" \
    in_root sh -c "pvcm-guestd --version && pvcm-backend --version && pvcm-guest --version"
check "modprobe keeps rdma_ucm, rdma_cm and ib_cm out (blacklist; an explicit modprobe fails)" \
    in_root sh -c "modprobe -c | grep -qx 'blacklist rdma_ucm' && modprobe -c | grep -qx 'blacklist ib_cm' &&
                   modprobe -c | grep -qx 'install rdma_ucm /bin/false' &&
                   modprobe -c | grep -qx 'install rdma_cm /bin/false'"
# rdma-core's rdma-load-modules@rdma runs the drop-in's ExecStart; with the list Debian
# ships (ib_iser, ib_uverbs, rdma_ucm, xprtrdma, svcrdma) it loads ib_uverbs only, and
# succeeds.
cat >"$root/usr/local/sbin/modprobe-stub" <<'EOF'
#!/bin/sh
[ "$1" = --show-depends ] && exit 1
echo "$*" >>/tmp/modprobe.log
EOF
chmod 755 "$root/usr/local/sbin/modprobe-stub"
printf '# rdma.conf\nib_iser\nib_uverbs\nrdma_ucm # librdmacm\nxprtrdma\nsvcrdma\n' >"$root/tmp/rdma.conf"
check "rdma-load-modules@ drop-in: the unit's list without the kernel CM, and it succeeds" \
    bash -c "grep -qx 'ExecStart=/usr/lib/pvcm-guest/rdma-load-modules /etc/rdma/modules/%I.conf' \
                 '$root/lib/systemd/system/rdma-load-modules@.service.d/pvcm-guest.conf' &&
             chroot $root env PVCM_MODPROBE=modprobe-stub PATH=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
                 /usr/lib/pvcm-guest/rdma-load-modules /tmp/rdma.conf &&
             [ \"\$(cat $root/tmp/modprobe.log)\" = ib_uverbs ]"
check "pvcm-backend check-config accepts the example and names a bad key" \
    in_root sh -c "pvcm-backend check-config /usr/share/doc/pvcm-backend/examples/backend.toml >/dev/null &&
                   printf 'bind-port = 0\n' >/tmp/bad.toml &&
                   ! pvcm-backend check-config /tmp/bad.toml 2>/tmp/bad.err && grep -q bind-port /tmp/bad.err"
check "pvcm-backend starts on the shipped config plus one VM and answers stat" \
    in_root sh -c "pvcm-backend --config /etc/pvcm/backend.toml --wire-rx udp \
                     --vm socket=/tmp/vm.sock,gid=127.0.0.99,name=x --control /tmp/ctl >/tmp/backend.log 2>&1 &
                   pid=\$!
                   for i in \$(seq 100); do [ -S /tmp/ctl ] && break; sleep 0.1; done
                   pvcm-backend stat --control /tmp/ctl; rc=\$?; kill \$pid; wait \$pid; exit \$rc"
check "the installed pvcm-qp1-divert runs on its own (--help, and a usage error)" \
    in_root bash -c "pvcm-qp1-divert --help | grep -q 'pvcm-qp1-divert add TAP DEV MAC' &&
                     { pvcm-qp1-divert add tap0 dev0 >/dev/null 2>&1; [ \$? = 2 ]; }"
check "the libvirt hook adds the divert on started and removes it on release, by MAC" \
    bash "$here/hook-check.sh" "$root/etc/libvirt/hooks/qemu.d/pvcm" "$out"

# The daemon's state, as the service would leave it.
mkdir -p "$root/var/lib/pvcm" && echo journal >"$root/var/lib/pvcm/state"
check "upgrade to $version+upgrade1 (dpkg -i)" \
    in_root dpkg -i "$(v2 pvcm-guest)" "$(v2 pvcm-backend)" "$(v2 pvcm-guest-dbgsym)" "$(v2 pvcm-backend-dbgsym)"
c="$(calls)"
echo "$c" >"$out/upgrade.calls"
check "upgrade: both services restarted if they run (try-restart), the new version installed" \
    bash -c "grep -q 'try-restart pvcm-guestd.service' <<<'$c' && grep -q 'try-restart pvcm-backend.service' <<<'$c' &&
             ! grep -q ' stop ' $out/upgrade.calls &&
             [ \"\$(chroot $root dpkg-query -W -f '\${Version}' pvcm-backend)\" = '$version+upgrade1' ]"
check "dpkg -r removes both; the services stop" \
    in_root dpkg -r pvcm-guest-dbgsym pvcm-backend-dbgsym pvcm-guest pvcm-backend
c="$(calls)"
check "remove: both services stopped; the modprobe rule and the drop-in gone; conffiles kept" \
    bash -c "grep -q 'stop pvcm-guestd.service' <<<'$c' && grep -q 'stop pvcm-backend.service' <<<'$c' &&
             [ ! -e $root/lib/modprobe.d/pvcm-guest.conf ] &&
             [ ! -e '$root/lib/systemd/system/rdma-load-modules@.service.d/pvcm-guest.conf' ] &&
             [ -e $root/etc/pvcm/backend.toml ] && [ -e $root/var/lib/pvcm/state ]"
check "dpkg -P purges both" in_root dpkg -P pvcm-guest pvcm-backend
check "purge: /var/lib/pvcm, /etc/pvcm and every file of the packages gone" \
    bash -c "[ ! -e $root/var/lib/pvcm ] && [ ! -e $root/etc/pvcm ] && [ ! -e $root/etc/default/pvcm-guestd ] &&
             rm -f $root/usr/local/sbin/modprobe-stub $root/tmp/*.deb &&
             diff $out/before <($(declare -f snapshot); root=$root snapshot)"
check "nothing of the chroot is left running" \
    bash -c "for p in /proc/[0-9]*; do [ \"\$(readlink \$p/root 2>/dev/null)\" = $root ] &&
             { echo \"\${p#/proc/}: \$(tr '\0' ' ' <\$p/cmdline)\"; exit 1; }; done; exit 0"
echo "packages: $([ $fail = 0 ] && echo ok || echo FAILED)"
exit $fail
