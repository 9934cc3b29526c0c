# shellcheck shell=bash
# Shared helpers for qemu-scripts/*.sh. Source it; do not run it.
#
#   PVCM_CACHE     cache directory (default: $HOME/.cache/pvcm)
#   PVCM_DEB_SUITE Debian suite with QEMU 10 (default: bookworm-backports)

PVCM_SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck disable=SC2034 # used by the scripts that source this
PVCM_REPO_DIR="$(cd "$PVCM_SCRIPTS_DIR/.." && pwd)"
PVCM_CACHE="${PVCM_CACHE:-${HOME:-/root}/.cache/pvcm}"
PVCM_DEB_SUITE="${PVCM_DEB_SUITE:-bookworm-backports}"
# The Debian QEMU version every script here is written against.
PVCM_QEMU_VERSION="10.0.2"
PVCM_QEMU_DEB_VERSION="1:10.0.2+ds-2+deb13u1~bpo12+1"

_pvcm_prog="$(basename "${0:-pvcm}")"

log() { printf '[%s] %s\n' "$_pvcm_prog" "$*" >&2; }
warn() { printf '[%s] WARNING: %s\n' "$_pvcm_prog" "$*" >&2; }
die() {
    printf '[%s] ERROR: %s\n' "$_pvcm_prog" "$*" >&2
    exit 1
}

# parse_options SPEC... -- ARG...: the scripts' option loop. Each SPEC word is an option
# and what it does:
#
#   --name=VAR        takes a value: VAR=VALUE
#   --name=VAR[]      takes a value, appended to the array VAR
#   --name=FUNC()     takes a value: calls FUNC --name VALUE
#   --name:VAR=VALUE  a flag: VAR=VALUE
#   --name:FUNC()     a flag: calls FUNC --name
#
# The ARGs are taken in order, a value being the word after its option (whatever it
# is). -h and --help call the script's usage and exit 0. An option not in the SPEC, or
# one that takes a value last with none, is an error: it goes to the script's
# usage_error MESSAGE if it defines one, else the script dies with MESSAGE and "(see
# --help)".
parse_options() {
    local -a _po_spec=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        _po_spec+=("$1")
        shift
    done
    [ $# -gt 0 ] || die "parse_options: no -- after the option spec"
    shift
    local _po_opt _po_word _po_act _po_found
    while [ $# -gt 0 ]; do
        _po_opt="$1"
        shift
        case "$_po_opt" in
        -h | --help)
            usage
            exit 0
            ;;
        esac
        _po_found=0
        for _po_word in "${_po_spec[@]}"; do
            [ "${_po_word%%[=:]*}" = "$_po_opt" ] || continue
            _po_found=1
            _po_act="${_po_word:${#_po_opt}}"
            case "$_po_act" in
            =*)
                [ $# -gt 0 ] || _po_error "$_po_opt needs a value"
                _po_apply value "${_po_act#=}" "$_po_opt" "$1"
                shift
                ;;
            :*) _po_apply flag "${_po_act#:}" "$_po_opt" ;;
            *) die "parse_options: '$_po_word' is not an option spec" ;;
            esac
            break
        done
        [ "$_po_found" = 1 ] || _po_error "unknown option '$_po_opt'"
    done
}

# _po_apply value|flag ACTION OPTION [VALUE]: one option's ACTION (with a value: VAR,
# VAR[] or FUNC(); a flag: VAR=VALUE or FUNC()). Its locals are prefixed: the variables
# it sets are the script's (e.g. name).
_po_apply() {
    local _po_kind="$1" _po_a="$2" _po_o="$3" _po_n
    _po_n="${_po_a%%[=(\[]*}"
    [[ "$_po_n" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "parse_options: bad name in '$_po_o$_po_a'"
    case "$_po_kind:${_po_a:${#_po_n}}" in
    "value:()") "$_po_n" "$_po_o" "$4" ;;
    "value:[]") eval "$_po_n+=(\"\$4\")" ;;
    "value:") printf -v "$_po_n" '%s' "$4" ;;
    "flag:()") "$_po_n" "$_po_o" ;;
    flag:=*) printf -v "$_po_n" '%s' "${_po_a#*=}" ;;
    *) die "parse_options: '$_po_o' has no action a $_po_kind option can take ('$_po_a')" ;;
    esac
}

