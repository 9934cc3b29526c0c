//! `pvcm-guest`: the guest side of pvcm from the command line, inside a VM. The commands
//! live in the library ([`pvcm_guest::cli`]) so `pvcm-lab attach` runs them too.

fn main() -> std::process::ExitCode {
    pvcm_guest::cli::main()
}
