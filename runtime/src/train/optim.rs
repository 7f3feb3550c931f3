//! Optimizers, gradient clipping and gradient accumulation, on host f32 slices.
//!
//! Each optimizer does PyTorch's arithmetic in PyTorch's order, so a run can be checked against
//! `torch.optim` step by step: the scalars (bias corrections, step sizes) in f64, as Python floats
//! are, cast to f32 once per use, and the element-wise work in f32, rounding where PyTorch's
//! in-place tensor ops store. (PyTorch's vectorized CPU and GPU kernels fuse some of these
//! multiply-adds, so agreement with a PyTorch run is to the last bit or so per step, not bit for
//! bit; agreement with the formula is what the tests hold.)
//!
//! - [`AdamW`] (`torch.optim.AdamW`, amsgrad and maximize off), per element at step `t` (1-based):
//!   `p *= 1 - lr*wd` (decaying parameters only); `m = lerp(m, g, 1 - b1)`;
//!   `v = v*b2 + (1 - b2)*g*g`; `p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)`.
//! - [`Sgd`] (`torch.optim.SGD`, dampening 0, not Nesterov): the weight decay is *coupled*, added to
//!   the gradient (`g += wd*p`, PyTorch's SGD semantics, unlike AdamW's); with momentum,
//!   `buf = g` at the first step and `buf = momentum*buf + g` after; `p -= lr*buf`.
//!
//! Which parameters decay is the recipe's rule ([`Recipe::decays`]: two or more dimensions, or all
//! with `decay_1d`); frozen parameters are never given to the optimizer. A step takes one
//! [`Update`] per trainable parameter — its name, values and gradient — and must be given every
//! registered parameter exactly once: kiln's gradient graph yields a gradient for every trainable
//! parameter, so a missing one is a trainer bug, and refusing it keeps the one step count true for
//! every parameter. A refused step changes nothing.
//!
//! [`clip_grad_norm`] is `torch.nn.utils.clip_grad_norm_` (norm accumulated in f64), and
//! [`GradAccumulator`] combines micro-batches' gradients into the full batch's. The optimizers'
//! state goes to and from named tensors ([`Optimizer::state`], [`Optimizer::load_state`]) for
//! checkpoints: `adam.step` (an i64 scalar), `adam.m.<param>`, `adam.v.<param>`; `sgd.step`,
//! `sgd.momentum.<param>`. The state is the whole of what a step reads besides the parameters,
//! gradients and learning rate, so a run resumed from it continues bit for bit.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kiln_compiler::tensor::{Data, Tensor};
use rayon::prelude::*;

use crate::cpu::math::{AdamStep, adamw, sum_squares};
use kiln_compiler::semantics::{SgdStep, sgd};

/// Elements of a parameter or gradient handed to one task (a fixed size: sums over pieces are
/// the same on any number of threads).
const PIECE: usize = 1 << 15;

use super::recipe::{OptimizerKind, Recipe};

/// An optimizer step, clip or state load that cannot be done.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A gradient holds NaN or infinity, so the global norm is not finite.
    #[error("gradient norm is {norm}: the gradient of `{param}` holds {value}")]
    NonFiniteGrad {
        /// The global norm.
        norm: f64,
        /// The first parameter whose gradient is not finite.
        param: String,
        /// Its first non-finite element.
        value: f32,
    },
    /// An update for a parameter the optimizer does not hold (frozen, or never registered).
    #[error("parameter `{name}` is not in the optimizer (frozen, or not a trainable parameter)")]
    UnknownParam {
        /// The parameter.
        name: String,
    },
    /// A registered parameter without an update (or gradient) in this step.
    #[error("parameter `{name}` has no gradient in this step; every trainable parameter needs one")]
    MissingParam {
        /// The parameter.
        name: String,
    },
    /// The same parameter twice in one step.
    #[error("parameter `{name}` is given twice in one step")]
    DuplicateParam {
        /// The parameter.
        name: String,
    },
    /// Values or a gradient of the wrong size.
    #[error("parameter `{name}`: the {what} has {got} elements, expected {expected}")]
    Length {
        /// The parameter.
        name: String,
        /// `"values"` or `"gradient"`.
        what: &'static str,
        /// Elements given.
        got: usize,
        /// Elements expected.
        expected: usize,
    },
    /// A parameter or gradient tensor that is not f32, or whose shape differs from its parameter's.
    #[error("parameter `{name}`: {why}")]
    Tensor {
        /// The parameter.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// Optimizer state a checkpoint should hold but does not.
    #[error("optimizer state: `{name}` is missing from the checkpoint")]
    MissingState {
        /// The state tensor's name.
        name: String,
    },
    /// Optimizer state of the wrong type or shape.
    #[error("optimizer state: `{name}` {why}")]
    BadState {
        /// The state tensor's name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// Optimizer state for a parameter this optimizer does not hold.
    #[error(
        "optimizer state: `{name}` belongs to no trainable parameter (were the parameters or the frozen list changed?)"
    )]
    UnexpectedState {
        /// The state tensor's name.
        name: String,
    },
    /// A step on the host while the optimizer's state is held on the device (a trainer bug: the
    /// device's state is read back first).
    #[error("the optimizer's state is on the device: it must be read back before a step on the host")]
    StateElsewhere,
}

/// One parameter's part of a step: its name, its values (updated in place) and its gradient
/// (clipping scales it in place).
#[derive(Debug)]
pub struct Update<'a> {
    /// The parameter's name.
    pub name: &'a str,
    /// The parameter's values.
    pub value: &'a mut [f32],
    /// The loss's gradient with respect to it, as many elements as `value`.
    pub grad: &'a mut [f32],
    /// The factor the optimizers read `grad` with: [`clip_grad_norm`]'s scaling, applied as the
    /// update reads each element (`grad * scale`, the same f32 product a pass of its own would
    /// store) rather than in a pass of its own over every gradient. 1 unless clipped.
    pub scale: f32,
}

