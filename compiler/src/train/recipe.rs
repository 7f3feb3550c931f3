//! The training recipe: a run's hyperparameters, read from JSON or TOML.
//!
//! Two types, one per stage of reading:
//!
//! - [`RecipeFile`] is what a file (or a spec's `[train]` table, or the command line) says: every
//!   key optional, unknown keys refused. Layers are combined with [`RecipeFile::merge`], later
//!   layers winning key by key (file, then spec, then flags: whichever order the caller merges).
//! - [`Recipe`] is the resolved run: [`RecipeFile::resolve`] fills the defaults listed on each
//!   field of [`Recipe`] and then [`Recipe::validate`]s, so a `Recipe` in hand is always usable.
//!
//! Unknown keys are an error naming the key (and, through serde_json or toml, the file's line):
//! a misspelt hyperparameter silently left at its default is the worst way for a run to go wrong,
//! because nothing fails — the run is merely not the one asked for.
//!
//! The keys (the same in JSON and TOML):
//!
//! ```json
//! {"steps": 16, "batch": 4, "seq": 32, "lr": 0.005, "min_lr": 0.001, "warmup_steps": 3,
//!  "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1, "clip": 1.0,
//!  "frozen": ["model.embed_tokens.*"], "label_smoothing": 0.0, "optimizer": "adamw",
//!  "momentum": 0.9, "schedule": "cosine", "accumulate": 1, "decay_1d": false, "seed": 0,
//!  "eval_every": 100, "eval_batches": 4, "checkpoint_every": 500, "recompute": "all"}
//! ```

use std::fmt;
use std::path::Path;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::schedule::LrSchedule;

/// A recipe that could not be read or is not a possible run.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("cannot read recipe {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file's extension names no format this reader knows.
    #[error("recipe {path}: unknown format, expected a .json or .toml file")]
    Format {
        /// The file.
        path: String,
    },
    /// JSON that does not parse or does not fit (an unknown key, a wrong type); serde_json's
    /// message names the key and carries the line and column.
    #[error("recipe {origin}: {source}")]
    Json {
        /// The file (or other origin) of the text.
        origin: String,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// TOML that does not parse or does not fit; toml's message names the key, line and column.
    #[error("recipe {origin}: {source}")]
    Toml {
        /// The file (or other origin) of the text.
        origin: String,
        /// The parser's error.
        source: toml::de::Error,
    },
    /// A key without a default was given nowhere.
    #[error("recipe: `{key}` must be given")]
    Missing {
        /// The key.
        key: &'static str,
    },
    /// A value no run can have.
    #[error("recipe: `{key}` = {value}: {why}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// The value, as given.
        value: String,
        /// What it must be instead.
        why: String,
    },
}

/// The update rule (`kiln_runtime::train::optim` implements each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// AdamW with decoupled weight decay, as `torch.optim.AdamW` (`"adamw"`).
    #[default]
    #[serde(rename = "adamw")]
    AdamW,
    /// Stochastic gradient descent with momentum, as `torch.optim.SGD` (`"sgd"`).
    #[serde(rename = "sgd")]
    Sgd,
}

/// The learning-rate schedule's shape after warm-up ([`LrSchedule`] has the formulas).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Linear warm-up, then a half cosine from `lr` down to `min_lr` (`"cosine"`).
    #[default]
    Cosine,
    /// Linear warm-up, then a straight line from `lr` down to `min_lr` (`"linear"`).
    Linear,
    /// Linear warm-up, then `lr` (`"constant"`).
    Constant,
    /// The original Transformer's warm-up and inverse-square-root decay (`"inverse-sqrt"`).
    InverseSqrt,
}

/// The `clip` key: a maximum global gradient norm, or no clipping.
///
/// Read from a number, or from `"none"` / `"off"` / `false` (so a layer can switch off clipping
/// that an earlier layer set; TOML has no `null`). In JSON, `null` is the same as leaving the key
/// out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Clip {
    /// No clipping.
    Off,
    /// Scale the gradients down when their global norm exceeds this.
    Norm(f64),
}

impl Serialize for Clip {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Clip::Off => serializer.serialize_str("none"),
            Clip::Norm(norm) => serializer.serialize_f64(*norm),
        }
    }
}

