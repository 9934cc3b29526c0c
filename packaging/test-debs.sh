#!/usr/bin/env bash
# Checks the Debian packages for real: builds them, installs them on this machine
# (dpkg -i), has systemd verify both units, runs the installed programs, removes them.
# Needs root. Run by .ci/run.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../qemu-scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/../qemu-scripts/lib.sh"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
need_root "packaging/test-debs.sh (dpkg -i)"
out="$(mktemp -d)"
trap 'dpkg -P pvcm-guest pvcm-backend >/dev/null 2>&1 || true; rm -rf "$out"' EXIT
command -v systemd-analyze >/dev/null || apt_install systemd
command -v udevadm >/dev/null || apt_install udev
command -v modprobe >/dev/null || apt_install kmod
bash "$here/build-debs.sh" --out "$out" "$@"
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
for d in "$out"/*.deb; do
    echo "== $(basename "$d")"
    dpkg-deb --info "$d" | sed -n 's/^ *\(Package\|Version\|Depends\|Installed-Size\):/  \1:/p'
done
check "pvcm-guest ships the service, its unit, the modprobe rule, the udev rule" \
    bash -c "dpkg-deb -c '$out'/pvcm-guest_*.deb | grep -q ./usr/sbin/pvcm-guestd &&
             dpkg-deb -c '$out'/pvcm-guest_*.deb | grep -q ./lib/systemd/system/pvcm-guestd.service &&
             dpkg-deb -c '$out'/pvcm-guest_*.deb | grep -q ./etc/modprobe.d/pvcm-guest.conf &&
             dpkg-deb -c '$out'/pvcm-guest_*.deb | grep -q ./usr/lib/udev/rules.d/60-pvcm-guest.rules"
check "pvcm-backend ships the daemon, its unit, its config and an example, a man page" \
    bash -c "dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./usr/sbin/pvcm-backend &&
             dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./etc/pvcm/backend.toml &&
             dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./usr/share/doc/pvcm-backend/examples/backend.toml &&
             dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./usr/share/doc/pvcm-backend/deploy.md &&
             dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./usr/share/man/man8/pvcm-backend.8.gz"
check "pvcm-backend ships the QP1 divert tool and its libvirt hook" \
    bash -c "dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./usr/sbin/pvcm-qp1-divert &&
             dpkg-deb -c '$out'/pvcm-backend_*.deb | grep -q ./etc/libvirt/hooks/qemu.d/pvcm"
check "both packages install (dpkg -i)" dpkg -i "$out"/pvcm-guest_*.deb "$out"/pvcm-backend_*.deb
check "systemd-analyze verify pvcm-guestd.service" \
    systemd-analyze verify /lib/systemd/system/pvcm-guestd.service
check "systemd-analyze verify pvcm-backend.service" \
    systemd-analyze verify /lib/systemd/system/pvcm-backend.service
check "the installed pvcm-guestd and pvcm-backend run (--version)" \
    bash -c "/usr/sbin/pvcm-guestd --version && /usr/sbin/pvcm-backend --version && /usr/bin/pvcm-guest --version"
check "the modprobe rule keeps rdma_ucm out (modprobe -n shows /bin/false)" \
    bash -c "modprobe -n -v --ignore-install rdma_ucm >/dev/null 2>&1; modprobe -c | grep -q '^install rdma_ucm /bin/false'"
check "pvcm-backend check-config accepts the example and names a bad key" \
    bash -c "/usr/sbin/pvcm-backend check-config /usr/share/doc/pvcm-backend/examples/backend.toml &&
             printf 'bind-port = 0\n' >$out/bad.toml &&
             ! /usr/sbin/pvcm-backend check-config $out/bad.toml 2>$out/bad.err &&
             grep -q 'bind-port' $out/bad.err"
check "pvcm-backend starts on the shipped config plus one VM and answers stat" \
    bash -c "/usr/sbin/pvcm-backend --config /etc/pvcm/backend.toml --wire-rx udp \
               --vm socket=$out/vm.sock,gid=127.0.0.99,name=x --control $out/ctl \
               --state-dir $out/state >$out/backend.log 2>&1 & pid=\$!
             for i in \$(seq 100); do [ -S $out/ctl ] && break; sleep 0.1; done
             /usr/sbin/pvcm-backend stat --control $out/ctl; rc=\$?; kill \$pid; exit \$rc"
check "the installed pvcm-qp1-divert runs on its own (--help, and a usage error)" \
    bash -c "/usr/sbin/pvcm-qp1-divert --help | grep -q 'pvcm-qp1-divert add TAP DEV MAC' &&
             { /usr/sbin/pvcm-qp1-divert add tap0 dev0 >/dev/null 2>&1; [ \$? = 2 ]; }"
check "the libvirt hook adds the divert on started and removes it on release, by MAC" \
    bash "$here/hook-check.sh" /etc/libvirt/hooks/qemu.d/pvcm "$out"
check "dpkg -r removes both" dpkg -r pvcm-guest pvcm-backend
echo "packages: $([ $fail = 0 ] && echo ok || echo FAILED)"
exit $fail