impl<'a> Update<'a> {
    /// An update from a parameter tensor and its gradient, which must both be f32 and of one shape.
    pub fn from_tensors(name: &'a str, value: &'a mut Tensor, grad: &'a mut Tensor) -> Result<Update<'a>, OptimError> {
        if value.shape != grad.shape {
            let why = format!("gradient shape {:?} differs from the parameter's {:?}", grad.shape, value.shape);
            return Err(OptimError::Tensor { name: name.into(), why });
        }
        let not_f32 = |what: &str| OptimError::Tensor { name: name.into(), why: format!("the {what} is not f32") };
        let Data::F32(value) = &mut value.data else { return Err(not_f32("parameter")) };
        let Data::F32(grad) = &mut grad.data else { return Err(not_f32("gradient")) };
        Ok(Update::new(name, value, grad))
    }

    /// An update of `value` by `grad`, unscaled.
    pub fn new(name: &'a str, value: &'a mut [f32], grad: &'a mut [f32]) -> Update<'a> {
        Update { name, value, grad, scale: 1.0 }
    }
}

/// Checks that `updates` name each of `expected` (name → element count) exactly once, with values
/// and gradients of the right size.
fn check_updates<'s>(
    expected: impl IntoIterator<Item = (&'s str, usize)>,
    updates: &[Update<'_>],
) -> Result<(), OptimError> {
    let mut left: BTreeMap<&str, usize> = expected.into_iter().collect();
    let mut seen = BTreeSet::new();
    for u in updates {
        let Some(expected) = left.remove(u.name) else {
            let name = u.name.to_string();
            return Err(if seen.contains(u.name) {
                OptimError::DuplicateParam { name }
            } else {
                OptimError::UnknownParam { name }
            });
        };
        seen.insert(u.name);
        for (what, got) in [("values", u.value.len()), ("gradient", u.grad.len())] {
            if got != expected {
                return Err(OptimError::Length { name: u.name.into(), what, got, expected });
            }
        }
    }
    match left.into_keys().next() {
        Some(name) => Err(OptimError::MissingParam { name: name.into() }),
        None => Ok(()),
    }
}

/// The global L2 norm of the gradients and, when `max_norm` is given and exceeded, the gradients
/// scaled down to it, as `torch.nn.utils.clip_grad_norm_`: `norm = sqrt(sum g^2)` (summed in f64),
/// `coef = max_norm / (norm + 1e-6)`, every gradient multiplied by `coef` (as f32) when
/// `coef < 1`. Returns the norm before clipping. A non-finite norm (a NaN or infinite gradient) is
/// an error naming the first such parameter, and leaves the gradients as they were.
pub fn clip_grad_norm(updates: &mut [Update<'_>], max_norm: Option<f64>) -> Result<f64, OptimError> {
    // Squares summed in f64 in pieces of a fixed size (so the sum is the same on any number of
    // threads), the pieces' sums then added in order.
    let pieces: Vec<(&[f32], f32)> = updates.iter().flat_map(|u| u.grad.chunks(PIECE).map(|p| (p, u.scale))).collect();
    // Each product in f32, as the update reads it; summed as `sum_f64` sums (eight running sums).
    let sums: Vec<f64> = pieces.par_iter().map(|&(p, scale)| sum_squares(p, scale)).collect();
    let sum: f64 = sums.iter().sum();
    let norm = sum.sqrt();
    if !norm.is_finite() {
        let first = updates.iter().find_map(|u| u.grad.iter().find(|g| !g.is_finite()).map(|&g| (u.name, g)));
        let (param, value) = first.unwrap_or(("(none)", f32::NAN));
        return Err(OptimError::NonFiniteGrad { norm, param: param.into(), value });
    }
    if let Some(max_norm) = max_norm {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            // Read by the update (see `Update::scale`).
            updates.iter_mut().for_each(|u| u.scale *= coef as f32);
        }
    }
    Ok(norm)
}

/// One parameter's AdamW moments.
#[derive(Clone, Debug, PartialEq)]
struct AdamSlot {
    shape: Vec<usize>,
    decay: bool,
    /// First moment (`exp_avg`).
    m: Vec<f32>,
    /// Second moment (`exp_avg_sq`).
    v: Vec<f32>,
}

/// AdamW, as `torch.optim.AdamW` (the module's documentation has the formulas).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    betas: [f64; 2],
    eps: f64,
    weight_decay: f64,
    /// Steps taken.
    step: u64,
    slots: BTreeMap<String, AdamSlot>,
}

impl AdamW {
    /// An AdamW with no parameters yet.
    pub fn new(betas: [f64; 2], eps: f64, weight_decay: f64) -> AdamW {
        AdamW { betas, eps, weight_decay, step: 0, slots: BTreeMap::new() }
    }

    /// Adds a parameter of `shape`, its moments zero; `decay` says whether weight decay applies.
    pub fn add_param(&mut self, name: &str, shape: &[usize], decay: bool) {
        let len = shape.iter().product();
        let slot = AdamSlot { shape: shape.to_vec(), decay, m: zeroed(len), v: zeroed(len) };
        self.slots.insert(name.into(), slot);
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The names of the parameters it updates, in order.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.slots.keys().map(String::as_str)
    }

    /// The constants of step `t` (from 1) at learning rate `lr`, for a parameter that takes no
    /// decay and an unclipped gradient, and the decay factor of those that take it (what
    /// [`AdamW::decays`] says).
    pub(crate) fn constants(&self, lr: f64, t: u64) -> (AdamStep, f32) {
        let [b1, b2] = self.betas;
        let t = t as f64;
        let step_size = lr / (1.0 - b1.powf(t));
        let bc2_sqrt = (1.0 - b2.powf(t)).sqrt();
        let decay = (1.0 - lr * self.weight_decay) as f32;
        let constants = AdamStep {
            scale: 1.0,
            decay: 1.0,
            w1: (1.0 - b1) as f32,
            b2: b2 as f32,
            w2: (1.0 - b2) as f32,
            bc2_sqrt: bc2_sqrt as f32,
            eps: self.eps as f32,
            neg_step: (-step_size) as f32,
        };
        (constants, decay)
    }

    /// Drops the moments (each parameter's keeps its shape) while a copy elsewhere is the truth:
    /// the device's ([`crate::gpu::DeviceOptimizer`]), given back by [`AdamW::load_state`] before the
    /// state is read or a step runs here (a step on released moments is refused: their sizes are
    /// not the parameters').
    pub(crate) fn release_moments(&mut self) {
        for slot in self.slots.values_mut() {
            (slot.m, slot.v) = (Vec::new(), Vec::new());
        }
    }

    /// Whether the parameter `name` takes weight decay (`None`: not registered).
    pub(crate) fn decays(&self, name: &str) -> Option<bool> {
        self.slots.get(name).map(|s| s.decay && self.weight_decay != 0.0)
    }

    /// The moments moved out as tensors named as [`AdamW::state`] names them, for a step's graph
    /// to update in place ([`kiln_compiler::train::update`]); [`AdamW::restore_state`] moves them
    /// back. Refused while the device's copy is the truth.
    fn lend_state(&mut self) -> Result<Vec<(String, Tensor)>, OptimError> {
        if self.slots.values().any(|s| s.m.len() != s.shape.iter().product::<usize>()) {
            return Err(OptimError::StateElsewhere);
        }
        let mut out = Vec::with_capacity(2 * self.slots.len());
        for (name, slot) in &mut self.slots {
            out.push((format!("adam.m.{name}"), Tensor::f32(slot.shape.clone(), std::mem::take(&mut slot.m))));
            out.push((format!("adam.v.{name}"), Tensor::f32(slot.shape.clone(), std::mem::take(&mut slot.v))));
        }
        Ok(out)
    }

    /// Moves the moments [`AdamW::lend_state`] lent back out of `from`, a step counted if
    /// `stepped`.
    fn restore_state(&mut self, from: &mut HashMap<String, Tensor>, stepped: bool) -> Result<(), OptimError> {
        for (name, slot) in &mut self.slots {
            for (key, moment) in [(format!("adam.m.{name}"), &mut slot.m), (format!("adam.v.{name}"), &mut slot.v)] {
                match from.remove(&key).map(|t| t.data) {
                    Some(Data::F32(v)) => *moment = v,
                    _ => return Err(OptimError::Tensor { name: key, why: "was not given back as f32".into() }),
                }
            }
        }
        self.step += u64::from(stepped);
        Ok(())
    }

    /// One step at learning rate `lr`: every registered parameter updated from its gradient.
    pub fn step(&mut self, lr: f64, updates: &mut [Update<'_>]) -> Result<(), OptimError> {
        check_updates(self.slots.iter().map(|(name, s)| (name.as_str(), s.m.len())), updates)?;
        self.step += 1;
        let (constants, decay) = self.constants(lr, self.step);
        // Every parameter's pieces in one parallel pass (rather than a pass per parameter), each
        // piece with its parameter's clipping factor and decay.
        type Piece<'p> = (AdamStep, &'p mut [f32], &'p [f32], &'p mut [f32], &'p mut [f32]);
        let mut slots: HashMap<&str, &mut AdamSlot> = self.slots.iter_mut().map(|(n, s)| (n.as_str(), s)).collect();
        let mut pieces: Vec<Piece<'_>> = Vec::new();
        for u in updates.iter_mut() {
            let Some(slot) = slots.remove(u.name) else {
                return Err(OptimError::UnknownParam { name: u.name.into() });
            };
            let decay = if slot.decay && self.weight_decay != 0.0 { decay } else { 1.0 };
            let c = AdamStep { scale: u.scale, decay, ..constants };
            let ms = slot.m.chunks_mut(PIECE).zip(slot.v.chunks_mut(PIECE));
            for ((p, g), (m, v)) in u.value.chunks_mut(PIECE).zip(u.grad.chunks(PIECE)).zip(ms) {
                pieces.push((c, p, g, m, v));
            }
        }
        // Element by element (the pieces split over the threads change nothing).
        pieces.into_par_iter().for_each(|(c, p, g, m, v)| adamw(c, p, g, m, v));
        Ok(())
    }

    /// The state as named tensors: `adam.step`, `adam.m.<param>`, `adam.v.<param>`.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![(ADAM_STEP.to_string(), Tensor::i64(vec![], vec![self.step as i64]))];
        for (name, slot) in &self.slots {
            out.push((format!("adam.m.{name}"), Tensor::f32(slot.shape.clone(), slot.m.clone())));
            out.push((format!("adam.v.{name}"), Tensor::f32(slot.shape.clone(), slot.v.clone())));
        }
        out
    }

    /// Restores the state [`AdamW::state`] wrote, for the same parameters. Every state tensor
    /// (`adam.*`) must belong to a registered parameter, and every registered parameter must have
    /// its state; nothing changes unless all of it loads.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> Result<(), OptimError> {
        let step = read_step(tensors, ADAM_STEP)?;
        let mut slots = self.slots.clone();
        for (name, slot) in &mut slots {
            slot.m = read_moment(tensors, &format!("adam.m.{name}"), &slot.shape)?;
            slot.v = read_moment(tensors, &format!("adam.v.{name}"), &slot.shape)?;
        }
        let belongs = |key: &str| {
            key == ADAM_STEP
                || [key.strip_prefix("adam.m."), key.strip_prefix("adam.v.")]
                    .into_iter()
                    .flatten()
                    .any(|param| slots.contains_key(param))
        };
        if let Some(key) = tensors.keys().filter(|k| k.starts_with("adam.")).find(|k| !belongs(k)) {
            return Err(OptimError::UnexpectedState { name: key.clone() });
        }
        self.step = step;
        self.slots = slots;
        Ok(())
    }
}

const ADAM_STEP: &str = "adam.step";
const SGD_STEP: &str = "sgd.step";

/// `len` zeros, written rather than allocated zeroed: a zeroed allocation of this size is fresh
/// pages the system maps lazily to its shared zero page, and the update's first read-then-write
/// of each then faults twice and flushes every core's TLB (2.4 s of GPT-2 small's first step).
fn zeroed(len: usize) -> Vec<f32> {
    // (`black_box`: a fill the compiler could see is zero it may turn back into a zeroed
    // allocation.)
    let mut v = Vec::with_capacity(len);
    v.resize(len, std::hint::black_box(0.0));
    v
}

/// The step count stored as `key` (an i64 scalar).
fn read_step(tensors: &HashMap<String, Tensor>, key: &str) -> Result<u64, OptimError> {
    let t = tensors.get(key).ok_or_else(|| OptimError::MissingState { name: key.into() })?;
    let bad = |why: String| OptimError::BadState { name: key.into(), why };
    match (t.as_i64(), t.len()) {
        (Some(&[n]), 1) => u64::try_from(n).map_err(|_| bad(format!("is {n}, not a step count"))),
        _ => Err(bad(format!("must be one i64, is {:?} of shape {:?}", t.dtype(), t.shape))),
    }
}

/// The f32 tensor stored as `key`, which must have `shape`.
fn read_moment(tensors: &HashMap<String, Tensor>, key: &str, shape: &[usize]) -> Result<Vec<f32>, OptimError> {
    let t = tensors.get(key).ok_or_else(|| OptimError::MissingState { name: key.into() })?;
    match t.as_f32() {
        Some(data) if t.shape == shape => Ok(data.to_vec()),
        _ => Err(OptimError::BadState {
            name: key.into(),
            why: format!("is {:?} of shape {:?}, expected f32 of shape {shape:?}", t.dtype(), t.shape),
        }),
    }
}

/// One parameter's SGD state.
#[derive(Clone, Debug, PartialEq)]
struct SgdSlot {
    shape: Vec<usize>,
    decay: bool,
    /// The momentum buffer, from the first step on (and only with momentum).
    buf: Option<Vec<f32>>,
}

/// SGD with momentum, as `torch.optim.SGD` with dampening 0 and without Nesterov (the module's
/// documentation has the formulas; the weight decay is coupled, added to the gradient).
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    momentum: f64,
    weight_decay: f64,
    step: u64,
    slots: BTreeMap<String, SgdSlot>,
    /// Whether the momentum buffers were dropped while the device's are the truth
    /// ([`Sgd::release_buffers`]); a step is refused until [`Sgd::load_state`] gives them back.
    released: bool,
}