_po_error() {
    if declare -F usage_error >/dev/null; then
        usage_error "$1"
    fi
    die "$1 (see --help)"
}

# now_s: seconds since the epoch with a fraction (for timings).
now_s() { date +%s.%N; }
# elapsed START: seconds since START, one decimal.
elapsed() { awk -v a="$1" -v b="$(now_s)" 'BEGIN { printf "%.1f", b - a }'; }

need_root() {
    [ "$(id -u)" = 0 ] || die "$1 needs root (apt-get); run as root or install it by hand"
}

# sha256 of stdin, first 16 hex digits.
short_hash() { sha256sum | cut -c1-16; }

# apt-get install waits up to 10 minutes for the dpkg lock (other builds on the machine).

# Does any apt source list TYPE (deb|deb-src) for SUITE?
_apt_has_source() {
    local type="$1" suite="$2" f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        grep -Eq "^[[:space:]]*${type}[[:space:]]+(\[[^]]*\][[:space:]]+)?[^[:space:]]+[[:space:]]+${suite}([[:space:]]|$)" "$f" && return 0
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        # deb822: a stanza with "Types: ... TYPE ..." and "Suites: ... SUITE ...".
        awk -v t="$type" -v s="$suite" '
            BEGIN { RS = ""; FS = "\n" }
            {
                ty = 0; su = 0; en = 1
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^Types:/ && (" " substr($i, 7) " ") ~ (" " t " ")) ty = 1
                    if ($i ~ /^Suites:/ && (" " substr($i, 8) " ") ~ (" " s " ")) su = 1
                    if ($i ~ /^Enabled:[[:space:]]*no/) en = 0
                }
                if (ty && su && en) found = 1
            }
            END { exit !found }' "$f" && return 0
    done
    return 1
}

_pvcm_apt_updated=0
apt_update_once() {
    if [ "$_pvcm_apt_updated" = 0 ]; then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed"
        _pvcm_apt_updated=1
    fi
}

# Make sure deb and deb-src lines for $PVCM_DEB_SUITE exist and the lists are fresh
# enough to know Debian's QEMU $PVCM_QEMU_VERSION.
ensure_deb_suite() {
    local need_update=0 f=/etc/apt/sources.list.d/pvcm-"$PVCM_DEB_SUITE".sources
    if ! _apt_has_source deb "$PVCM_DEB_SUITE" || ! _apt_has_source deb-src "$PVCM_DEB_SUITE"; then
        need_root "adding the $PVCM_DEB_SUITE apt source"
        log "adding $f (deb + deb-src for $PVCM_DEB_SUITE)"
        cat >"$f" <<EOF
# Added by pvcm qemu-scripts: Debian's QEMU $PVCM_QEMU_VERSION (binary and source).
Types: deb deb-src
URIs: http://deb.debian.org/debian
Suites: $PVCM_DEB_SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
        need_update=1
    fi
    if [ "$need_update" = 0 ] &&
        ! apt-cache showsrc qemu 2>/dev/null | grep "^Version: .*${PVCM_QEMU_VERSION}" >/dev/null; then
        need_update=1
    fi
    if [ "$need_update" = 1 ]; then
        need_root "apt-get update"
        apt_update_once
    fi
}

# apt_install PKG[/SUITE]...: install the Debian packages that are missing.
apt_install() {
    local missing=() p name
    for p in "$@"; do
        name="${p%%/*}"
        if ! dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep 'install ok installed' >/dev/null; then
            missing+=("$p")
        fi
    done
    [ "${#missing[@]}" = 0 ] && return 0
    need_root "installing ${missing[*]}"
    log "apt-get install ${missing[*]}"
    mkdir -p "$PVCM_CACHE"
    local alog="$PVCM_CACHE/apt-install.log"
    if ! DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >"$alog" 2>&1; then
        apt_update_once
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >"$alog" 2>&1 || {
            tail -n 30 "$alog" >&2
            die "apt-get install ${missing[*]} failed (log: $alog)"
        }
    fi
}

