//! Sampling on the device (`kiln_runtime::DeviceSampler`, the kernel of
//! `back::wgsl::sample`) against the host `Sampler`: for the same seed, the same tokens, over
//! many random logits rows and every kind of setting — greedy, temperature alone, top-k, top-p,
//! the repetition penalty, all combined — at vocabularies from one token to Gemma 3's 262144.

use crate::common;

use kiln_runtime::{DeviceSampler, Pick, Sampler};

/// A deterministic stream of floats (SplitMix64), so every row is the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Roughly normal logits of spread `scale`; with `ties`, rounded to halves, so equal logits
    /// straddle the cuts; with `masked`, a tenth of them `-inf`.
    fn row(&mut self, vocab: usize, scale: f64, ties: bool, masked: bool) -> Vec<f32> {
        (0..vocab)
            .map(|_| {
                let x = ((0..4).map(|_| self.next()).sum::<f64>() - 2.0) * scale;
                match (masked && self.next() < 0.1, ties) {
                    (true, _) => f32::NEG_INFINITY,
                    (false, true) => ((x * 2.0).round() / 2.0) as f32,
                    (false, false) => x as f32,
                }
            })
            .collect()
    }
}

/// `(temperature, top_k, top_p, repetition_penalty)` of every kind.
const SETTINGS: [(f32, usize, f32, f32); 10] = [
    (0.0, 0, 1.0, 1.0),  // greedy
    (0.0, 0, 1.0, 1.5),  // greedy, penalized
    (1.0, 0, 1.0, 1.0),  // temperature alone
    (0.3, 0, 1.0, 1.0),  // a sharp one
    (2.5, 0, 1.0, 1.0),  // a flat one
    (1.0, 1, 1.0, 1.0),  // top-k 1: the argmax
    (0.8, 40, 1.0, 1.0), // top-k
    (0.9, 0, 0.6, 1.0),  // top-p
    (1.0, 0, 1.0, 0.7),  // a penalty below 1 favours the seen tokens
    (0.7, 40, 0.9, 1.1), // everything (the chat defaults)
];

/// Draws `draws` tokens per setting from `rows` random rows of `vocab` logits on both samplers,
/// seeded alike, and returns the mismatches as text.
fn compare(device: &mut DeviceSampler, vocab: usize, rows: usize, draws: usize, seed: u64) -> Vec<String> {
    let mut rng = Rng(seed);
    let mut mismatches = Vec::new();
    for r in 0..rows {
        let (ties, masked) = (r % 3 == 1, r % 4 == 2);
        let logits = rng.row(vocab, 1.0 + r as f64, ties, masked);
        let seen: Vec<i64> = (0..vocab.min(24)).map(|_| (rng.next() * vocab as f64 * 1.2) as i64 - 2).collect();
        for (s, &(t, k, p, penalty)) in SETTINGS.iter().enumerate() {
            let seed = seed ^ (r * 31 + s) as u64;
            let mut host = Sampler::new(t, k, p, penalty, seed).unwrap();
            let mut on_device = host.clone();
            for d in 0..draws {
                let want = host.sample(&logits, &seen);
                let got =
                    device.sample(&logits, Pick { sampler: &mut on_device, seen: &seen, logits: false }).unwrap().token;
                if got != want {
                    mismatches.push(format!(
                        "vocab {vocab}, row {r} (ties {ties}, masked {masked}), settings {:?}, draw {d}: device {got}, host {want}",
                        SETTINGS[s]
                    ));
                }
            }
        }
    }
    mismatches
}