impl Sgd {
    /// An SGD with no parameters yet; `momentum` 0 is plain SGD.
    pub fn new(momentum: f64, weight_decay: f64) -> Sgd {
        Sgd { momentum, weight_decay, step: 0, slots: BTreeMap::new(), released: false }
    }

    /// The momentum (0: plain SGD) and the weight decay.
    pub fn settings(&self) -> (f64, f64) {
        (self.momentum, self.weight_decay)
    }

    /// Whether the parameter `name` takes weight decay (`None`: not registered).
    pub(crate) fn decays(&self, name: &str) -> Option<bool> {
        self.slots.get(name).map(|s| s.decay && self.weight_decay != 0.0)
    }

    /// Drops the momentum buffers while a copy elsewhere is the truth (the device's,
    /// [`crate::gpu::DeviceOptimizer`]), given back by [`Sgd::load_state`] before the state is
    /// read or a step runs here (a step before that is refused).
    pub(crate) fn release_buffers(&mut self) {
        for slot in self.slots.values_mut() {
            slot.buf = None;
        }
        self.released = true;
    }

    /// Adds a parameter of `shape`; `decay` says whether weight decay applies.
    pub fn add_param(&mut self, name: &str, shape: &[usize], decay: bool) {
        self.slots.insert(name.into(), SgdSlot { shape: shape.to_vec(), decay, buf: None });
    }

