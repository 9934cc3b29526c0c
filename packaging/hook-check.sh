#!/usr/bin/env bash
# Runs the libvirt hook (packaging/host/pvcm-libvirt-hook, installed as
# /etc/libvirt/hooks/qemu.d/pvcm) as libvirt would, with a stand-in divert tool that
# records its arguments: "started" adds the divert for the NIC the domain's metadata
# names (its tap found by MAC), "release" removes it (from the hook's state file, since
# libvirt's XML no longer names the tap then), a domain without the metadata and
# other operations are left alone, a NIC with no tap fails the hook.
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