# Path of the patched QEMU's install prefix for the current patch (see build-qemu.sh).
pvcm_qemu_key() {
    {
        echo "recipe=$(sed -n 's/^RECIPE_VERSION=//p' "$PVCM_SCRIPTS_DIR/build-qemu.sh")"
        echo "version=$PVCM_QEMU_DEB_VERSION"
        cat "$PVCM_SCRIPTS_DIR"/patches/qemu-"$PVCM_QEMU_VERSION"-*.patch
        sed -n '/^CONFIGURE_FLAGS=(/,/^)/p' "$PVCM_SCRIPTS_DIR/build-qemu.sh"
    } | short_hash
}

# debian_qemu10 WHY: prints the path of Debian's QEMU 10 (/usr/bin/qemu-system-x86_64),
# installing qemu-system-x86 from $PVCM_DEB_SUITE if it is missing or older.
debian_qemu10() {
    local qemu=/usr/bin/qemu-system-x86_64
    if ! { [ -x "$qemu" ] && "$qemu" --version 2>/dev/null | grep "version 10\." >/dev/null; }; then
        log "installing Debian's qemu-system-x86 from $PVCM_DEB_SUITE ($1)"
        ensure_deb_suite
        need_root "installing qemu-system-x86"
        mkdir -p "$PVCM_CACHE"
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
            -t "$PVCM_DEB_SUITE" qemu-system-x86 >/dev/null 2>"$PVCM_CACHE/apt-qemu.err" || {
            cat "$PVCM_CACHE/apt-qemu.err" >&2
            die "apt-get install -t $PVCM_DEB_SUITE qemu-system-x86 failed"
        }
        "$qemu" --version | grep "version 10\." >/dev/null || die "$qemu is not QEMU 10 after installing"
    fi
    echo "$qemu"
}

# Test results. Every real-VM suite (e2e.sh, interop.sh, umad.sh, netlab-smoke.sh,
# apps.sh) ends with a summary of one line per test,
#
#   PASS  NAME: what it showed
#   FAIL  NAME: what it checked: why it failed
#   SKIP  NAME: why it did not run
#
# and, when PVCM_RESULTS names a file, writes those lines to it (.ci/run reads it to say
# which tests failed before it retries a suite).

# results_report FILE...: prints the result lines of FILEs (their other lines are
# skipped) and writes them to $PVCM_RESULTS; sets results_passed, results_failed and
# results_skipped.
# shellcheck disable=SC2034 # the counts are read by the scripts
results_report() {
    local lines
    lines="$(cat "$@" 2>/dev/null | grep -E '^(PASS|FAIL|SKIP) ' || true)"
    [ -z "$lines" ] || printf '%s\n' "$lines"
    if [ -n "${PVCM_RESULTS:-}" ]; then
        if [ -n "$lines" ]; then printf '%s\n' "$lines"; fi >"$PVCM_RESULTS"
    fi
    results_passed="$(grep -c '^PASS' <<<"$lines" || true)"
    results_failed="$(grep -c '^FAIL' <<<"$lines" || true)"
    results_skipped="$(grep -c '^SKIP' <<<"$lines" || true)"
}

# results_run FILE RC WHAT [WHY]: makes a run that failed outside its tests show in
# FILE: adds "FAIL  WHAT: WHY" (default "exit RC") when RC is not 0 and FILE has no FAIL
# line, and "FAIL  WHAT: no test passed" when FILE has no PASS line either.
results_run() {
    local file="$1" rc="$2" what="$3" why="${4:-exit $2}"
    touch "$file"
    grep -q '^FAIL' "$file" && return 0
    if [ "$rc" != 0 ]; then
        echo "FAIL  $what: $why" >>"$file"
    elif ! grep -q '^PASS' "$file"; then
        echo "FAIL  $what: no test passed" >>"$file"
    fi
}

# netlab_py MODULE ARG...: python3 -m MODULE with qemu-scripts on the module path: the
# network lab (netlab run, netlab addr) and the suites' Python (netlab.smoke,
# netlab.umad_checks, netlab.interop_checks, netlab.libvirt_suite, ...).
netlab_py() {
    PYTHONPATH="$PVCM_SCRIPTS_DIR${PYTHONPATH:+:$PYTHONPATH}" python3 -m "$@"
}

# netlab_exit RC: what the exit status of `python3 -m netlab run` means.
netlab_exit() {
    case "$1" in
    124) echo "timed out (exit 124)" ;;
    125) echo "a guest did not boot (exit 125)" ;;
    *) echo "exit $1" ;;
    esac
}