impl<'de> Deserialize<'de> for Clip {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ClipVisitor;
        impl Visitor<'_> for ClipVisitor {
            type Value = Clip;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number (a maximum gradient norm), or \"none\" for no clipping")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Clip, E> {
                Ok(Clip::Norm(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Clip, E> {
                Ok(Clip::Norm(v as f64))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Clip, E> {
                Ok(Clip::Norm(v as f64))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Clip, E> {
                if v { Err(E::invalid_value(de::Unexpected::Bool(v), &self)) } else { Ok(Clip::Off) }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Clip, E> {
                match v {
                    "none" | "off" => Ok(Clip::Off),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
            fn visit_unit<E: de::Error>(self) -> Result<Clip, E> {
                Ok(Clip::Off)
            }
        }
        deserializer.deserialize_any(ClipVisitor)
    }
}

/// The two text formats a recipe is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// JSON (`.json`).
    Json,
    /// TOML (`.toml`).
    Toml,
}

impl Format {
    /// The format a file's extension names (`.json`, `.toml`), if any.
    pub fn of_path(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "json" => Some(Format::Json),
            "toml" => Some(Format::Toml),
            _ => None,
        }
    }
}

/// The `recompute` key: which blocks' activations a step recomputes in its backward instead of
/// keeping them from the forward (activation checkpointing; see [`crate::autodiff`]).
///
/// Read from `"none"`, `"all"` or a count of blocks (those the cost model finds cheapest to
/// recompute for the memory they free: [`super::recompute`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Every activation kept.
    #[default]
    None,
    /// Every block recomputed.
    All,
    /// This many blocks recomputed.
    Blocks(usize),
}

impl Serialize for Recompute {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Recompute::None => serializer.serialize_str("none"),
            Recompute::All => serializer.serialize_str("all"),
            Recompute::Blocks(n) => serializer.serialize_u64(*n as u64),
        }
    }
}

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RecomputeVisitor;
        impl Visitor<'_> for RecomputeVisitor {
            type Value = Recompute;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("\"none\", \"all\", or an integer (a number of blocks)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Recompute, E> {
                usize::try_from(v)
                    .map(Recompute::Blocks)
                    .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Recompute, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Recompute, E> {
                v.parse().map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        deserializer.deserialize_any(RecomputeVisitor)
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    /// `none`, `all` or a count (the command line's form of the key).
    fn from_str(s: &str) -> Result<Recompute, String> {
        match s {
            "none" => Ok(Recompute::None),
            "all" => Ok(Recompute::All),
            n => n
                .parse()
                .map(Recompute::Blocks)
                .map_err(|_| format!("`{s}`: expected `none`, `all` or a number of blocks")),
        }
    }
}

/// A size in bytes (the `memory_budget` key): a number of bytes, or a string with a unit —
/// `"4GiB"`, `"1.5 GB"`, `"800MiB"`, `"512M"` (binary multiples for `K`/`M`/`G`/`T` and
/// `KiB`..`TiB`, decimal ones for `kB`/`KB`..`TB`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl std::str::FromStr for Bytes {
    type Err = String;
    fn from_str(s: &str) -> Result<Bytes, String> {
        let t = s.trim();
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (number, unit) = t.split_at(split);
        let unit = unit.trim();
        let unit_bytes: f64 = match unit {
            "" | "B" => 1.0,
            "K" | "KiB" => 1024.0,
            "M" | "MiB" => 1024f64.powi(2),
            "G" | "GiB" => 1024f64.powi(3),
            "T" | "TiB" => 1024f64.powi(4),
            "kB" | "KB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            _ => return Err(format!("`{s}`: unknown unit `{unit}` (B, K/KiB, M/MiB, G/GiB, T/TiB, kB, MB, GB, TB)")),
        };
        let value: f64 = number.parse().map_err(|_| format!("`{s}`: expected a size such as 4GiB or 800MB"))?;
        let bytes = value * unit_bytes;
        if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
            return Err(format!("`{s}`: not a size in bytes"));
        }
        Ok(Bytes(bytes as u64))
    }
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BytesVisitor;
        impl Visitor<'_> for BytesVisitor {
            type Value = Bytes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer (bytes), or a string of a size such as \"4GiB\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Bytes, E> {
                u64::try_from(v).map(Bytes).map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Bytes, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Bytes, E> {
                v.parse().map_err(|_| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        deserializer.deserialize_any(BytesVisitor)
    }
}

