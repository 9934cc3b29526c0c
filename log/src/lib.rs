//! `pvcm-log`: how pvcm's programs log (`pvcm-backend`, `pvcm-guestd`): `tracing`
//! events to stderr, which journald takes under systemd, at `RUST_LOG`'s level
//! (default `info`), as text lines or one JSON object per line ([`LogFormat`]).

#![warn(missing_docs)]

use std::io::IsTerminal;

/// The log format (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One line per event.
    #[default]
    Text,
    /// One JSON object per event and line (`timestamp`, `level`, `target`, the event's
    /// fields including `message`, and `span`, the VM's name and GID for a VM's events).
    Json,
}

/// Logs to stderr in the asked format, at `RUST_LOG`'s level (default `info`). Text
/// carries ANSI colour only when stderr is a terminal and `NO_COLOR` is unset, so
/// journald and log files get plain lines. A second call (a process that already set a
/// logger) changes nothing.
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => {
            let colour = std::io::stderr().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            builder.with_ansi(colour).try_init()
        }
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}
