//! `pvcm-backend`: hands the command line to the library.

fn main() -> std::process::ExitCode {
    pvcm_backend::run_cli(std::env::args_os().skip(1))
}
