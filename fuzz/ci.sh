#!/usr/bin/env bash
# Builds every cargo-fuzz target of fuzz/ and runs each for a fixed time budget; fails on
# any crash, panic, failed assertion, leak or timeout (libFuzzer exits non-zero and
# cargo-fuzz reports it).
#
#   FUZZ_SECS=60 bash fuzz/ci.sh            # every target, 60 s each (the default)
#   FUZZ_SECS=600 bash fuzz/ci.sh mux agent # some targets
#
# Installs what it needs if missing: the nightly toolchain (rustup, minimal profile) and
# cargo-fuzz (`cargo install --locked`, from crates.io). Build output goes to
# $CARGO_TARGET_DIR (default: fuzz/target). Each run starts from the checked-in seeds
# (fuzz/seeds/<target>/, regression inputs included) plus the local corpus
# (fuzz/corpus/<target>/, git-ignored); a crash lands in fuzz/artifacts/<target>/.
set -euo pipefail

cd "$(dirname "$0")"
FUZZ_SECS=${FUZZ_SECS:-60}
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(parse packet mux device agent ucma)
fi

# cargo-fuzz needs nightly's -Z flags. Install nightly if it is missing; where the
# toolchain server cannot be reached (a machine that reaches only the package
# registries), use the stable compiler with RUSTC_BOOTSTRAP=1, which accepts them.
tc=(+nightly)
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz/ci.sh: installing the nightly toolchain"
    if ! rustup toolchain install nightly --profile minimal; then
        echo "fuzz/ci.sh: no nightly toolchain; using stable with RUSTC_BOOTSTRAP=1"
        export RUSTC_BOOTSTRAP=1
        tc=()
    fi
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz/ci.sh: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

echo "fuzz/ci.sh: $(rustc "${tc[@]}" --version), $(cargo fuzz --version)"
for t in "${TARGETS[@]}"; do
    cargo "${tc[@]}" fuzz build "$t"
done

failed=()
for t in "${TARGETS[@]}"; do
    mkdir -p "corpus/$t"
    dirs=("corpus/$t")
    if [ -d "seeds/$t" ]; then
        dirs+=("seeds/$t")
    fi
    echo "fuzz/ci.sh: $t for ${FUZZ_SECS}s"
    log=$(mktemp)
    if cargo "${tc[@]}" fuzz run "$t" "${dirs[@]}" -- \
        -max_total_time="$FUZZ_SECS" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1; then
        grep -E '^(Done|stat::number_of_executed_units)' "$log" || true
    else
        echo "fuzz/ci.sh: $t FAILED"
        tail -n 60 "$log"
        failed+=("$t")
    fi
    rm -f "$log"
done

if [ ${#failed[@]} -ne 0 ]; then
    echo "fuzz/ci.sh: crashes in: ${failed[*]} (inputs in fuzz/artifacts/)"
    exit 1
fi
echo "fuzz/ci.sh: ${TARGETS[*]}: no crash in ${FUZZ_SECS}s each"