#[test]
fn device_sampler_equals_the_host_sampler() {
    let Some(gpu) = common::gpu() else { return };
    let mut device = DeviceSampler::new(gpu).unwrap();
    let mut mismatches = Vec::new();
    // One token; fewer tokens than invocations; many per invocation; a first pass in parts
    // (`sample::PARTS_FROM` and up: 12289 is three chunks and one logit, the last row of four
    // masked; SmolLM2's 49152 twelve chunks, a row of ties).
    for (vocab, rows, draws) in [(1, 2, 2), (7, 6, 4), (300, 8, 4), (4099, 6, 3), (12289, 4, 2), (49152, 2, 2)] {
        mismatches.extend(compare(&mut device, vocab, rows, draws, vocab as u64));
    }
    assert!(mismatches.is_empty(), "{} mismatches:\n{}", mismatches.len(), mismatches.join("\n"));
}

/// Gemma 3's vocabulary, the largest the kernel is asked to sample: a few draws.
#[test]
fn device_sampler_takes_a_262144_token_vocabulary() {
    let Some(gpu) = common::gpu() else { return };
    let mut device = DeviceSampler::new(gpu).unwrap();
    let mut rng = Rng(5);
    let logits = rng.row(262_144, 3.0, false, false);
    let seen = [0, 5, 262_143, 100_000];
    for settings in [(0.0, 0, 1.0, 1.3), (1.0, 0, 0.95, 1.3), (0.7, 64, 0.9, 1.1)] {
        let (t, k, p, penalty) = settings;
        let mut host = Sampler::new(t, k, p, penalty, 42).unwrap();
        let mut on_device = host.clone();
        for _ in 0..2 {
            let want = host.sample(&logits, &seen);
            let got = device.sample(&logits, Pick { sampler: &mut on_device, seen: &seen, logits: false }).unwrap();
            assert_eq!(got.token, want, "settings {settings:?}");
        }
    }
}

/// Edge rows: every logit equal (ties everywhere: the lowest ids first), every logit `-inf` but
/// one, none finite (the argmax rule: id 0), a `+inf` among finite logits, and `-0.0` against
/// `+0.0` (total order: `+0.0` first). Rows of equal logits are 601 and 41 long, not 600 and 40:
/// with 600, top-p 0.6
/// would cut exactly at 360 candidates in exact arithmetic, where f32 and f64 round apart (the
/// one kind of row where the two samplers may differ, see `back::wgsl::sample`).
#[test]
fn device_sampler_follows_the_host_on_edge_rows() {
    let Some(gpu) = common::gpu() else { return };
    let mut device = DeviceSampler::new(gpu).unwrap();
    let inf = f32::INFINITY;
    let rows: Vec<Vec<f32>> = vec![
        vec![0.5; 601],
        (0..600).map(|i| if i == 417 { 1.0 } else { -inf }).collect(),
        vec![-inf; 40],
        (0..40).map(|i| if i == 9 { inf } else { (i as f32 * 0.7).sin() }).collect(),
        (0..41).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }).collect(),
    ];
    for (r, logits) in rows.iter().enumerate() {
        for &(t, k, p, penalty) in &SETTINGS {
            let mut host = Sampler::new(t, k, p, penalty, r as u64).unwrap();
            let mut on_device = host.clone();
            for _ in 0..3 {
                let want = host.sample(logits, &[1, 2]);
                let got =
                    device.sample(logits, Pick { sampler: &mut on_device, seen: &[1, 2], logits: false }).unwrap();
                assert_eq!(got.token, want, "row {r}, settings {:?}", (t, k, p, penalty));
            }
        }
    }
}

/// The logits come back only when asked for, as they were before the penalty.
#[test]
fn device_sampler_returns_the_logits_only_when_asked() {
    let Some(gpu) = common::gpu() else { return };
    let mut device = DeviceSampler::new(gpu).unwrap();
    let logits = Rng(3).row(1000, 2.0, false, false);
    let mut sampler = Sampler::new(0.0, 0, 1.0, 2.0, 0).unwrap();
    let seen = [3, 4, 5];
    let without = device.sample(&logits, Pick { sampler: &mut sampler, seen: &seen, logits: false }).unwrap();
    assert_eq!(without.logits, None);
    let with = device.sample(&logits, Pick { sampler: &mut sampler, seen: &seen, logits: true }).unwrap();
    assert_eq!(with.logits.as_deref(), Some(&logits[..]));
    assert_eq!(with.token, without.token);
}