/// What one layer (a file, a spec's table, the command line) says: every key optional.
///
/// The keys are [`Recipe`]'s, with the same meaning; `None` is "not said here". Unknown keys are
/// refused when reading.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[expect(missing_docs, reason = "each field is the same-named field of `Recipe`, documented there")]
pub struct RecipeFile {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub betas: Option<[f64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clip: Option<Clip>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frozen: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label_smoothing: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accumulate: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decay_1d: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_batches: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub checkpoint_every: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recompute: Option<Recompute>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_budget: Option<Bytes>,
}

/// A resolved, validated training run. Each field's default (when no layer gives it) is stated on
/// it; `steps` has none and must be given.
#[derive(Clone, Debug, PartialEq)]
pub struct Recipe {
    /// Optimizer steps in the run. Required.
    pub steps: usize,
    /// Sequences per micro-batch (what one forward and backward pass holds); a step sees
    /// `batch * accumulate` sequences. Default 8.
    pub batch: usize,
    /// Tokens per sequence; `None` leaves it to the trainer (the model's context). Default `None`.
    pub seq: Option<usize>,
    /// Peak learning rate. Default 3e-4.
    pub lr: f64,
    /// Learning rate the decaying schedules end at. Default `lr / 10`.
    pub min_lr: f64,
    /// Steps of linear warm-up. Default 0.
    pub warmup_steps: usize,
    /// AdamW's `(beta1, beta2)`. Default `[0.9, 0.999]` (PyTorch's).
    pub betas: [f64; 2],
    /// AdamW's epsilon, added to the denominator. Default 1e-8.
    pub eps: f64,
    /// Weight decay: decoupled for AdamW, added to the gradient for SGD. Default 0.
    pub weight_decay: f64,
    /// Maximum global gradient norm; `None` does not clip. Default `None`.
    pub clip: Option<f64>,
    /// Parameters not trained: names or globs (`*` any run of characters, dots included; `?`
    /// one character). Default none.
    pub frozen: Vec<String>,
    /// Label smoothing of the cross-entropy loss, in `[0, 1)`. Default 0.
    pub label_smoothing: f64,
    /// The update rule. Default AdamW.
    pub optimizer: OptimizerKind,
    /// SGD's momentum, in `[0, 1)`; 0 is plain SGD. Default 0 (PyTorch's).
    pub momentum: f64,
    /// The learning-rate schedule after warm-up. Default cosine.
    pub schedule: ScheduleKind,
    /// Micro-batches whose gradients are accumulated into one step. Default 1.
    pub accumulate: usize,
    /// Whether one-dimensional parameters (norm scales, biases) decay too. Default `false`.
    pub decay_1d: bool,
    /// Seed of the run's randomness (initialization, data order). Default 0.
    pub seed: u64,
    /// Evaluate every this many steps; `None` never evaluates. Default `None`.
    pub eval_every: Option<usize>,
    /// Batches per evaluation. Default 1.
    pub eval_batches: usize,
    /// Write a checkpoint every this many steps; `None` leaves it to the trainer (at the end).
    /// Default `None`.
    pub checkpoint_every: Option<usize>,
    /// Which blocks' activations the backward recomputes instead of keeping. Default none.
    pub recompute: Recompute,
    /// The memory a step may take, in bytes (weights, gradients, optimizer state and
    /// activations, as [`super::step_memory`] counts them): the fewest blocks that bring it
    /// within this are recomputed ([`super::recompute`]). Not with `recompute`. Default `None`.
    pub memory_budget: Option<u64>,
}

impl RecipeFile {
    /// Parses recipe text; `origin` (a file name, `"--recipe"`, ...) goes into error messages.
    pub fn parse(text: &str, format: Format, origin: &str) -> Result<RecipeFile, RecipeError> {
        match format {
            Format::Json => {
                serde_json::from_str(text).map_err(|source| RecipeError::Json { origin: origin.into(), source })
            }
            Format::Toml => toml::from_str(text).map_err(|source| RecipeError::Toml { origin: origin.into(), source }),
        }
    }

    /// Reads a `.json` or `.toml` recipe file.
    pub fn from_path(path: &Path) -> Result<RecipeFile, RecipeError> {
        let name = path.display().to_string();
        let format = Format::of_path(path).ok_or_else(|| RecipeError::Format { path: name.clone() })?;
        let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Read { path: name.clone(), source })?;
        RecipeFile::parse(&text, format, &name)
    }

    /// This layer with `overrides` laid over it: each key `overrides` gives wins.
    pub fn merge(self, overrides: RecipeFile) -> RecipeFile {
        // Destructured in full so that a new key cannot be forgotten here.
        let RecipeFile {
            steps,
            batch,
            seq,
            lr,
            min_lr,
            warmup_steps,
            betas,
            eps,
            weight_decay,
            clip,
            frozen,
            label_smoothing,
            optimizer,
            momentum,
            schedule,
            accumulate,
            decay_1d,
            seed,
            eval_every,
            eval_batches,
            checkpoint_every,
            recompute,
            memory_budget,
        } = overrides;
        RecipeFile {
            steps: steps.or(self.steps),
            batch: batch.or(self.batch),
            seq: seq.or(self.seq),
            lr: lr.or(self.lr),
            min_lr: min_lr.or(self.min_lr),
            warmup_steps: warmup_steps.or(self.warmup_steps),
            betas: betas.or(self.betas),
            eps: eps.or(self.eps),
            weight_decay: weight_decay.or(self.weight_decay),
            clip: clip.or(self.clip),
            frozen: frozen.or(self.frozen),
            label_smoothing: label_smoothing.or(self.label_smoothing),
            optimizer: optimizer.or(self.optimizer),
            momentum: momentum.or(self.momentum),
            schedule: schedule.or(self.schedule),
            accumulate: accumulate.or(self.accumulate),
            decay_1d: decay_1d.or(self.decay_1d),
            seed: seed.or(self.seed),
            eval_every: eval_every.or(self.eval_every),
            eval_batches: eval_batches.or(self.eval_batches),
            checkpoint_every: checkpoint_every.or(self.checkpoint_every),
            recompute: recompute.or(self.recompute),
            memory_budget: memory_budget.or(self.memory_budget),
        }
    }

