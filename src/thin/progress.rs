//! A progress line on stderr for the long-running tools (check, dump,
//! restore), shown only when stderr is a terminal.

use std::io::IsTerminal;

pub struct Progress {
    what: &'static str,
    total: u64,
    done: u64,
    enabled: bool,
    shown: bool,
}

/// Redraw after this many units of work.
const STEP: u64 = 1 << 14;

impl Progress {
    /// Progress for `total` units of work, shown if `wanted` and stderr is a terminal.
    pub fn new(what: &'static str, total: u64, wanted: bool) -> Progress {
        Progress {
            what,
            total,
            done: 0,
            enabled: wanted && std::io::stderr().is_terminal(),
            shown: false,
        }
    }

    pub fn tick(&mut self, n: u64) {
        if !self.enabled {
            return;
        }
        let before = self.done / STEP;
        self.done += n;
        if self.done / STEP != before {
            let pct = (self.done * 100).checked_div(self.total).unwrap_or(0).min(100);
            eprint!("\r{}: {} of {} ({pct}%)", self.what, self.done, self.total);
            self.shown = true;
        }
    }
}

/// The line is ended when the progress goes away (the tool's own output follows).
impl Drop for Progress {
    fn drop(&mut self) {
        if self.shown {
            eprintln!();
        }
    }
}