/// A row holding a NaN (an overflow in the model's arithmetic) has no token to sample: the device
/// refuses it under every setting, as the host path does (`Pick::on_host`), where the argmax
/// would silently have picked some token.
#[test]
fn a_row_holding_a_nan_is_refused_on_the_device() {
    let Some(gpu) = common::gpu() else { return };
    let mut device = DeviceSampler::new(gpu).unwrap();
    let mut one = Rng(5).row(1000, 2.0, false, true);
    one[617] = f32::NAN;
    // A NaN in the last chunk of a row sampled in parts, and one a penalty would not touch.
    let mut long = Rng(6).row(10_000, 2.0, false, false);
    long[9_999] = f32::NAN;
    let rows = [one, vec![f32::NAN; 40], vec![f32::NAN, f32::INFINITY, 1.0], long];
    for (r, logits) in rows.iter().enumerate() {
        for &(t, k, p, penalty) in &SETTINGS {
            let mut sampler = Sampler::new(t, k, p, penalty, 1).unwrap();
            let got = device.sample(logits, Pick { sampler: &mut sampler, seen: &[3], logits: false });
            let e = got.expect_err(&format!("row {r}, settings {:?}: sampled", (t, k, p, penalty)));
            assert!(e.to_string().contains("hold a NaN"), "{e}");
        }
    }
    // The same sampler goes on with a finite row.
    let mut sampler = Sampler::new(0.0, 0, 1.0, 1.0, 1).unwrap();
    let got = device.sample(&[0.0, 2.0, 1.0], Pick { sampler: &mut sampler, seen: &[], logits: false }).unwrap();
    assert_eq!(got.token, 1);
}

/// Top-k over a row sampled in parts makes its cuts over the candidates each part kept (see
/// `back::wgsl::sample`): rows whose first candidates all sit in one chunk, in the last, or tie
/// across every chunk (the lowest ids first), and rows with fewer finite logits than `top_k`;
/// `top_k` from 1 to `sample::KEEP` (the parts' slots) and one past it (the cuts over the row).
#[test]
fn top_k_in_parts_cuts_over_each_parts_kept_candidates() {
    use kiln_compiler::back::wgsl::sample::KEEP;
    let Some(gpu) = common::gpu() else { return };
    let mut device = DeviceSampler::new(gpu).unwrap();
    let inf = f32::INFINITY;
    let rows: Vec<Vec<f32>> = vec![
        vec![0.5; 12_289],
        (0..9_000).map(|i| if i % 300 == 7 { (i as f32 * 0.37).sin() } else { -inf }).collect(),
        (0..20_000).map(|i| i as f32 / 4000.0).collect(),
        (0..16_384)
            .map(|i| if (5_000..5_600).contains(&i) { 3.0 + (i as f32).cos() } else { (i as f32).sin() })
            .collect(),
    ];
    let k = KEEP as usize;
    for (r, logits) in rows.iter().enumerate() {
        for (t, k, p, penalty) in
            [(0.8, 1, 1.0, 1.0), (0.8, 40, 1.0, 1.2), (1.5, 40, 0.9, 1.0), (1.0, k, 1.0, 1.0), (1.0, k + 1, 0.95, 1.0)]
        {
            let mut host = Sampler::new(t, k, p, penalty, r as u64 + 7).unwrap();
            let mut on_device = host.clone();
            let seen = [4096, 9, 12_288];
            for d in 0..3 {
                let want = host.sample(logits, &seen);
                let got = device.sample(logits, Pick { sampler: &mut on_device, seen: &seen, logits: false }).unwrap();
                assert_eq!(got.token, want, "row {r}, settings {:?}, draw {d}", (t, k, p, penalty));
            }
        }
    }
}
