//! Picking the next token from a row of logits: a [`Sampler`] (greedy, temperature, top-k,
//! top-p, repetition penalty, seeded) and a [`Pick`], one step's request, answered with a
//! [`Sampled`]. This is the host's sampler, whose semantics the device's kernel shares
//! ([`kiln_compiler::back::wgsl::sample`], run by [`crate::gpu::DeviceSampler`]); it knows
//! nothing of engines or sessions.

/// Sampling settings a [`Sampler`] refuses.
#[derive(Debug, thiserror::Error)]
#[error("bad sampling settings: {name} {value} is not {want}")]
pub struct BadSettings {
    /// The setting.
    pub name: &'static str,
    /// Its value.
    pub value: f32,
    /// What it must be.
    pub want: &'static str,
}

/// How a step picks the next token ([`Session::sample`](crate::Session::sample),
/// [`Engine::step_sample`](crate::Engine::step_sample)).
pub struct Pick<'a> {
    /// The settings and the random state.
    pub sampler: &'a mut Sampler,
    /// The tokens so far (for the repetition penalty).
    pub seen: &'a [i64],
    /// Return the logits too (on wgpu, read back only then).
    pub logits: bool,
}

impl Pick<'_> {
    /// Picks on the host from the last position's logits; refuses a row holding a NaN (an
    /// overflow in the model's arithmetic: there is no distribution to sample from, and the
    /// argmax would silently be some token), as the device's sampler does.
    pub fn on_host(self, logits: Vec<f32>) -> Result<Sampled, crate::GenerateError> {
        if logits.iter().any(|v| v.is_nan()) {
            return Err(crate::GenerateError::NanLogits);
        }
        let token = self.sampler.sample(&logits, self.seen);
        Ok(Sampled { token, logits: self.logits.then_some(logits) })
    }
}

/// The token a step picked, and the last position's logits when [`Pick::logits`] asked for them.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The next token.
    pub token: i64,
    /// The logits it was picked from (before the repetition penalty).
    pub logits: Option<Vec<f32>>,
}

/// How the next token is chosen. `temperature == 0` is greedy (ties to the lowest id).
#[derive(Clone, Debug)]
pub struct Sampler {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to `top_p` (1 = all).
    pub top_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already seen by this (1 = off),
    /// as CTRL and HF transformers do.
    pub repetition_penalty: f32,
    /// Random state (SplitMix64), from the seed.
    state: u64,
}

impl Sampler {
    /// Greedy decoding.
    pub fn greedy() -> Sampler {
        Sampler { temperature: 0.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0, state: 0 }
    }

    /// A sampler with the given settings and seed.
    pub fn new(
        temperature: f32,
        top_k: usize,
        top_p: f32,
        repetition_penalty: f32,
        seed: u64,
    ) -> Result<Sampler, BadSettings> {
        let checks = [
            ("temperature", temperature, temperature.is_finite() && temperature >= 0.0, "a finite number >= 0"),
            ("top-p", top_p, top_p > 0.0 && top_p <= 1.0, "in (0, 1]"),
            (
                "repetition penalty",
                repetition_penalty,
                repetition_penalty.is_finite() && repetition_penalty > 0.0,
                "a finite number > 0",
            ),
        ];
        if let Some(&(name, value, _, want)) = checks.iter().find(|(_, _, ok, _)| !ok) {
            return Err(BadSettings { name, value, want });
        }
        Ok(Sampler { temperature, top_k, top_p, repetition_penalty, state: seed })
    }

    /// Whether it takes the argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The ids whose logits the repetition penalty changes: the `seen` ones that can index a
    /// logit, each once, in increasing order; none when the penalty is off.
    pub(crate) fn penalized(&self, seen: &[i64]) -> Vec<usize> {
        if self.repetition_penalty == 1.0 {
            return Vec::new();
        }
        let mut ids: Vec<usize> = seen.iter().filter_map(|&t| usize::try_from(t).ok()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The draw of a step: `None` when greedy, else the next uniform of the random state (one
    /// per sampled token, wherever it is sampled, so a seed gives one stream of tokens).
    pub(crate) fn draw(&mut self) -> Option<f64> {
        (!self.is_greedy()).then(|| self.uniform())
    }

    /// SplitMix64 (Steele, Lea, Flood 2014): a uniform float in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks a token from `logits`, given the tokens so far (for the repetition penalty). The
    /// device's sampler (`back::wgsl::sample`) has these semantics.
    pub fn sample(&mut self, logits: &[f32], seen: &[i64]) -> i64 {
        let mut l = logits.to_vec();
        for t in self.penalized(seen) {
            if let Some(v) = l.get_mut(t) {
                *v = if *v > 0.0 { *v / self.repetition_penalty } else { *v * self.repetition_penalty };
            }
        }
        let argmax = || {
            l.iter()
                .enumerate()
                .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) })
                .0
        };
        let Some(r) = self.draw() else { return argmax() as i64 };
        // Candidates (token, logit) by decreasing logit, cut by top-k, softmax at the temperature,
        // cut by top-p.
        let mut order: Vec<(usize, f32)> = l.iter().copied().enumerate().filter(|(_, v)| v.is_finite()).collect();
        order.sort_by(|&(a, va), &(b, vb)| vb.total_cmp(&va).then(a.cmp(&b)));
        if self.top_k > 0 {
            order.truncate(self.top_k);
        }
        let Some(&(best, max)) = order.first() else { return argmax() as i64 };
        let mut probs: Vec<f64> = order.iter().map(|&(_, v)| (((v - max) / self.temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut kept = 0;
        let mut mass = 0.0;
        for p in &probs {
            kept += 1;
            mass += p;
            if mass >= self.top_p as f64 {
                break;
            }
        }
        // The first kept candidate at which the cumulative mass passes `r` (else the last kept).
        let mut r = r * mass;
        let mut picked = best;
        for (&(i, _), p) in order.iter().zip(&probs).take(kept) {
            picked = i;
            r -= p;
            if r <= 0.0 {
                break;
            }
        }
        picked as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_refuses_a_row_holding_a_nan_and_samples_infinities() {
        let mut sampler = Sampler::new(0.0, 0, 1.0, 1.0, 0).unwrap();
        let pick = |sampler: &mut Sampler, row: Vec<f32>| Pick { sampler, seen: &[], logits: false }.on_host(row);
        let e = pick(&mut sampler, vec![1.0, f32::NAN, 3.0]).unwrap_err();
        assert!(e.to_string().contains("hold a NaN"), "{e}");
        assert_eq!(pick(&mut sampler, vec![1.0, f32::INFINITY, f32::NEG_INFINITY]).unwrap().token, 1);
    }
}