    /// The momentum buffers moved out as tensors named as [`Sgd::state`] names them (zeros before
    /// the first step, which sets them), for a step's graph to update in place; none without
    /// momentum. [`Sgd::restore_state`] moves them back. Refused while the device's are the truth.
    fn lend_state(&mut self) -> Result<Vec<(String, Tensor)>, OptimError> {
        if self.released {
            return Err(OptimError::StateElsewhere);
        }
        if self.momentum == 0.0 {
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(self.slots.len());
        for (name, slot) in &mut self.slots {
            let buf = slot.buf.take().unwrap_or_else(|| zeroed(slot.shape.iter().product()));
            out.push((format!("sgd.momentum.{name}"), Tensor::f32(slot.shape.clone(), buf)));
        }
        Ok(out)
    }

    /// Moves the buffers [`Sgd::lend_state`] lent back out of `from`, a step counted if
    /// `stepped` (a first step not taken leaves no buffer).
    fn restore_state(&mut self, from: &mut HashMap<String, Tensor>, stepped: bool) -> Result<(), OptimError> {
        if self.momentum == 0.0 {
            self.step += u64::from(stepped);
            return Ok(());
        }
        let keep = stepped || self.step > 0;
        for (name, slot) in &mut self.slots {
            let key = format!("sgd.momentum.{name}");
            match from.remove(&key).map(|t| t.data) {
                Some(Data::F32(v)) => slot.buf = keep.then_some(v),
                _ => return Err(OptimError::Tensor { name: key, why: "was not given back as f32".into() }),
            }
        }
        self.step += u64::from(stepped);
        Ok(())
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The names of the parameters it updates, in order.
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.slots.keys().map(String::as_str)
    }

    /// One step at learning rate `lr`: every registered parameter updated from its gradient. The
    /// gradients are left as given (the decay term is added to a copy).
    pub fn step(&mut self, lr: f64, updates: &mut [Update<'_>]) -> Result<(), OptimError> {
        if self.released {
            return Err(OptimError::StateElsewhere);
        }
        check_updates(self.slots.iter().map(|(name, s)| (name.as_str(), s.shape.iter().product())), updates)?;
        self.step += 1;
        let momentum = (self.momentum != 0.0).then_some(self.momentum as f32);
        for u in updates.iter_mut() {
            let Some(slot) = self.slots.get_mut(u.name) else {
                return Err(OptimError::UnknownParam { name: u.name.into() });
            };
            // Each element as `semantics::sgd` computes it (what the step's graph runs too).
            let c = SgdStep {
                scale: u.scale,
                weight_decay: (slot.decay && self.weight_decay != 0.0).then_some(self.weight_decay as f32),
                momentum,
                first: slot.buf.is_none(),
                neg_lr: (-lr) as f32,
            };
            match momentum {
                Some(_) => {
                    let buf = slot.buf.get_or_insert_with(|| zeroed(u.value.len()));
                    for ((p, &g), b) in u.value.iter_mut().zip(u.grad.iter()).zip(buf.iter_mut()) {
                        (*p, *b) = sgd(c, *p, g, *b);
                    }
                }
                None => u.value.iter_mut().zip(u.grad.iter()).for_each(|(p, &g)| *p = sgd(c, *p, g, 0.0).0),
            }
        }
        Ok(())
    }

    /// The state as named tensors: `sgd.step`, and `sgd.momentum.<param>` once buffers exist.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![(SGD_STEP.to_string(), Tensor::i64(vec![], vec![self.step as i64]))];
        for (name, slot) in &self.slots {
            if let Some(buf) = &slot.buf {
                out.push((format!("sgd.momentum.{name}"), Tensor::f32(slot.shape.clone(), buf.clone())));
            }
        }
        out
    }

    /// Restores the state [`Sgd::state`] wrote, for the same parameters (buffers are required once
    /// a step with momentum has been taken); nothing changes unless all of it loads.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> Result<(), OptimError> {
        let step = read_step(tensors, SGD_STEP)?;
        let mut slots = self.slots.clone();
        for (name, slot) in &mut slots {
            let key = format!("sgd.momentum.{name}");
            let needed = step > 0 && self.momentum != 0.0;
            slot.buf = if needed || tensors.contains_key(&key) {
                Some(read_moment(tensors, &key, &slot.shape)?)
            } else {
                None
            };
        }
        let belongs =
            |key: &str| key == SGD_STEP || key.strip_prefix("sgd.momentum.").is_some_and(|p| slots.contains_key(p));
        if let Some(key) = tensors.keys().filter(|k| k.starts_with("sgd.")).find(|k| !belongs(k)) {
            return Err(OptimError::UnexpectedState { name: key.clone() });
        }
        self.step = step;
        self.slots = slots;
        self.released = false;
        Ok(())
    }
}

/// The optimizer a recipe names, over the parameters it trains.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// AdamW.
    AdamW(AdamW),
    /// SGD with momentum.
    Sgd(Sgd),
}

