//! The learning rate at each step.
//!
//! Steps are counted from 0; the rate at step `s` is the one the `s`-th optimizer update uses. With
//! `W = warmup_steps`, `N = steps`, peak `lr` and floor `min_lr`:
//!
//! - warm-up (every kind but inverse-sqrt): `lr * (s + 1) / W` while `s < W`, so the first update
//!   already moves (at `lr / W`) and step `W - 1` reaches `lr`;
//! - `cosine`, for `s >= W`: `min_lr + 0.5 * (1 + cos(pi * p)) * (lr - min_lr)`;
//! - `linear`, for `s >= W`: `min_lr + (1 - p) * (lr - min_lr)`;
//! - `constant`, for `s >= W`: `lr`;
//!
//! where `p = (s - W) / (N - W)`, the share of the decay done, held at 1 past the run (so both
//! decays reach `min_lr` at `s = N`, one past the last step, and stay there; with `N == W` there
//! is no step to decay over and every `s >= W` is past the run). `cosine` is the fixtures'
//! definition.
//!
//! - `inverse-sqrt`, the original Transformer's ("Attention Is All You Need", eq. 3, with the
//!   `d_model^-0.5` factor folded into `lr`): `lr * min((s + 1) / W, sqrt(W / (s + 1)))`, a
//!   linear rise to `lr` at `s + 1 = W`, then decay as `1 / sqrt(s + 1)`. `min_lr` is not used.
//!   With `W = 0` it is taken as 1: `lr / sqrt(s + 1)`.

use super::recipe::ScheduleKind;

/// A learning-rate schedule: the kind and the numbers it reads (a [`super::Recipe`]'s, through
/// [`super::Recipe::schedule`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The shape after warm-up.
    pub kind: ScheduleKind,
    /// Peak learning rate.
    pub lr: f64,
    /// The rate `cosine` and `linear` decay to.
    pub min_lr: f64,
    /// Steps of warm-up.
    pub warmup_steps: usize,
    /// Steps in the run.
    pub steps: usize,
}

impl LrSchedule {
    /// The learning rate at 0-based `step` (the module's documentation has the formulas).
    pub fn at(&self, step: usize) -> f64 {
        let (s, w) = (step as f64, self.warmup_steps as f64);
        if self.kind == ScheduleKind::InverseSqrt {
            let w = w.max(1.0);
            return self.lr * ((s + 1.0) / w).min((w / (s + 1.0)).sqrt());
        }
        if step < self.warmup_steps {
            return self.lr * (s + 1.0) / w;
        }
        let span = self.steps.saturating_sub(self.warmup_steps);
        let done = if span == 0 { 1.0 } else { ((s - w) / span as f64).min(1.0) };
        let range = self.lr - self.min_lr;
        match self.kind {
            ScheduleKind::Cosine => self.min_lr + 0.5 * (1.0 + (std::f64::consts::PI * done).cos()) * range,
            ScheduleKind::Linear => self.min_lr + (1.0 - done) * range,
            ScheduleKind::Constant | ScheduleKind::InverseSqrt => self.lr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::f64::consts::PI;

    fn schedule(kind: ScheduleKind) -> LrSchedule {
        LrSchedule { kind, lr: 0.01, min_lr: 0.001, warmup_steps: 3, steps: 16 }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-9, "{a} vs {b}");
    }

    #[test]
    fn cosine_matches_the_fixtures() {
        let s = schedule(ScheduleKind::Cosine);
        close(s.at(0), 0.0033333333);
        close(s.at(1), 0.0066666667);
        close(s.at(2), 0.01);
        close(s.at(3), 0.01);
        close(s.at(15), 0.001 + 0.5 * (1.0 + (PI * 12.0 / 13.0).cos()) * 0.009);
        close(s.at(9), 0.001 + 0.5 * (1.0 + (PI * 6.0 / 13.0).cos()) * 0.009);
        // Past the run it stays at the floor.
        close(s.at(16), 0.001);
        close(s.at(100), 0.001);
        // It never rises after warm-up.
        assert!((3..20).all(|i| s.at(i + 1) <= s.at(i)));
    }

    #[test]
    fn linear_and_constant() {
        let s = schedule(ScheduleKind::Linear);
        close(s.at(0), 0.01 / 3.0);
        close(s.at(3), 0.01);
        close(s.at(15), 0.001 + (1.0 - 12.0 / 13.0) * 0.009);
        close(s.at(16), 0.001);
        let s = schedule(ScheduleKind::Constant);
        close(s.at(1), 0.02 / 3.0);
        close(s.at(3), 0.01);
        close(s.at(15), 0.01);
    }

    #[test]
    fn inverse_sqrt_is_the_original_transformers() {
        let s = LrSchedule { warmup_steps: 4, ..schedule(ScheduleKind::InverseSqrt) };
        close(s.at(0), 0.01 * 0.25);
        close(s.at(2), 0.01 * 0.75);
        close(s.at(3), 0.01);
        close(s.at(15), 0.01 * (4.0f64 / 16.0).sqrt());
        close(s.at(99), 0.01 * 0.2);
        let no_warmup = LrSchedule { warmup_steps: 0, ..s };
        close(no_warmup.at(0), 0.01);
        close(no_warmup.at(3), 0.01 / 2.0);
    }

    #[test]
    fn no_division_by_zero_without_warmup_or_decay() {
        for kind in [ScheduleKind::Cosine, ScheduleKind::Linear, ScheduleKind::Constant, ScheduleKind::InverseSqrt] {
            let none = LrSchedule { warmup_steps: 0, ..schedule(kind) };
            close(none.at(0), 0.01);
            let all_warmup = LrSchedule { warmup_steps: 16, ..schedule(kind) };
            for step in 0..20 {
                assert!(all_warmup.at(step).is_finite() && none.at(step).is_finite(), "{kind:?} {step}");
            }
        }
        let all_warmup = LrSchedule { warmup_steps: 16, ..schedule(ScheduleKind::Cosine) };
        close(all_warmup.at(15), 0.01);
        close(all_warmup.at(16), 0.001);
        let one = LrSchedule { steps: 1, warmup_steps: 0, ..schedule(ScheduleKind::Cosine) };
        close(one.at(0), 0.01);
    }
}
