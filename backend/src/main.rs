//! `pvcm-backend`: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::Parser;
use pvcm_backend::config::{Cli, Command, Config};
use pvcm_backend::{control, daemon};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Stat(a)) => match control::stat(&a.control, a.json) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("pvcm-backend stat: {e}");
                ExitCode::FAILURE
            }
        },
        None => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .init();
            let cfg = match Config::from_args(&cli.serve) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("pvcm-backend: {e}");
                    return ExitCode::from(2);
                }
            };
            match daemon::run(cfg) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("pvcm-backend: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
