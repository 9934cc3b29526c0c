#!/usr/bin/env bash
# Runs the libvirt hook (packaging/host/pvcm-libvirt-hook, installed as
# /etc/libvirt/hooks/qemu.d/pvcm) as libvirt would, with a stand-in divert tool that
# records its arguments: "started" adds the divert for the NIC the domain's metadata
# names (its tap found by MAC), "release" removes it (from the hook's state file, since
# libvirt's XML no longer names the tap then), a domain without the metadata and
# other operations are left alone, a NIC with no tap fails the hook. Then the VM on a
# live migration, with a stand-in backend (below).
#   packaging/hook-check.sh HOOK DIR      (DIR: scratch space)
set -euo pipefail
hook="$1" dir="$2"
cat >"$dir/divert-stub" <<'EOF_STUB'
#!/bin/sh
echo "$*" >>"$PVCM_HOOK_LOG"
EOF_STUB
chmod 755 "$dir/divert-stub"
export PVCM_QP1_DIVERT="$dir/divert-stub" PVCM_HOOK_LOG="$dir/hook.log" PVCM_DIVERT_STATE="$dir/state"
: >"$PVCM_HOOK_LOG"
domain() { # domain METADATA: a live domain XML with two NICs (vnet7, vnet8)
    cat <<EOF_XML
<domain type='kvm'>
  <name>vm1</name>
  <metadata>$1</metadata>
  <devices>
    <interface type='bridge'><mac address='52:54:00:99:00:11'/><source bridge='br0'/><target dev='vnet7'/></interface>
    <interface type='bridge'><mac address='52:54:00:99:00:12'/><source bridge='br1'/><target dev='vnet8'/></interface>
  </devices>
</domain>
EOF_XML
}
meta='<pvcm:divert xmlns:pvcm="urn:pvcm:divert:1" dev="pvcm-qp1"><pvcm:nic mac="52:54:00:99:00:11" addresses="10.99.0.11 fd99::11 fe80::/64"/></pvcm:divert>'
domain "$meta" | "$hook" vm1 started begin -
# On release libvirt no longer names a managed tap: the hook's state file does.
domain "$meta" | sed "s/ *<target dev='[^']*'\/>//" | "$hook" vm1 release end -
[ ! -e "$dir/state/vm1" ] || { echo "the hook left its state file behind" >&2; exit 1; }
domain "" | "$hook" vm1 started begin -
domain "$meta" | "$hook" vm1 migrate begin -
want="add vnet7 pvcm-qp1 52:54:00:99:00:11 10.99.0.11 fd99::11 fe80::/64
del vnet7 pvcm-qp1"
if [ "$(cat "$PVCM_HOOK_LOG")" != "$want" ]; then
    printf 'the divert tool was run as:\n%s\nwant:\n%s\n' "$(cat "$PVCM_HOOK_LOG")" "$want" >&2
    exit 1
fi
nomatch='<pvcm:divert xmlns:pvcm="urn:pvcm:divert:1" dev="pvcm-qp1"><pvcm:nic mac="52:54:00:99:00:99" addresses="10.99.0.11"/></pvcm:divert>'
if domain "$nomatch" | "$hook" vm1 started begin - 2>"$dir/hook.err"; then
    echo "a NIC with no tap did not fail the hook" >&2
    exit 1
fi
grep -q 'no <interface> with MAC 52:54:00:99:00:99' "$dir/hook.err"

# The VM on a live migration: "migrate" (the destination) adds the domain's <pvcm:vm>
# to the backend as incoming, with the socket of the vhost-user device's chardev, and
# passes the XML through (prints nothing); "release" removes a VM the backend reports
# departed, or awaiting when the hook added it; any other VM is left alone. A stand-in
# backend records its requests and answers `vm list` from $PVCM_STUB_VMS.
cat >"$dir/backend-stub" <<'EOF_STUB'
#!/bin/sh
shift 3 # vm --control PATH
echo "$*" >>"$PVCM_HOOK_LOG"
[ "$1" != list ] || cat "$PVCM_STUB_VMS"
EOF_STUB
chmod 755 "$dir/backend-stub"
export PVCM_BACKEND="$dir/backend-stub" PVCM_BACKEND_CONTROL="$dir/ctl" PVCM_STUB_VMS="$dir/vms.json"
export PVCM_VM_STATE="$dir/vm-state"
: >"$PVCM_HOOK_LOG"
vm_domain() { # vm_domain: a domain with <pvcm:vm> and the pvcm device in <qemu:commandline>
    cat <<'EOF_XML'
<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>vm1</name>
  <metadata><pvcm:vm xmlns:pvcm="urn:pvcm:vm:1" spec="name=v1,gid=10.0.0.7,id-range=0x80070000/16"/></metadata>
  <qemu:commandline>
    <qemu:arg value='-chardev'/>
    <qemu:arg value='socket,id=pvcm,path=/run/pvcm/v1.sock,reconnect-ms=1000'/>
    <qemu:arg value='-device'/>
    <qemu:arg value='vhost-user-device-pci,chardev=pvcm,virtio-id=63'/>
  </qemu:commandline>
</domain>
EOF_XML
}
vms() { echo "[{\"name\": \"other\", \"state\": \"departed\"}${1:+, {\"name\": \"v1\", \"state\": \"$1\"\}}]" >"$PVCM_STUB_VMS"; }
vms ""
out="$(vm_domain | "$hook" vm1 migrate begin -)"
[ -z "$out" ] || { echo "the hook changed the XML on migrate: $out" >&2; exit 1; }
vms awaiting
vm_domain | "$hook" vm1 release end - # the migration did not happen: the hook's VM goes
vm_domain | "$hook" vm1 migrate begin - # the operator's VM: left as it is
vm_domain | "$hook" vm1 release end - # ... also on release
vms departed
vm_domain | "$hook" vm1 release end - # left by migration: removed
vms detached
vm_domain | "$hook" vm1 release end - # destroyed or shut down: kept
want="list
add socket=/run/pvcm/v1.sock,name=v1,gid=10.0.0.7,id-range=0x80070000/16,incoming=yes
list
remove v1
list
list
list
remove v1
list"
if [ "$(cat "$PVCM_HOOK_LOG")" != "$want" ]; then
    printf 'the backend was asked:\n%s\nwant:\n%s\n' "$(cat "$PVCM_HOOK_LOG")" "$want" >&2
    exit 1
fi
if vm_domain | sed 's/path=[^,]*,//' | "$hook" vm1 migrate begin - 2>"$dir/hook.err"; then
    echo "a vhost-user chardev without a path did not fail the hook" >&2
    exit 1
fi
grep -q 'no vhost-user device with a socket chardev' "$dir/hook.err"