    /// The run this layer describes: defaults filled in ([`Recipe`]'s fields name them), then
    /// [`Recipe::validate`]d.
    pub fn resolve(self) -> Result<Recipe, RecipeError> {
        let lr = self.lr.unwrap_or(3e-4);
        let recipe = Recipe {
            steps: self.steps.ok_or(RecipeError::Missing { key: "steps" })?,
            batch: self.batch.unwrap_or(8),
            seq: self.seq,
            lr,
            min_lr: self.min_lr.unwrap_or(lr / 10.0),
            warmup_steps: self.warmup_steps.unwrap_or(0),
            betas: self.betas.unwrap_or([0.9, 0.999]),
            eps: self.eps.unwrap_or(1e-8),
            weight_decay: self.weight_decay.unwrap_or(0.0),
            clip: match self.clip {
                Some(Clip::Norm(norm)) => Some(norm),
                Some(Clip::Off) | None => None,
            },
            frozen: self.frozen.unwrap_or_default(),
            label_smoothing: self.label_smoothing.unwrap_or(0.0),
            optimizer: self.optimizer.unwrap_or_default(),
            momentum: self.momentum.unwrap_or(0.0),
            schedule: self.schedule.unwrap_or_default(),
            accumulate: self.accumulate.unwrap_or(1),
            decay_1d: self.decay_1d.unwrap_or(false),
            seed: self.seed.unwrap_or(0),
            eval_every: self.eval_every,
            eval_batches: self.eval_batches.unwrap_or(1),
            checkpoint_every: self.checkpoint_every,
            recompute: self.recompute.unwrap_or_default(),
            memory_budget: self.memory_budget.map(|b| b.0),
        };
        recipe.validate()?;
        Ok(recipe)
    }
}

impl From<&Recipe> for RecipeFile {
    /// Every key of the resolved run, so that it can be written beside a checkpoint and read back
    /// to the same [`Recipe`].
    fn from(r: &Recipe) -> RecipeFile {
        RecipeFile {
            steps: Some(r.steps),
            batch: Some(r.batch),
            seq: r.seq,
            lr: Some(r.lr),
            min_lr: Some(r.min_lr),
            warmup_steps: Some(r.warmup_steps),
            betas: Some(r.betas),
            eps: Some(r.eps),
            weight_decay: Some(r.weight_decay),
            clip: Some(r.clip.map_or(Clip::Off, Clip::Norm)),
            frozen: Some(r.frozen.clone()),
            label_smoothing: Some(r.label_smoothing),
            optimizer: Some(r.optimizer),
            momentum: Some(r.momentum),
            schedule: Some(r.schedule),
            accumulate: Some(r.accumulate),
            decay_1d: Some(r.decay_1d),
            seed: Some(r.seed),
            eval_every: r.eval_every,
            eval_batches: Some(r.eval_batches),
            checkpoint_every: r.checkpoint_every,
            recompute: Some(r.recompute),
            memory_budget: r.memory_budget.map(Bytes),
        }
    }
}

/// An [`RecipeError::Invalid`] for `key`, its value written with `{:?}` (so `1e-8` stays `1e-8`).
fn invalid(key: &'static str, value: impl fmt::Debug, why: impl Into<String>) -> RecipeError {
    RecipeError::Invalid { key, value: format!("{value:?}"), why: why.into() }
}

/// `Ok` when `x` lies in `[0, 1)`.
fn unit_interval(key: &'static str, x: f64) -> Result<(), RecipeError> {
    if (0.0..1.0).contains(&x) { Ok(()) } else { Err(invalid(key, x, "must be in [0, 1)")) }
}

/// `Ok` unless a count that must be positive is 0.
fn positive(key: &'static str, n: usize) -> Result<(), RecipeError> {
    if n == 0 { Err(invalid(key, n, "must be at least 1")) } else { Ok(()) }
}

impl Recipe {
    /// Reads, resolves and validates a `.json` or `.toml` recipe file.
    pub fn from_path(path: &Path) -> Result<Recipe, RecipeError> {
        RecipeFile::from_path(path)?.resolve()
    }