impl Optimizer {
    /// The recipe's optimizer over `params` (name and shape of each of the model's parameters):
    /// the frozen ones left out, weight decay where [`Recipe::decays`] says.
    pub fn from_recipe<'a>(recipe: &Recipe, params: impl IntoIterator<Item = (&'a str, &'a [usize])>) -> Optimizer {
        let trainable = params.into_iter().filter(|(name, _)| !recipe.is_frozen(name));
        match recipe.optimizer {
            OptimizerKind::AdamW => {
                let mut adam = AdamW::new(recipe.betas, recipe.eps, recipe.weight_decay);
                trainable.for_each(|(name, shape)| adam.add_param(name, shape, recipe.decays(shape)));
                Optimizer::AdamW(adam)
            }
            OptimizerKind::Sgd => {
                let mut sgd = Sgd::new(recipe.momentum, recipe.weight_decay);
                trainable.for_each(|(name, shape)| sgd.add_param(name, shape, recipe.decays(shape)));
                Optimizer::Sgd(sgd)
            }
        }
    }

    /// One step at learning rate `lr` (typically [`Recipe::lr_at`] of the step about to be
    /// taken, [`Optimizer::step_count`]): every trainable parameter updated from its gradient.
    pub fn step(&mut self, lr: f64, updates: &mut [Update<'_>]) -> Result<(), OptimError> {
        match self {
            Optimizer::AdamW(o) => o.step(lr, updates),
            Optimizer::Sgd(o) => o.step(lr, updates),
        }
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        match self {
            Optimizer::AdamW(o) => o.step_count(),
            Optimizer::Sgd(o) => o.step_count(),
        }
    }

    /// The names of the parameters it trains, in order.
    pub fn params(&self) -> Vec<&str> {
        match self {
            Optimizer::AdamW(o) => o.params().collect(),
            Optimizer::Sgd(o) => o.params().collect(),
        }
    }

    /// The state as named tensors, for a checkpoint (the module's documentation lists the names).
    pub fn state(&self) -> Vec<(String, Tensor)> {
        match self {
            Optimizer::AdamW(o) => o.state(),
            Optimizer::Sgd(o) => o.state(),
        }
    }

    /// Restores the state [`Optimizer::state`] wrote (other tensors in `tensors`, such as the
    /// parameters themselves, are ignored).
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> Result<(), OptimError> {
        match self {
            Optimizer::AdamW(o) => o.load_state(tensors),
            Optimizer::Sgd(o) => o.load_state(tensors),
        }
    }

    /// Whether the parameter `name` takes weight decay, and its shape (`None`: not registered).
    pub(crate) fn param(&self, name: &str) -> Option<(bool, &[usize])> {
        match self {
            Optimizer::AdamW(o) => Some((o.decays(name)?, o.slots.get(name)?.shape.as_slice())),
            Optimizer::Sgd(o) => Some((o.decays(name)?, o.slots.get(name)?.shape.as_slice())),
        }
    }

    /// The state's tensors moved out, named as [`Optimizer::state`] names them (the step count
    /// apart), for a step's graph that updates them in place ([`kiln_compiler::train::update`]);
    /// [`Optimizer::restore_state`] moves them back.
    pub(crate) fn lend_state(&mut self) -> Result<Vec<(String, Tensor)>, OptimError> {
        match self {
            Optimizer::AdamW(o) => o.lend_state(),
            Optimizer::Sgd(o) => o.lend_state(),
        }
    }

    /// Moves the state [`Optimizer::lend_state`] lent back out of `from`, counting a step if
    /// `stepped` (the graph's update was taken).
    pub(crate) fn restore_state(
        &mut self,
        from: &mut HashMap<String, Tensor>,
        stepped: bool,
    ) -> Result<(), OptimError> {
        match self {
            Optimizer::AdamW(o) => o.restore_state(from, stepped),
            Optimizer::Sgd(o) => o.restore_state(from, stepped),
        }
    }

    /// The name its state stores the step count under (`adam.step`, `sgd.step`).
    pub(crate) fn step_key(&self) -> &'static str {
        match self {
            Optimizer::AdamW(_) => ADAM_STEP,
            Optimizer::Sgd(_) => SGD_STEP,
        }
    }

    /// Drops the state's tensors while the device's copy is the truth
    /// ([`crate::gpu::DeviceOptimizer`]); [`Optimizer::load_state`] gives them back.
    pub(crate) fn release_state(&mut self) {
        match self {
            Optimizer::AdamW(o) => o.release_moments(),
            Optimizer::Sgd(o) => o.release_buffers(),
        }
    }
}

/// Gradients of micro-batches combined into the gradient of the whole batch.
///
/// Each micro-batch's loss is the mean over its own counted label positions (those not ignored),
/// so its gradient is that mean's. The batch's loss is the mean over all counted positions, whose
/// gradient is the micro-batches' gradients weighted by their counts:
/// `g = sum_i n_i g_i / sum_i n_i`. A plain average of the micro-batches would over-weight those
/// with few counted positions. The weighted mean is kept as a running mean (after micro-batch `i`:
/// `mean += n_i / (n_1 + ... + n_i) * (g_i - mean)`, in f32), so no sum is held in a wider type, the
/// total need not be known in advance, and one micro-batch gives its gradient unchanged, bit for
/// bit. A micro-batch with no counted position has no loss and is skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GradAccumulator {
    mean: BTreeMap<String, Vec<f32>>,
    counted: u64,
}

impl GradAccumulator {
    /// An empty accumulator.
    pub fn new() -> GradAccumulator {
        GradAccumulator::default()
    }

