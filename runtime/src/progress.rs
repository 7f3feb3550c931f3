//! Progress of the slow steps of loading a model, for a caller that wants to show it.
//!
//! Loading a real checkpoint and building its pipelines takes seconds to minutes on a CPU
//! adapter: every tensor is read and converted, folds are evaluated on the host, every weight is
//! copied to the device and every kernel's shader is compiled. The functions that do this have
//! variants taking a [`Progress`] (`weights::load_named_with_progress`,
//! `weights::quantized_named_with_progress`, `GpuModel::with_progress`), which they tell how far
//! each [`Phase`] has come; the plain variants pass `&()`, which reports nothing. The runtime
//! draws nothing itself: the `kiln` command line turns the reports into progress bars.

/// A slow step of loading a model. Each counts units of its own (tensors, folds, kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Reading the parameters from the checkpoint and converting them to f32 (GGUF blocks
    /// dequantized, the weight map applied); one unit per parameter.
    Read,
    /// Repacking the blocks of the parameters kept quantized on the device; one unit
    /// per parameter looked at.
    Repack,
    /// Evaluating the plan's load-time folds on the host (transposed, stacked and scaled
    /// weights); one unit per fold.
    Fold,
    /// Copying the weights to the device; one unit per tensor.
    Upload,
    /// Building the compute pipelines, which compiles each kernel's shader for the device; one
    /// unit per kernel.
    Pipelines,
    /// Timing the kernels' forms on the adapter (`kiln tune`); one unit per candidate.
    Tune,
}

impl Phase {
    /// What the phase does, in a few words (`"reading weights"`), for a progress bar's label.
    pub fn describe(self) -> &'static str {
        match self {
            Phase::Read => "reading weights",
            Phase::Repack => "repacking blocks",
            Phase::Fold => "folding constants",
            Phase::Upload => "uploading weights",
            Phase::Pipelines => "compiling kernels",
            Phase::Tune => "tuning kernels",
        }
    }
}

/// Receives progress reports.
///
/// A phase with `total` units reports `done = 0` when it starts, then each unit as it completes,
/// ending with `done == total`; a phase with nothing to do reports nothing, and one that fails
/// stops reporting where it failed. Reports come from the thread that called the loading
/// function. Closures `Fn(Phase, usize, usize)` are reporters, and `()` is the one that ignores
/// everything.
pub trait Progress {
    /// `done` of the `total` units of `phase` are complete.
    fn update(&self, phase: Phase, done: usize, total: usize);
}

/// Reports nothing.
impl Progress for () {
    fn update(&self, _: Phase, _: usize, _: usize) {}
}

impl<F: Fn(Phase, usize, usize)> Progress for F {
    fn update(&self, phase: Phase, done: usize, total: usize) {
        self(phase, done, total)
    }
}

/// Counts the units of one phase, reporting the start and each completed unit.
pub(crate) struct Counter<'a> {
    progress: &'a dyn Progress,
    phase: Phase,
    done: usize,
    total: usize,
}

impl<'a> Counter<'a> {
    /// Starts `phase` with `total` units (reported only when there are some).
    pub(crate) fn start(progress: &'a dyn Progress, phase: Phase, total: usize) -> Self {
        if total > 0 {
            progress.update(phase, 0, total);
        }
        Counter { progress, phase, done: 0, total }
    }

    /// One more unit is complete.
    pub(crate) fn advance(&mut self) {
        self.done += 1;
        self.progress.update(self.phase, self.done, self.total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[test]
    fn a_counter_reports_the_start_every_unit_and_nothing_for_an_empty_phase() {
        let seen = RefCell::new(Vec::new());
        let record = |phase: Phase, done: usize, total: usize| seen.borrow_mut().push((phase, done, total));
        let mut counter = Counter::start(&record, Phase::Fold, 2);
        counter.advance();
        counter.advance();
        Counter::start(&record, Phase::Upload, 0);
        assert_eq!(*seen.borrow(), [(Phase::Fold, 0, 2), (Phase::Fold, 1, 2), (Phase::Fold, 2, 2)]);
    }
}
