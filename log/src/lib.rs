//! `pvcm-log`: how pvcm's programs log (`pvcm-backend`, `pvcm-guestd`): `tracing`
//! events to stderr, which journald takes under systemd, at `RUST_LOG`'s level
//! (default `info`), as text lines or one JSON object per line ([`LogFormat`]).
//!
//! When stderr is the journal (systemd's `JOURNAL_STREAM` names stderr's device and
//! inode), each line starts with its syslog priority, `<3>` for an error, `<4>` a
//! warning, `<6>` information, `<7>` debug and trace: journald takes it as the entry's
//! priority (so `journalctl -p warning` shows warnings and errors) and strips it from
//! the message.

#![warn(missing_docs)]

use std::fmt;
use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

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
/// journald and log files get plain lines; lines carry journald's priority prefix when
/// stderr is the journal (see the crate documentation). A second call (a process that
/// already set a logger) changes nothing.
pub fn init(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let journal = stderr_is_journal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => {
            let colour = !journal
                && std::io::stderr().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
            let inner = tracing_subscriber::fmt::format().with_ansi(colour);
            builder
                .with_ansi(colour)
                .event_format(Prioritized { inner, journal })
                .try_init()
        }
        LogFormat::Json => {
            let inner = tracing_subscriber::fmt::format()
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false);
            builder
                .json()
                .event_format(Prioritized { inner, journal })
                .try_init()
        }
    };
}

/// journald's priority for a level (syslog's: 3 error, 4 warning, 6 info, 7 debug).
pub fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Whether `JOURNAL_STREAM` (systemd's `DEVICE:INODE` of the stream it connected to the
/// service's stdout and stderr) names the file `(dev, ino)`.
pub fn journal_stream_is(journal_stream: &str, dev: u64, ino: u64) -> bool {
    let Some((d, i)) = journal_stream.split_once(':') else {
        return false;
    };
    d.trim().parse::<u64>() == Ok(dev) && i.trim().parse::<u64>() == Ok(ino)
}

/// Whether stderr is the journal's stream (systemd's documented check).
fn stderr_is_journal() -> bool {
    let Some(js) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some(js) = js.to_str() else {
        return false;
    };
    let meta = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map(std::fs::File::from)
        .and_then(|f| f.metadata());
    meta.is_ok_and(|m| journal_stream_is(js, m.dev(), m.ino()))
}

/// An event format with journald's `<N>` priority prefix when `journal`.
struct Prioritized<F> {
    inner: F,
    journal: bool,
}

impl<S, N, F> FormatEvent<S, N> for Prioritized<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if self.journal {
            write!(writer, "<{}>", priority(event.metadata().level()))?;
        }
        self.inner.format_event(ctx, writer, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_are_syslogs() {
        assert_eq!(priority(&Level::ERROR), 3);
        assert_eq!(priority(&Level::WARN), 4);
        assert_eq!(priority(&Level::INFO), 6);
        assert_eq!(priority(&Level::DEBUG), 7);
        assert_eq!(priority(&Level::TRACE), 7);
    }

    #[test]
    fn journal_stream_names_device_and_inode() {
        assert!(journal_stream_is("8:123456", 8, 123456));
        assert!(!journal_stream_is("8:123456", 8, 123457));
        assert!(!journal_stream_is("9:123456", 8, 123456));
        assert!(!journal_stream_is("8123456", 8, 123456));
        assert!(!journal_stream_is("a:b", 8, 123456));
        assert!(!journal_stream_is("", 8, 123456));
    }
}