    /// Refuses values no run can have, naming the key and the value.
    pub fn validate(&self) -> Result<(), RecipeError> {
        positive("steps", self.steps)?;
        positive("batch", self.batch)?;
        if let Some(seq) = self.seq {
            positive("seq", seq)?;
        }
        if !self.lr.is_finite() || self.lr < 0.0 {
            return Err(invalid("lr", self.lr, "must be finite and at least 0"));
        }
        if !self.min_lr.is_finite() || self.min_lr < 0.0 {
            return Err(invalid("min_lr", self.min_lr, "must be finite and at least 0"));
        }
        if self.min_lr > self.lr {
            return Err(invalid("min_lr", self.min_lr, format!("must not exceed lr ({:?})", self.lr)));
        }
        if self.warmup_steps > self.steps {
            return Err(invalid("warmup_steps", self.warmup_steps, format!("must not exceed steps ({})", self.steps)));
        }
        if !self.betas.iter().all(|b| (0.0..1.0).contains(b)) {
            return Err(invalid("betas", self.betas, "each must be in [0, 1)"));
        }
        if !self.eps.is_finite() || self.eps <= 0.0 {
            return Err(invalid("eps", self.eps, "must be finite and greater than 0"));
        }
        if !self.weight_decay.is_finite() || self.weight_decay < 0.0 {
            return Err(invalid("weight_decay", self.weight_decay, "must be finite and at least 0"));
        }
        if let Some(clip) = self.clip
            && (!clip.is_finite() || clip <= 0.0)
        {
            return Err(invalid("clip", clip, "must be finite and greater than 0 (or \"none\")"));
        }
        if let Some(empty) = self.frozen.iter().find(|pattern| pattern.is_empty()) {
            return Err(invalid("frozen", empty, "a name or glob must not be empty"));
        }
        unit_interval("label_smoothing", self.label_smoothing)?;
        unit_interval("momentum", self.momentum)?;
        positive("accumulate", self.accumulate)?;
        if let Some(every) = self.eval_every {
            positive("eval_every", every)?;
        }
        positive("eval_batches", self.eval_batches)?;
        if let Some(every) = self.checkpoint_every {
            positive("checkpoint_every", every)?;
        }
        if let Some(budget) = self.memory_budget
            && self.recompute != Recompute::None
        {
            return Err(invalid(
                "memory_budget",
                budget,
                "the budget chooses the blocks to recompute: give `recompute` or `memory_budget`, not both",
            ));
        }
        Ok(())
    }

    /// Values the optimizer keeps per trained element: AdamW's two moments, SGD's momentum (none
    /// without).
    pub fn moments(&self) -> u64 {
        match self.optimizer {
            OptimizerKind::AdamW => 2,
            OptimizerKind::Sgd if self.momentum != 0.0 => 1,
            OptimizerKind::Sgd => 0,
        }
    }

