//! What `kiln` tells the person at the terminal while it works, all on stderr: progress bars for
//! the slow phases of loading a model (reading weights, folding, uploading, compiling kernels:
//! the runtime's [`Phase`]s), spinners for one-shot compile stages (optimizing, lowering), and
//! informational lines such as `kiln generate`'s throughput. `--quiet` turns all of it off;
//! errors are printed by `main` either way.
//!
//! Bars go through indicatif's default draw target, which draws only when stderr is a terminal
//! (and `TERM` is not `dumb`), so pipes, files and tests see none of them. stdout is never
//! written here, and every bar is cleared when its phase ends, before anything is streamed there.

use indicatif::{ProgressBar, ProgressStyle};
use kiln_runtime::{Phase, Progress};
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The layout of a phase's bar: label, bar, units done of the total, time so far.
const BAR: &str = "{msg:>18} [{bar:32}] {pos}/{len} ({elapsed})";

/// The layout of a one-shot stage's spinner.
const SPINNER: &str = "{spinner} {msg} ({elapsed})";

/// The layout of a training run's bar: steps done of the total, the step's figures, time left.
const STEPS: &str = "step {pos}/{len} [{bar:24}] {msg} ({elapsed}, {eta} left)";

/// How often a spinner turns.
const TICK: Duration = Duration::from_millis(100);

/// Draws progress and informational lines on stderr, unless quiet. The runtime reports to it
/// through [`Progress`]; one bar is shown at a time, replaced when the phase changes.
pub struct Reporter {
    quiet: bool,
    /// The phase being shown and its bar.
    bar: RefCell<Option<(Phase, ProgressBar)>>,
    /// The phase being timed and when it started (timed quiet or not).
    timing: RefCell<Option<(Phase, Instant)>>,
    /// Time spent in each phase so far, over every model loaded.
    spent: RefCell<HashMap<Phase, Duration>>,
}

impl Reporter {
    /// Whether it shows nothing.
    pub fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// A reporter that shows everything (`quiet = false`) or nothing.
    pub fn new(quiet: bool) -> Reporter {
        Reporter { quiet, bar: RefCell::new(None), timing: RefCell::new(None), spent: RefCell::new(HashMap::new()) }
    }

    /// Seconds spent so far in `phase` (every model loaded through this reporter).
    pub fn seconds_in(&self, phase: Phase) -> f64 {
        self.spent.borrow().get(&phase).map_or(0.0, Duration::as_secs_f64)
    }

    /// Times `phase`: a report of another phase (or of this one's end) closes the one timed.
    fn time(&self, phase: Phase, done: usize, total: usize) {
        let mut timing = self.timing.borrow_mut();
        if timing.is_some_and(|(p, _)| p != phase)
            && let Some((p, start)) = timing.take()
        {
            *self.spent.borrow_mut().entry(p).or_default() += start.elapsed();
        }
        if timing.is_none() {
            *timing = Some((phase, Instant::now()));
        }
        if done >= total
            && let Some((p, start)) = timing.take()
        {
            *self.spent.borrow_mut().entry(p).or_default() += start.elapsed();
        }
    }

    /// Runs `f`, a compile stage with no steps to count (`"optimizing"`), under a spinner.
    pub fn stage<T>(&self, label: &str, f: impl FnOnce() -> T) -> T {
        if self.quiet {
            return f();
        }
        self.clear();
        let spinner = ProgressBar::new_spinner().with_style(style(SPINNER)).with_message(label.to_string());
        spinner.enable_steady_tick(TICK);
        let out = f();
        spinner.finish_and_clear();
        out
    }

    /// A bar of `total` steps, `done` of them already taken (a resumed run), with a message
    /// (the latest loss, ...) and the time left; nothing when quiet.
    pub fn steps(&self, total: u64, done: u64) -> StepBar {
        if self.quiet {
            return StepBar(None);
        }
        self.clear();
        let bar = ProgressBar::new(total).with_style(style(STEPS)).with_position(done);
        StepBar(Some(bar))
    }

    /// Prints an informational line on stderr (after clearing any bar), unless quiet.
    pub fn info(&self, line: std::fmt::Arguments) {
        if !self.quiet {
            self.clear();
            eprintln!("{line}");
        }
    }

    /// Removes the bar being shown, if any.
    fn clear(&self) {
        if let Some((_, bar)) = self.bar.borrow_mut().take() {
            bar.finish_and_clear();
        }
    }
}

impl Progress for Reporter {
    fn update(&self, phase: Phase, done: usize, total: usize) {
        self.time(phase, done, total);
        if self.quiet {
            return;
        }
        let mut shown = self.bar.borrow_mut();
        if shown.as_ref().is_none_or(|(p, _)| *p != phase) {
            if let Some((_, old)) = shown.take() {
                old.finish_and_clear();
            }
            let bar = ProgressBar::new(total as u64).with_style(style(BAR)).with_message(phase.describe());
            *shown = Some((phase, bar));
        }
        if let Some((_, bar)) = shown.as_ref() {
            if bar.length() != Some(total as u64) {
                bar.set_length(total as u64);
            }
            bar.set_position(done as u64);
        }
        if done >= total
            && let Some((_, bar)) = shown.take()
        {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Reporter {
    /// A phase cut short by an error leaves no bar behind the error message.
    fn drop(&mut self) {
        self.clear();
    }
}

/// A bar of steps ([`Reporter::steps`]).
pub struct StepBar(Option<ProgressBar>);

impl StepBar {
    /// Shows `done` steps and `message`.
    pub fn show(&self, done: u64, message: &str) {
        if let Some(bar) = &self.0 {
            bar.set_position(done);
            bar.set_message(message.to_string());
        }
    }

    /// Removes the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

/// A style from a template (indicatif's default style should a template not parse).
fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_templates_parse() {
        for template in [BAR, SPINNER] {
            assert!(ProgressStyle::with_template(template).is_ok(), "{template}");
        }
    }

    #[test]
    fn a_bar_is_shown_while_its_phase_runs_and_cleared_at_its_end() {
        let reporter = Reporter::new(false);
        reporter.update(Phase::Read, 0, 3);
        reporter.update(Phase::Read, 2, 3);
        assert_eq!(
            reporter.bar.borrow().as_ref().map(|(p, b)| (*p, b.position(), b.length())),
            Some((Phase::Read, 2, Some(3)))
        );
        // A new phase replaces the bar; the end of a phase removes it.
        reporter.update(Phase::Upload, 0, 2);
        assert_eq!(reporter.bar.borrow().as_ref().map(|(p, _)| *p), Some(Phase::Upload));
        reporter.update(Phase::Upload, 2, 2);
        assert!(reporter.bar.borrow().is_none());
        // Quiet: no bar at all.
        let quiet = Reporter::new(true);
        quiet.update(Phase::Read, 0, 3);
        assert!(quiet.bar.borrow().is_none());
    }
}
