//! The progress bar of long runs (indicatif), on stderr; hidden when stderr is not a
//! terminal or with `--json`.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Whether a bar would be seen.
pub fn wanted(json: bool) -> bool {
    !json && std::io::stderr().is_terminal()
}

/// A progress bar (or nothing).
#[derive(Debug)]
pub struct Progress(ProgressBar);

impl Progress {
    /// A bar of `len` units labelled `label`, drawn only if `show`.
    pub fn new(show: bool, len: u64, label: &str) -> Progress {
        let bar = if show {
            ProgressBar::with_draw_target(Some(len.max(1)), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        if let Ok(style) = ProgressStyle::with_template(
            "{prefix:>14} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
        ) {
            bar.set_style(style);
        }
        bar.set_prefix(label.to_string());
        Progress(bar)
    }

    /// Sets the position.
    pub fn set(&self, pos: u64) {
        self.0.set_position(pos);
    }

    /// Sets the message after the bar.
    pub fn message(&self, m: &str) {
        self.0.set_message(m.to_string());
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}