    /// Whether the parameter `name` is frozen: matched by a name or glob of `frozen`.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.frozen.iter().any(|pattern| glob_match(pattern, name))
    }

    /// The entries of `frozen` that match none of `names` (the model's parameters), so that the
    /// trainer can refuse a frozen list with a typo rather than train what was meant to be frozen.
    pub fn unmatched_frozen(&self, names: &[&str]) -> Vec<String> {
        self.frozen.iter().filter(|pattern| !names.iter().any(|name| glob_match(pattern, name))).cloned().collect()
    }

    /// Whether a parameter of this shape takes weight decay: matrices and larger always, vectors
    /// and scalars (norm scales, biases) only with `decay_1d`.
    pub fn decays(&self, shape: &[usize]) -> bool {
        shape.len() >= 2 || self.decay_1d
    }

    /// The learning-rate schedule of this run.
    pub fn schedule(&self) -> LrSchedule {
        LrSchedule {
            kind: self.schedule,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup_steps: self.warmup_steps,
            steps: self.steps,
        }
    }

    /// The learning rate at 0-based `step` ([`LrSchedule::at`]).
    pub fn lr_at(&self, step: usize) -> f64 {
        self.schedule().at(step)
    }
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters (dots included, so
/// `model.layers.*` reaches every layer's parameters) and `?` matches one character; every other
/// character matches itself. Parameter names hold neither `*` nor `?`, so no escape is needed.
///
/// (The workspace's lock file has `globset`, but only through a test dependency; two
/// metacharacters do not justify a regex engine in the runtime, and `globset`'s `[...]`/`{...}`
/// would turn brackets in a name into syntax.)
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let name: Vec<char> = name.chars().collect();
    let (mut p, mut n) = (0, 0);
    // The last `*` seen: the pattern position after it, and the name position its run ends at.
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match (pattern.get(p), name.get(n)) {
            (Some('*'), _) => {
                star = Some((p + 1, n));
                p += 1;
            }
            (Some(&c), Some(&d)) if c == '?' || c == d => {
                p += 1;
                n += 1;
            }
            // A mismatch: let the last `*` swallow one more character and retry after it.
            _ => match star {
                Some((after, end)) => {
                    star = Some((after, end + 1));
                    p = after;
                    n = end + 1;
                }
                None => return false,
            },
        }
    }
    pattern.get(p..).is_some_and(|rest| rest.iter().all(|&c| c == '*'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = r#"{"steps": 16, "batch": 4, "seq": 32, "lr": 0.005, "min_lr": 0.001, "warmup_steps": 3, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1, "clip": 1.0, "frozen": ["model.embed_tokens.weight"]}"#;

    fn fixture() -> Recipe {
        RecipeFile::parse(FIXTURE, Format::Json, "train.json").unwrap().resolve().unwrap()
    }

    #[test]
    fn fixture_json_parses_as_is() {
        let r = fixture();
        assert_eq!((r.steps, r.batch, r.seq, r.warmup_steps), (16, 4, Some(32), 3));
        assert_eq!((r.lr, r.min_lr, r.betas, r.eps, r.weight_decay), (0.005, 0.001, [0.9, 0.95], 1e-8, 0.1));
        assert_eq!(r.clip, Some(1.0));
        assert_eq!(r.frozen, ["model.embed_tokens.weight"]);
        // The keys it leaves out take their defaults.
        assert_eq!(
            (r.optimizer, r.schedule, r.accumulate, r.decay_1d),
            (OptimizerKind::AdamW, ScheduleKind::Cosine, 1, false)
        );
        assert_eq!((r.label_smoothing, r.momentum, r.seed, r.eval_every, r.eval_batches), (0.0, 0.0, 0, None, 1));
        let with_smoothing = FIXTURE.replace("\"clip\"", "\"label_smoothing\": 0.1, \"clip\"");
        let r = RecipeFile::parse(&with_smoothing, Format::Json, "train.json").unwrap().resolve().unwrap();
        assert_eq!(r.label_smoothing, 0.1);
    }

    #[test]
    fn toml_reads_the_same_keys() {
        let text = r#"
steps = 16
batch = 4
seq = 32
lr = 0.005
min_lr = 0.001
warmup_steps = 3
betas = [0.9, 0.95]
eps = 1e-08
weight_decay = 0.1
clip = 1.0
frozen = ["model.embed_tokens.weight"]
"#;
        assert_eq!(RecipeFile::parse(text, Format::Toml, "train.toml").unwrap().resolve().unwrap(), fixture());
        let text = "steps = 5\noptimizer = \"sgd\"\nmomentum = 0.9\nschedule = \"inverse-sqrt\"\nclip = \"none\"\n";
        let r = RecipeFile::parse(text, Format::Toml, "t.toml").unwrap().resolve().unwrap();
        assert_eq!(
            (r.optimizer, r.momentum, r.schedule, r.clip),
            (OptimizerKind::Sgd, 0.9, ScheduleKind::InverseSqrt, None)
        );
    }

    #[test]
    fn from_path_picks_the_format_by_extension_and_names_the_file() {
        let dir = std::env::temp_dir().join(format!("kiln-recipe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("train.json");
        crate::file::write_atomic(&json, FIXTURE.as_bytes()).unwrap();
        assert_eq!(Recipe::from_path(&json).unwrap(), fixture());
        let toml_path = dir.join("train.toml");
        crate::file::write_atomic(&toml_path, b"steps = 3\n\nlr = 0.1\nstpes = 4\n").unwrap();
        let message = Recipe::from_path(&toml_path).unwrap_err().to_string();
        assert!(message.contains("train.toml") && message.contains("stpes") && message.contains("line 4"), "{message}");
        let other = dir.join("train.yaml");
        let message = Recipe::from_path(&other).unwrap_err().to_string();
        assert!(message.contains("train.yaml") && message.contains(".json or .toml"), "{message}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key_and_line() {
        let text = "{\"steps\": 3,\n \"learning_rate\": 0.1}";
        let message = RecipeFile::parse(text, Format::Json, "train.json").unwrap_err().to_string();
        assert!(message.starts_with("recipe train.json: unknown field `learning_rate`"), "{message}");
        assert!(message.contains("line 2"), "{message}");
        let message = RecipeFile::parse("wd = 0.1", Format::Toml, "t.toml").unwrap_err().to_string();
        assert!(message.contains("unknown field `wd`") && message.contains("line 1"), "{message}");
        let message = RecipeFile::parse("{\"schedule\": \"cosin\"}", Format::Json, "j").unwrap_err().to_string();
        assert!(message.contains("unknown variant `cosin`"), "{message}");
    }

    #[test]
    fn steps_must_be_given() {
        let message = RecipeFile::default().resolve().unwrap_err().to_string();
        assert_eq!(message, "recipe: `steps` must be given");
    }

    /// Each impossible value is refused with the key and value in the message.
    #[test]
    fn invalid_values_name_key_and_value() {
        let cases: &[(&str, &str)] = &[
            (r#""steps": 0"#, "recipe: `steps` = 0: must be at least 1"),
            (r#""batch": 0"#, "recipe: `batch` = 0: must be at least 1"),
            (r#""seq": 0"#, "recipe: `seq` = 0: must be at least 1"),
            (r#""lr": -0.1"#, "recipe: `lr` = -0.1: must be finite and at least 0"),
            (r#""lr": 0.5, "min_lr": 0.6"#, "recipe: `min_lr` = 0.6: must not exceed lr (0.5)"),
            (r#""min_lr": -1e-9, "lr": 0.1"#, "recipe: `min_lr` = -1e-9: must be finite and at least 0"),
            (r#""warmup_steps": 11"#, "recipe: `warmup_steps` = 11: must not exceed steps (10)"),
            (r#""betas": [0.9, 1.0]"#, "recipe: `betas` = [0.9, 1.0]: each must be in [0, 1)"),
            (r#""betas": [-0.1, 0.9]"#, "recipe: `betas` = [-0.1, 0.9]: each must be in [0, 1)"),
            (r#""eps": 0"#, "recipe: `eps` = 0.0: must be finite and greater than 0"),
            (r#""weight_decay": -0.01"#, "recipe: `weight_decay` = -0.01: must be finite and at least 0"),
            (r#""clip": 0"#, "recipe: `clip` = 0.0: must be finite and greater than 0 (or \"none\")"),
            (r#""clip": -1.5"#, "recipe: `clip` = -1.5: must be finite and greater than 0 (or \"none\")"),
            (r#""label_smoothing": 1.0"#, "recipe: `label_smoothing` = 1.0: must be in [0, 1)"),
            (r#""accumulate": 0"#, "recipe: `accumulate` = 0: must be at least 1"),
            (r#""momentum": 1.0"#, "recipe: `momentum` = 1.0: must be in [0, 1)"),
            (r#""eval_every": 0"#, "recipe: `eval_every` = 0: must be at least 1"),
            (r#""eval_batches": 0"#, "recipe: `eval_batches` = 0: must be at least 1"),
            (r#""checkpoint_every": 0"#, "recipe: `checkpoint_every` = 0: must be at least 1"),
            (r#""frozen": [""]"#, "recipe: `frozen` = \"\": a name or glob must not be empty"),
            (
                r#""recompute": "all", "memory_budget": "2GiB""#,
                "recipe: `memory_budget` = 2147483648: the budget chooses the blocks to recompute: give \
                 `recompute` or `memory_budget`, not both",
            ),
        ];
        for (keys, expected) in cases {
            // `steps` first so that a case's own `steps` wins (serde_json refuses duplicates, so
            // the steps case stands alone).
            let text = if keys.starts_with("\"steps\"") {
                format!("{{{keys}}}")
            } else {
                format!("{{\"steps\": 10, {keys}}}")
            };
            let file = RecipeFile::parse(&text, Format::Json, "t.json").unwrap();
            assert_eq!(file.resolve().unwrap_err().to_string(), *expected, "{text}");
        }
        // Non-finite values cannot be written in JSON; they can come from elsewhere.
        let r = Recipe { lr: f64::NAN, ..fixture() };
        assert_eq!(r.validate().unwrap_err().to_string(), "recipe: `lr` = NaN: must be finite and at least 0");
    }

    #[test]
    fn recompute_and_memory_budget() {
        let read = |text: &str| RecipeFile::parse(text, Format::Toml, "t.toml").map(|f| f.resolve());
        let r = read("steps = 1\nrecompute = \"all\"").unwrap().unwrap();
        assert_eq!((r.recompute, r.memory_budget), (Recompute::All, None));
        let r = read("steps = 1\nrecompute = 3").unwrap().unwrap();
        assert_eq!(r.recompute, Recompute::Blocks(3));
        assert_eq!(read("steps = 1").unwrap().unwrap().recompute, Recompute::None);
        for (size, bytes) in [
            ("\"4GiB\"", 4u64 << 30),
            ("\"1.5 GB\"", 1_500_000_000),
            ("\"800MiB\"", 800 << 20),
            ("\"512M\"", 512 << 20),
            ("\"64kB\"", 64_000),
            ("1000000", 1_000_000),
        ] {
            let r = read(&format!("steps = 1\nmemory_budget = {size}")).unwrap().unwrap();
            assert_eq!(r.memory_budget, Some(bytes), "{size}");
        }
        for (bad, says) in [
            ("recompute = \"some\"", "expected \"none\", \"all\", or an integer (a number of blocks)"),
            ("recompute = -1", "expected \"none\", \"all\", or an integer (a number of blocks)"),
            ("memory_budget = \"4 parsecs\"", "a size such as \"4GiB\""),
            ("memory_budget = \"GiB\"", "a size such as \"4GiB\""),
        ] {
            let message = read(&format!("steps = 1\n{bad}")).unwrap_err().to_string();
            assert!(message.contains(says) && message.contains("line 2"), "{bad}: {message}");
        }
        assert_eq!("12".parse::<Recompute>(), Ok(Recompute::Blocks(12)));
        assert!("twelve".parse::<Recompute>().unwrap_err().contains("`none`, `all` or a number of blocks"));
        assert!("4 parsecs".parse::<Bytes>().unwrap_err().contains("unknown unit `parsecs`"));
        // Both keys round-trip.
        let r = Recipe { memory_budget: Some(3 << 30), ..fixture() };
        let json = serde_json::to_string(&RecipeFile::from(&r)).unwrap();
        assert_eq!(RecipeFile::parse(&json, Format::Json, "j").unwrap().resolve().unwrap(), r);
        let r = Recipe { recompute: Recompute::Blocks(2), ..fixture() };
        let toml_text = toml::to_string(&RecipeFile::from(&r)).unwrap();
        assert_eq!(RecipeFile::parse(&toml_text, Format::Toml, "t").unwrap().resolve().unwrap(), r);
    }

    #[test]
    fn merge_lets_later_layers_win_key_by_key() {
        let file = RecipeFile::parse(FIXTURE, Format::Json, "train.json").unwrap();
        let flags = RecipeFile { lr: Some(0.01), clip: Some(Clip::Off), steps: Some(20), ..RecipeFile::default() };
        let r = file.merge(flags).resolve().unwrap();
        assert_eq!((r.steps, r.lr, r.clip, r.min_lr, r.batch), (20, 0.01, None, 0.001, 4));
        // An unset layer changes nothing.
        let file = RecipeFile::parse(FIXTURE, Format::Json, "train.json").unwrap();
        assert_eq!(file.clone().merge(RecipeFile::default()), file);
        // min_lr's default follows the resolved lr.
        let r = RecipeFile { steps: Some(1), lr: Some(0.02), ..RecipeFile::default() }.resolve().unwrap();
        assert!((r.min_lr - 0.002).abs() < 1e-15);
    }

    #[test]
    fn a_resolved_recipe_round_trips_through_both_formats() {
        let r = Recipe { schedule: ScheduleKind::Linear, eval_every: Some(4), ..fixture() };
        let json = serde_json::to_string(&RecipeFile::from(&r)).unwrap();
        assert_eq!(RecipeFile::parse(&json, Format::Json, "j").unwrap().resolve().unwrap(), r);
        let toml_text = toml::to_string(&RecipeFile::from(&r)).unwrap();
        assert_eq!(RecipeFile::parse(&toml_text, Format::Toml, "t").unwrap().resolve().unwrap(), r);
        let unclipped = Recipe { clip: None, ..r };
        let json = serde_json::to_string(&RecipeFile::from(&unclipped)).unwrap();
        assert_eq!(RecipeFile::parse(&json, Format::Json, "j").unwrap().resolve().unwrap(), unclipped);
    }

    #[test]
    fn globs() {
        assert!(glob_match("model.embed_tokens.weight", "model.embed_tokens.weight"));
        assert!(!glob_match("model.embed_tokens.weight", "model.embed_tokens.weights"));
        assert!(!glob_match("model.embed_tokens.weight", "model.embed_tokens.weigh"));
        assert!(glob_match("model.embed_tokens.*", "model.embed_tokens.weight"));
        assert!(glob_match("model.layers.*.weight", "model.layers.0.self_attn.q_proj.weight"));
        assert!(!glob_match("model.layers.*.weight", "model.layers.0.self_attn.q_proj.bias"));
        assert!(glob_match("model.layers.?.mlp.*", "model.layers.7.mlp.up_proj.weight"));
        assert!(!glob_match("model.layers.?.mlp.*", "model.layers.17.mlp.up_proj.weight"));
        assert!(glob_match("*", ""));
        assert!(glob_match("**a*", "bab"));
        assert!(glob_match("*norm*", "model.layers.3.input_layernorm.weight"));
        assert!(!glob_match("", "x"));
        assert!(glob_match("a*b*c", "a.x.b.y.b.c"));
        assert!(!glob_match("a*b*c", "a.x.b.y.b.d"));
        let r = Recipe { frozen: vec!["model.embed_tokens.*".into(), "lm_head.wieght".into()], ..fixture() };
        assert!(r.is_frozen("model.embed_tokens.weight"));
        assert!(!r.is_frozen("model.norm.weight"));
        let names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"];
        assert_eq!(r.unmatched_frozen(&names), ["lm_head.wieght"]);
    }

    #[test]
    fn weight_decay_skips_vectors_unless_asked() {
        let r = fixture();
        assert!(r.decays(&[4, 4]) && r.decays(&[2, 3, 4]) && !r.decays(&[4]) && !r.decays(&[]));
        assert!(Recipe { decay_1d: true, ..r }.decays(&[4]));
    }
}