    /// Adds a micro-batch's gradients (name and gradient of each trainable parameter), whose loss
    /// was the mean over `counted` label positions. Every micro-batch must name the same
    /// parameters with the same sizes; a refused micro-batch changes nothing.
    pub fn add<'a>(
        &mut self,
        counted: usize,
        grads: impl IntoIterator<Item = (&'a str, &'a [f32])>,
    ) -> Result<(), OptimError> {
        if counted == 0 {
            return Ok(());
        }
        let grads: Vec<(&str, &[f32])> = grads.into_iter().collect();
        if self.counted == 0 {
            let mut mean = BTreeMap::new();
            for (name, g) in grads {
                if mean.insert(name.to_string(), g.to_vec()).is_some() {
                    return Err(OptimError::DuplicateParam { name: name.into() });
                }
            }
            self.mean = mean;
        } else {
            let mut left: BTreeMap<&str, usize> = self.mean.iter().map(|(k, v)| (k.as_str(), v.len())).collect();
            for &(name, g) in &grads {
                let Some(expected) = left.remove(name) else {
                    let name = name.to_string();
                    return Err(if self.mean.contains_key(&name) {
                        OptimError::DuplicateParam { name }
                    } else {
                        OptimError::UnknownParam { name }
                    });
                };
                if g.len() != expected {
                    return Err(OptimError::Length { name: name.into(), what: "gradient", got: g.len(), expected });
                }
            }
            if let Some(name) = left.into_keys().next() {
                return Err(OptimError::MissingParam { name: name.into() });
            }
            let weight = (counted as f64 / (self.counted + counted as u64) as f64) as f32;
            for (name, g) in grads {
                if let Some(mean) = self.mean.get_mut(name) {
                    mean.iter_mut().zip(g).for_each(|(m, &g)| *m += weight * (g - *m));
                }
            }
        }
        self.counted += counted as u64;
        Ok(())
    }

    /// Counted label positions over all micro-batches added (the batch's loss is the mean over
    /// these; 0 means nothing was added).
    pub fn counted(&self) -> u64 {
        self.counted
    }

    /// The batch's gradients, by parameter name (empty when nothing was counted).
    pub fn finish(self) -> BTreeMap<String, Vec<f32>> {
        self.mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::recipe::{Format, RecipeFile};

    const FIXTURE: &str = r#"{"steps": 16, "batch": 4, "seq": 32, "lr": 0.005, "min_lr": 0.001, "warmup_steps": 3, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1, "clip": 1.0, "frozen": ["model.embed_tokens.weight"]}"#;

    fn recipe() -> Recipe {
        RecipeFile::parse(FIXTURE, Format::Json, "train.json").unwrap().resolve().unwrap()
    }

    /// A small model: a frozen embedding, a matrix (decays) and a norm scale (does not).
    fn params() -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
        vec![
            ("model.embed_tokens.weight", vec![2, 2], vec![0.5, -0.5, 0.25, 1.0]),
            ("model.layers.0.w", vec![2, 3], vec![1.5, -1.75, 1.625, -1.9, 1.55, 1.8]),
            ("model.norm.weight", vec![3], vec![1.6, 1.7, -1.85]),
        ]
    }

    /// A deterministic gradient for step `t`, element `i`, of varied sign and size.
    fn grad(t: usize, i: usize) -> f32 {
        let x = (t * 7 + i * 3) as f32;
        (x * 0.37).sin() * (1.0 + i as f32 * 0.5) * if t == 1 { 1e-3 } else { 1.0 }
    }

    struct Model {
        names: Vec<&'static str>,
        values: Vec<Vec<f32>>,
        shapes: Vec<Vec<usize>>,
    }

    impl Model {
        fn new() -> Model {
            let p = params();
            Model {
                names: p.iter().map(|p| p.0).collect(),
                shapes: p.iter().map(|p| p.1.clone()).collect(),
                values: p.into_iter().map(|p| p.2).collect(),
            }
        }

        fn optimizer(&self, recipe: &Recipe) -> Optimizer {
            Optimizer::from_recipe(recipe, self.names.iter().copied().zip(self.shapes.iter().map(Vec::as_slice)))
        }

        /// One step of `opt` with `grad(t, ·)`, frozen parameters left out, clipped as `clip`.
        fn step(&mut self, opt: &mut Optimizer, lr: f64, t: usize, clip: Option<f64>) -> f64 {
            let trainable = opt.params().into_iter().map(String::from).collect::<Vec<_>>();
            let mut grads: Vec<Vec<f32>> =
                self.values.iter().map(|v| (0..v.len()).map(|i| grad(t, i)).collect()).collect();
            let mut updates: Vec<Update> = self
                .names
                .iter()
                .zip(self.values.iter_mut().zip(grads.iter_mut()))
                .filter(|(name, _)| trainable.iter().any(|t| t == *name))
                .map(|(name, (value, grad))| Update { name, value, grad, scale: 1.0 })
                .collect();
            let norm = clip_grad_norm(&mut updates, clip).unwrap();
            opt.step(lr, &mut updates).unwrap();
            norm
        }
    }

    fn rel_close(got: f32, want: f64, tol: f64) {
        let err = (f64::from(got) - want).abs() / want.abs().max(1e-30);
        assert!(err <= tol, "{got} vs {want}: relative error {err:e}");
    }

    /// AdamW against PyTorch's formula evaluated in f64, with PyTorch's roundings to f32: each
    /// scalar (computed in f64) where a kernel takes it, and each tensor where an in-place op
    /// stores it (the parameter after the decay and after the update, the moments after each
    /// update); the arithmetic between is f64, so the order of operations is the reference's own.
    #[test]
    fn adamw_matches_the_torch_formula() {
        let r = recipe();
        let mut model = Model::new();
        let mut opt = model.optimizer(&r);
        assert_eq!(opt.params(), ["model.layers.0.w", "model.norm.weight"]);
        let (b1, b2, eps, wd) = (0.9f64, 0.95f64, 1e-8f64, 0.1f64);
        let round = |x: f64| f64::from(x as f32);
        // Per parameter: whether it decays, and each element's [p, m, v].
        let mut reference: Vec<(bool, Vec<[f64; 3]>)> = params()
            .into_iter()
            .skip(1)
            .map(|(_, shape, p)| (shape.len() >= 2, p.into_iter().map(|p| [f64::from(p), 0.0, 0.0]).collect()))
            .collect();
        for t in 1..=3 {
            let lr = r.lr_at(t - 1);
            model.step(&mut opt, lr, t, None);
            let bc1 = 1.0 - b1.powi(t as i32);
            let bc2 = 1.0 - b2.powi(t as i32);
            for (decays, elements) in &mut reference {
                for (i, [p, m, v]) in elements.iter_mut().enumerate() {
                    let g = f64::from(grad(t, i));
                    if *decays {
                        *p = round(*p * round(1.0 - lr * wd));
                    }
                    *m = round(*m + round(1.0 - b1) * (g - *m));
                    *v = round(round(*v * round(b2)) + round(1.0 - b2) * g * g);
                    let denom = v.sqrt() / round(bc2.sqrt()) + round(eps);
                    *p = round(*p - round(lr / bc1) * *m / denom);
                }
            }
            for ((_, elements), got) in reference.iter().zip(&model.values[1..]) {
                assert_eq!(elements.len(), got.len());
                for ([want, ..], &got) in elements.iter().zip(got) {
                    rel_close(got, *want, 1e-7);
                }
            }
        }
        // The frozen embedding did not move.
        assert_eq!(model.values[0], params()[0].2);
        assert_eq!(opt.step_count(), 3);
    }

    /// With a zero gradient only the decay moves a parameter, and only a decaying one.
    #[test]
    fn adamw_decays_matrices_not_vectors_unless_asked() {
        for decay_1d in [false, true] {
            let mut adam = AdamW::new([0.9, 0.999], 1e-8, 0.5);
            let r = Recipe { decay_1d, ..recipe() };
            adam.add_param("w", &[2, 1], r.decays(&[2, 1]));
            adam.add_param("b", &[2], r.decays(&[2]));
            let (mut w, mut b, mut gw, mut gb) =
                (vec![1.0f32, 2.0], vec![1.0f32, 2.0], vec![0.0f32; 2], vec![0.0f32; 2]);
            let mut updates = [
                Update { name: "w", value: &mut w, grad: &mut gw, scale: 1.0 },
                Update { name: "b", value: &mut b, grad: &mut gb, scale: 1.0 },
            ];
            adam.step(0.1, &mut updates).unwrap();
            assert_eq!(w, [0.95, 1.9]);
            assert_eq!(b, if decay_1d { [0.95, 1.9] } else { [1.0, 2.0] });
        }
    }

    /// SGD with momentum and coupled weight decay against the torch formula in f64.
    #[test]
    fn sgd_matches_the_torch_formula() {
        let r = Recipe { optimizer: OptimizerKind::Sgd, momentum: 0.9, weight_decay: 0.01, ..recipe() };
        let mut model = Model::new();
        let mut opt = model.optimizer(&r);
        let round = |x: f64| f64::from(x as f32);
        let mut p: Vec<f64> = params()[1].2.iter().map(|&x| f64::from(x)).collect();
        let mut buf = vec![0.0f64; p.len()];
        for t in 1..=3 {
            let lr = 0.05 * t as f64;
            model.step(&mut opt, lr, t, None);
            for i in 0..p.len() {
                let g = round(f64::from(grad(t, i)) + 0.01 * p[i]);
                buf[i] = if t == 1 { g } else { round(0.9 * buf[i] + g) };
                p[i] = round(p[i] - lr * buf[i]);
            }
            for (&got, &want) in model.values[1].iter().zip(&p) {
                rel_close(got, want, 1e-6);
            }
        }
        let plain = Recipe { optimizer: OptimizerKind::Sgd, ..recipe() };
        let mut sgd = Sgd::new(plain.momentum, 0.0);
        sgd.add_param("x", &[2], false);
        let (mut x, mut g) = (vec![1.0f32, -1.0], vec![0.5f32, 0.25]);
        sgd.step(0.5, &mut [Update { name: "x", value: &mut x, grad: &mut g, scale: 1.0 }]).unwrap();
        assert_eq!(x, [0.75, -1.125]);
        assert_eq!(sgd.state().len(), 1, "no buffers without momentum");
        // While the device holds the state, a step here is refused until it is given back.
        let state: HashMap<String, Tensor> = sgd.state().into_iter().collect();
        sgd.release_buffers();
        let refused = sgd.step(0.5, &mut [Update { name: "x", value: &mut x, grad: &mut g, scale: 1.0 }]);
        assert!(matches!(refused, Err(OptimError::StateElsewhere)), "{refused:?}");
        assert_eq!(x, [0.75, -1.125], "a refused step changes nothing");
        sgd.load_state(&state).unwrap();
        sgd.step(0.5, &mut [Update { name: "x", value: &mut x, grad: &mut g, scale: 1.0 }]).unwrap();
        assert_eq!(x, [0.5, -1.25]);
    }

    #[test]
    fn clipping_scales_to_the_global_norm() {
        let (mut a, mut b) = (vec![0.0f32; 2], vec![0.0f32; 1]);
        let fresh = || (vec![3.0f32, 4.0], vec![12.0f32]);
        for (clip, scaled) in [(None, false), (Some(20.0), false), (Some(13.5), false), (Some(1.0), true)] {
            let (mut ga, mut gb) = fresh();
            let mut updates = [
                Update { name: "a", value: &mut a, grad: &mut ga, scale: 1.0 },
                Update { name: "b", value: &mut b, grad: &mut gb, scale: 1.0 },
            ];
            let norm = clip_grad_norm(&mut updates, clip).unwrap();
            assert_eq!(norm, 13.0);
            let coef = if scaled { (1.0 / (13.0 + 1e-6)) as f32 } else { 1.0 };
            // The gradients as the update reads them: each times the scale.
            let read: Vec<Vec<f32>> = updates.iter().map(|u| u.grad.iter().map(|g| g * u.scale).collect()).collect();
            assert_eq!(read, [vec![3.0 * coef, 4.0 * coef], vec![12.0 * coef]], "{clip:?}");
            assert_eq!((ga, gb), fresh(), "the gradients themselves are left as they are");
        }
        // After clipping the norm is the maximum (to f32 precision).
        let (mut ga, mut gb) = fresh();
        let mut updates = [
            Update { name: "a", value: &mut a, grad: &mut ga, scale: 1.0 },
            Update { name: "b", value: &mut b, grad: &mut gb, scale: 1.0 },
        ];
        clip_grad_norm(&mut updates, Some(2.0)).unwrap();
        assert!((clip_grad_norm(&mut updates, None).unwrap() - 2.0).abs() < 1e-6);
        // A non-finite gradient is reported by parameter and leaves the gradients alone.
        for bad in [f32::NAN, f32::INFINITY] {
            let (mut ga, mut gb) = (vec![3.0f32, 4.0], vec![bad]);
            let mut updates = [
                Update { name: "a", value: &mut a, grad: &mut ga, scale: 1.0 },
                Update { name: "b", value: &mut b, grad: &mut gb, scale: 1.0 },
            ];
            let err = clip_grad_norm(&mut updates, Some(1.0)).unwrap_err();
            assert!(matches!(&err, OptimError::NonFiniteGrad { param, norm, .. } if param == "b" && !norm.is_finite()));
            assert!(err.to_string().contains("the gradient of `b` holds"), "{err}");
            assert_eq!(ga, [3.0, 4.0]);
        }
    }

    /// A run stopped after two steps and resumed from its state (through a safetensors file)
    /// continues exactly as the uninterrupted run.
    #[test]
    fn state_round_trip_resumes_bit_for_bit() {
        for kind in [OptimizerKind::AdamW, OptimizerKind::Sgd] {
            let r = Recipe { optimizer: kind, momentum: 0.9, ..recipe() };
            let mut model = Model::new();
            let mut opt = model.optimizer(&r);
            for t in 1..=2 {
                model.step(&mut opt, r.lr_at(t - 1), t, r.clip);
            }
            let path =
                std::env::temp_dir().join(format!("kiln-optim-state-{}-{kind:?}.safetensors", std::process::id()));
            crate::write_tensors(&path, &opt.state()).unwrap();
            let saved = crate::read_tensors(&path).unwrap();
            std::fs::remove_file(&path).unwrap();

            let mut resumed_model = Model { values: model.values.clone(), ..Model::new() };
            let mut resumed = resumed_model.optimizer(&r);
            resumed.load_state(&saved).unwrap();
            assert_eq!(resumed, opt, "{kind:?}");
            for t in 3..=5 {
                let lr = r.lr_at(opt.step_count() as usize);
                model.step(&mut opt, lr, t, r.clip);
                resumed_model.step(&mut resumed, lr, t, r.clip);
                let bits = |m: &Model| m.values.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&model), bits(&resumed_model), "{kind:?} step {t}");
            }
            assert_eq!(resumed, opt);
        }
    }

    #[test]
    fn state_that_does_not_fit_is_refused() {
        let r = recipe();
        let mut model = Model::new();
        let mut opt = model.optimizer(&r);
        model.step(&mut opt, 0.01, 1, None);
        let state: HashMap<String, Tensor> = opt.state().into_iter().collect();
        let fresh = model.optimizer(&r);

        let mut missing = state.clone();
        missing.remove("adam.v.model.norm.weight");
        let mut o = fresh.clone();
        let err = o.load_state(&missing).unwrap_err().to_string();
        assert_eq!(err, "optimizer state: `adam.v.model.norm.weight` is missing from the checkpoint");
        assert_eq!(o, fresh, "a refused load changes nothing");

        let mut extra = state.clone();
        extra.insert("adam.m.model.embed_tokens.weight".into(), Tensor::f32(vec![2, 2], vec![0.0; 4]));
        let err = fresh.clone().load_state(&extra).unwrap_err().to_string();
        assert!(
            err.starts_with("optimizer state: `adam.m.model.embed_tokens.weight` belongs to no trainable"),
            "{err}"
        );

        let mut reshaped = state.clone();
        reshaped.insert("adam.m.model.norm.weight".into(), Tensor::f32(vec![1, 3], vec![0.0; 3]));
        let err = fresh.clone().load_state(&reshaped).unwrap_err().to_string();
        assert!(err.contains("shape [1, 3], expected f32 of shape [3]"), "{err}");

        let mut negative = state.clone();
        negative.insert("adam.step".into(), Tensor::i64(vec![], vec![-1]));
        let err = fresh.clone().load_state(&negative).unwrap_err().to_string();
        assert_eq!(err, "optimizer state: `adam.step` is -1, not a step count");

        // Other tensors (the parameters in the same checkpoint) are ignored.
        let mut with_params = state;
        with_params.insert("model.norm.weight".into(), Tensor::f32(vec![3], vec![0.0; 3]));
        let mut o = fresh;
        o.load_state(&with_params).unwrap();
        assert_eq!(o, opt);
    }

    #[test]
    fn a_step_must_cover_each_parameter_once() {
        let mut adam = AdamW::new([0.9, 0.999], 1e-8, 0.0);
        adam.add_param("a", &[2], false);
        adam.add_param("b", &[1], false);
        let before = adam.clone();
        let (mut a, mut ga, mut b, mut gb) = (vec![1.0f32; 2], vec![1.0f32; 2], vec![1.0f32], vec![1.0f32]);
        let err = adam.step(0.1, &mut [Update { name: "a", value: &mut a, grad: &mut ga, scale: 1.0 }]).unwrap_err();
        assert_eq!(err.to_string(), "parameter `b` has no gradient in this step; every trainable parameter needs one");
        let mut two_a = [
            Update { name: "a", value: &mut a, grad: &mut ga, scale: 1.0 },
            Update { name: "a", value: &mut b, grad: &mut gb, scale: 1.0 },
        ];
        assert!(matches!(adam.step(0.1, &mut two_a), Err(OptimError::DuplicateParam { .. })));
        let (mut c, mut gc) = (vec![1.0f32], vec![1.0f32]);
        let err = adam.step(0.1, &mut [Update { name: "c", value: &mut c, grad: &mut gc, scale: 1.0 }]).unwrap_err();
        assert!(matches!(err, OptimError::UnknownParam { .. }));
        let (mut short, mut gshort) = (vec![1.0f32], vec![1.0f32]);
        let mut updates = [
            Update { name: "a", value: &mut a, grad: &mut gshort, scale: 1.0 },
            Update { name: "b", value: &mut short, grad: &mut gb, scale: 1.0 },
        ];
        let err = adam.step(0.1, &mut updates).unwrap_err();
        assert_eq!(err.to_string(), "parameter `a`: the gradient has 1 elements, expected 2");
        assert_eq!(adam, before);
        assert_eq!(a, [1.0, 1.0]);
    }

    #[test]
    fn updates_from_tensors_check_type_and_shape() {
        let mut p = Tensor::f32(vec![2], vec![1.0, 2.0]);
        let mut g = Tensor::f32(vec![2], vec![0.5, 0.5]);
        let u = Update::from_tensors("p", &mut p, &mut g).unwrap();
        assert_eq!((u.value.len(), u.grad.len()), (2, 2));
        let mut g2 = Tensor::f32(vec![1, 2], vec![0.5, 0.5]);
        let err = Update::from_tensors("p", &mut p, &mut g2).unwrap_err().to_string();
        assert_eq!(err, "parameter `p`: gradient shape [1, 2] differs from the parameter's [2]");
        let mut gi = Tensor::i64(vec![2], vec![0, 0]);
        let err = Update::from_tensors("p", &mut p, &mut gi).unwrap_err().to_string();
        assert_eq!(err, "parameter `p`: the gradient is not f32");
    }

    /// Micro-batches weighted by their counted positions give the whole batch's mean gradient.
    #[test]
    fn accumulation_weights_by_counted_positions() {
        // Per-position gradients of a 3-element parameter; the loss is the mean over positions.
        let position =
            |k: usize| -> Vec<f32> { (0..3).map(|i| ((k * 3 + i) as f32 * 0.71).cos() * (1 + k) as f32).collect() };
        let mean = |ks: std::ops::Range<usize>| -> Vec<f32> {
            let n = ks.len() as f32;
            let mut sum = vec![0.0f32; 3];
            for k in ks {
                sum.iter_mut().zip(position(k)).for_each(|(s, g)| *s += g);
            }
            sum.into_iter().map(|s| s / n).collect()
        };
        let full = mean(0..6);
        let mut acc = GradAccumulator::new();
        for ks in [0..3, 3..3, 3..4, 4..6] {
            let (g, other) = (mean(ks.clone()), vec![ks.len() as f32]);
            acc.add(ks.len(), [("w", g.as_slice()), ("b", other.as_slice())]).unwrap();
        }
        assert_eq!(acc.counted(), 6);
        let got = acc.finish();
        for (g, f) in got["w"].iter().zip(&full) {
            assert!((g - f).abs() < 1e-6, "{g} vs {f}");
        }
        // The plain average of the three micro-batches' means is not the batch's mean.
        let plain: Vec<f32> = (0..3).map(|i| (mean(0..3)[i] + mean(3..4)[i] + mean(4..6)[i]) / 3.0).collect();
        assert!(plain.iter().zip(&full).any(|(p, f)| (p - f).abs() > 1e-3));
        // b's "gradient" was the micro-batch's size, so its weighted mean is sum n^2 / sum n.
        assert!((got["b"][0] - (9.0 + 1.0 + 4.0) / 6.0).abs() < 1e-6);

        // One micro-batch passes through bit for bit.
        let g = mean(0..5);
        let mut acc = GradAccumulator::new();
        acc.add(5, [("w", g.as_slice())]).unwrap();
        assert_eq!(acc.finish()["w"], g);

        // Micro-batches must agree on the parameters.
        let mut acc = GradAccumulator::new();
        acc.add(2, [("w", g.as_slice())]).unwrap();
        let err = acc.add(1, [("v", g.as_slice())]).unwrap_err();
        assert!(matches!(err, OptimError::UnknownParam { .. }));
        let err = acc.add(1, [("w", &g[..2])]).unwrap_err();
        assert_eq!(err.to_string(), "parameter `w`: the gradient has 2 elements, expected 3");
        let err = acc.add(1, []).unwrap_err();
        assert!(matches!(err, OptimError::MissingParam { .. }));
        assert_eq!(acc.counted(), 2);
    }
}
