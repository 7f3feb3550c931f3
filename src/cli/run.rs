//! `kiln run`: a spec (compiled in memory) or an artifact run once on inputs from a safetensors
//! file or given inline (`--input-ids`), with a checkpoint's weights or random ones
//! (`--random-weights`), its outputs written to a safetensors file. What `embed` shares with it:
//! running a model file on a backend ([`execute`]).

use crate::exec::{Backend, Exec, check_exec, optimizer_target};
use crate::model_file::ModelFile;
use crate::progress::Reporter;
use crate::report::print_json;
use anyhow::{Result, anyhow, bail};
use kiln_compiler::spec::Resolved;
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, interp, optimize};
use kiln_runtime::Checkpoint;
use kiln_runtime::device::{Loaded, Reading, Storage, Weights};
use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Arguments of `kiln run`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// A spec (TOML, compiled in memory), an artifact from `kiln compile`, or a checkpoint (a
    /// Hugging Face model directory or a GGUF file) whose spec is imported in memory.
    model: PathBuf,
    /// Checkpoint (safetensors, or GGUF: detected by its magic or a `.gguf` name) holding the
    /// weights under the names the spec's weight map gives (default: MODEL's, if a checkpoint).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Instead of a checkpoint: parameters drawn at random, as `kiln bench` draws them (uniform,
    /// norm gains around 1; the same for every backend and with or without the optimizer).
    #[arg(long, conflicts_with = "weights")]
    random_weights: bool,
    /// The seed of `--random-weights`.
    #[arg(long, requires = "random_weights", default_value_t = 1)]
    seed: u64,
    /// Inputs (safetensors): `input_ids`, `attention_mask`, `token_type_ids`, or `src_ids`,
    /// `src_padding`, `tgt_ids`; other tensors are ignored.
    #[arg(long, conflicts_with = "input_ids")]
    inputs: Option<PathBuf>,
    /// Instead of `--inputs`: the token ids, comma-separated, a batch's sequences separated by
    /// `;` (`1,2,3;4,5,6`), all of one length; the mask and token types are defaulted (all
    /// tokens, type 0).
    #[arg(long, allow_hyphen_values = true)]
    input_ids: Option<String>,
    /// Where to write the outputs (`logits`, `last_hidden_state`, `sentence_embedding`); never
    /// one of the files read, and an existing file only with `--force`.
    #[arg(long, required_unless_present = "top")]
    output: Option<PathBuf>,
    /// Print the K largest logits of every position (token ids and values, and each token's text
    /// where a tokenizer is found: `--tokenizer`, a checkpoint's own, a GGUF's): what the model
    /// predicts next, without writing a file (`--output` as well writes them too).
    #[arg(long)]
    top: Option<usize>,
    /// The tokenizer that names `--top`'s tokens (default: the checkpoint's, or the GGUF's).
    #[arg(long, requires = "top")]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    force: crate::output::Force,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    exec: Exec,
}

impl RunArgs {
    /// The model file.
    pub fn model(&self) -> &Path {
        &self.model
    }

    /// Whether `--print-spec` was given.
    pub fn print_spec(&self) -> bool {
        self.exec.print_spec
    }
}

/// Where a model's parameters come from.
pub enum Params<'a> {
    /// A checkpoint file.
    Checkpoint(&'a Checkpoint),
    /// Drawn by `interp::random_params` from this seed (`--random-weights`).
    Random(u64),
}

/// Runs `kiln run`.
pub fn run(args: RunArgs, reporter: &Reporter) -> Result<()> {
    if args.inputs.is_none() && args.input_ids.is_none() {
        bail!("give the inputs: --inputs FILE (safetensors) or --input-ids 1,2,3 (token ids inline)");
    }
    let weights = match (args.weights.clone(), args.random_weights) {
        (None, true) => None,
        (None, false) if crate::model_file::default_weights(&args.model)?.is_none() => bail!(
            "give the weights: --weights CHECKPOINT, or --random-weights (a checkpoint directory or GGUF file \
             given as the model brings its own, and a spec can record them as `weights.path`)"
        ),
        (weights, _) => Some(crate::model_file::weights_for(weights, &args.model)?),
    };
    // An output that would replace an input, or that cannot be written, is refused before any work.
    let mut read = vec![("the model", args.model.as_path())];
    read.extend(weights.as_deref().map(|w| ("--weights", w)));
    read.extend(args.inputs.as_deref().map(|i| ("--inputs", i)));
    if let Some(output) = &args.output {
        crate::output::check("--output", output, &read, args.force.force)?;
    }
    if args.top == Some(0) {
        bail!("--top 0 prints nothing: give the number of logits to print per position (1 or more)");
    }
    // The tokenizer naming `--top`'s tokens: the one given, the checkpoint's, or the GGUF's.
    let tokenizer = match args.top {
        None => None,
        Some(_) => {
            let path = crate::model_file::tokenizer_for(args.tokenizer.clone(), &args.model)
                .or_else(|| weights.clone().filter(|w| crate::model_file::is_gguf(w).unwrap_or(false)));
            match (path, args.tokenizer.is_some()) {
                (Some(path), true) => Some(super::generate::open_tokenizer(&path, None)?),
                // One found beside the model names tokens where it can be read.
                (Some(path), false) => super::generate::open_tokenizer(&path, None).ok(),
                (None, _) => None,
            }
        }
    };
    let model = ModelFile::read(&args.model)?;
    let given = match (&args.inputs, &args.input_ids) {
        (Some(path), _) => kiln_runtime::read_tensors(path)?,
        (None, Some(ids)) => inline_inputs(&model.fe, ids)?,
        (None, None) => bail!("give the inputs: --inputs FILE or --input-ids 1,2,3"),
    };
    check_positions(&model.fe.spec, &given)?;
    let backend = args.exec.backend.resolve(args.exec.adapter.as_deref(), args.exec.threads()?, reporter, args.json);
    let ckpt = weights.as_deref().map(Checkpoint::open).transpose()?;
    // A spec that leaves part of the checkpoint unread runs, but not as the checkpoint's model.
    let warnings: Vec<String> = match (&ckpt, &weights) {
        (Some(ckpt), Some(path)) => {
            crate::model_file::unread_warning(path, &crate::model_file::unread_tensors(&model.fe, ckpt))
                .into_iter()
                .collect()
        }
        _ => Vec::new(),
    };
    if !args.json {
        for warning in &warnings {
            eprintln!("warning: {warning}");
        }
    }
    let params = match &ckpt {
        Some(ckpt) => Params::Checkpoint(ckpt),
        None => Params::Random(args.seed),
    };
    let outputs = execute(model, &params, &given, &args.exec, backend, reporter)?;
    if outputs.is_empty() {
        bail!("the model has no outputs");
    }
    let top = match args.top {
        Some(k) => {
            let (_, logits) = outputs
                .iter()
                .find(|(n, _)| n == "logits")
                .ok_or_else(|| anyhow::anyhow!("--top: the model has no `logits` output"))?;
            Some(top_logits(logits, k, tokenizer.as_ref())?)
        }
        None => None,
    };
    if let Some(output) = &args.output {
        kiln_runtime::write_tensors(output, &outputs)?;
    }
    print(args.output.as_deref(), &outputs, top.as_deref(), backend.name(), &warnings, args.json)
}

/// The `k` largest logits of one position: its sequence and position, then `(id, logit, the
/// token's text)` largest first (ties to the lower id).
struct Top {
    seq: usize,
    pos: usize,
    best: Vec<(usize, f32, Option<String>)>,
}

/// The `k` largest logits of every position of `logits` (`[batch, seq, vocab]`, or `[batch,
/// vocab]`), each token named by `tokenizer` where there is one.
fn top_logits(logits: &Tensor, k: usize, tokenizer: Option<&kiln_runtime::tokenize::Tokenizer>) -> Result<Vec<Top>> {
    let values = logits.as_f32().ok_or_else(|| anyhow::anyhow!("--top: the logits are not f32"))?;
    let (batch, vocab) = match logits.shape.as_slice() {
        [b, .., v] => (*b, *v),
        _ => bail!("--top: logits of shape {:?} have no vocabulary axis", logits.shape),
    };
    let positions = values.len() / (batch * vocab).max(1);
    let mut out = Vec::new();
    for (row, scores) in values.chunks(vocab.max(1)).enumerate() {
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let best = order
            .into_iter()
            .take(k)
            .map(|id| (id, scores[id], tokenizer.and_then(|t| t.decode(&[id as u32], false).ok())))
            .collect();
        out.push(Top { seq: row / positions.max(1), pos: row % positions.max(1), best });
    }
    Ok(out)
}

/// `kiln run`: the outputs written to `path`, and `--top`'s logits. JSON: `path` (`null`
/// without `--output`), `backend`, `outputs` (per output in the order written: `name`, `dtype`,
/// `shape`), `warnings` (what text mode says on stderr), and with `--top`, `top`: per position
/// `seq`, `pos`, `ids`, `logits` and `tokens` (`null` where no tokenizer names them).
fn print(
    path: Option<&Path>,
    outputs: &[(String, Tensor)],
    top: Option<&[Top]>,
    backend: &str,
    warnings: &[String],
    json: bool,
) -> Result<()> {
    if json {
        let outputs: Vec<serde_json::Value> = outputs
            .iter()
            .map(|(name, t)| json!({ "name": name, "dtype": t.dtype().to_string(), "shape": t.shape }))
            .collect();
        let top: Option<Vec<serde_json::Value>> = top.map(|top| {
            top.iter()
                .map(|t| {
                    json!({
                        "seq": t.seq, "pos": t.pos,
                        "ids": t.best.iter().map(|b| b.0).collect::<Vec<_>>(),
                        "logits": t.best.iter().map(|b| b.1).collect::<Vec<_>>(),
                        "tokens": t.best.iter().map(|b| b.2.clone()).collect::<Vec<_>>(),
                    })
                })
                .collect()
        });
        return print_json(&json!({
            "path": path.map(|p| p.display().to_string()), "backend": backend, "outputs": outputs,
            "warnings": warnings, "top": top,
        }));
    }
    for (name, t) in outputs {
        println!("{name}: {}{:?}", t.dtype(), t.shape);
    }
    for t in top.unwrap_or_default() {
        let best: Vec<String> = t
            .best
            .iter()
            .map(|(id, logit, token)| match token {
                Some(token) => format!("{id} {token:?} {logit:.3}"),
                None => format!("{id} {logit:.3}"),
            })
            .collect();
        println!("seq {} pos {}: {}", t.seq, t.pos, best.join(" | "));
    }
    if let Some(path) = path {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Runs a model file once on `given` on `backend` (resolved): a spec optimized for it unless
/// `--no-optimize`, an artifact's own plan as compiled.
pub fn execute(
    model: ModelFile,
    params: &Params,
    given: &HashMap<String, Tensor>,
    exec: &Exec,
    backend: Backend,
    reporter: &Reporter,
) -> Result<Vec<(String, Tensor)>> {
    Ok(load(model, params, exec, backend, reporter)?.run(given)?)
}

/// Loads a model file on `backend` (resolved), to be run any number of times on inputs of any
/// batch and length: a spec optimized for it unless `--no-optimize`, an artifact's own plan as
/// compiled. The loaded model owns its weights (`params` is only read).
pub fn load(model: ModelFile, params: &Params, exec: &Exec, backend: Backend, reporter: &Reporter) -> Result<Loaded> {
    check_exec(exec, backend)?;
    let quantized = match params {
        Params::Checkpoint(ckpt) => ckpt.gguf().is_some(),
        Params::Random(_) => false,
    };
    if !quantized {
        let what = match params {
            Params::Checkpoint(ckpt) => format!("`{}` (safetensors)", ckpt.path().display()),
            Params::Random(_) => "random weights".into(),
        };
        crate::exec::check_blocks(exec.weights, &what)?;
    }
    // Random parameters are drawn for the graph as built, so that they are the same whatever the
    // optimizer makes of it (and for an artifact, the same as for its spec).
    let random = match params {
        Params::Random(seed) => interp::random_params(&model.fe.graph, *seed)?,
        Params::Checkpoint(_) => HashMap::new(),
    };
    let given_random = Weights::Given { params: &random, blocks: &HashMap::new() };
    let Some(art) = model.artifact else {
        let FrontEnd { spec, mut graph } = model.fe;
        let device = exec.device(backend)?;
        if !exec.no_optimize {
            let target = optimizer_target(&device, reporter)?;
            graph = reporter.stage("optimizing", || optimize::optimize_for(&graph, &target))?.0;
        }
        let weights = match params {
            Params::Checkpoint(ckpt) => Weights::Checkpoint(Reading::of(&spec, ckpt)),
            Params::Random(_) => given_random,
        };
        return Ok(device.load(&graph, weights, exec.weights.storage(), reporter)?);
    };
    if exec.no_optimize {
        bail!(
            "--no-optimize has no effect on an artifact: its plan was compiled by `kiln compile` (give --no-optimize there, or run the spec)"
        );
    }
    if exec.weights.storage().precision.f16() {
        bail!(
            "an artifact's plan stores its weights as f32; run the spec to use --precision {}",
            exec.weights.storage().precision.name()
        );
    }
    let weights = match params {
        Params::Checkpoint(ckpt) => Weights::Checkpoint(Reading { ckpt, map: &art.weights, dims: art.pack_dims }),
        Params::Random(_) => given_random,
    };
    // The artifact's own plan; on the interpreter, each step by the interpreter's definition.
    let device = exec.device(backend)?;
    Ok(Loaded::Model(device.load_plan(art.plan, weights, Storage::default(), reporter)?))
}

/// `--input-ids`: `1,2,3;4,5,6` as the model's token-id input (`[2, 3]`).
fn inline_inputs(fe: &FrontEnd, text: &str) -> Result<HashMap<String, Tensor>> {
    let ids = fe.graph.inputs().into_iter().map(|(_, name, _)| name.to_string()).collect::<Vec<_>>();
    if !ids.iter().any(|n| n == "input_ids") {
        bail!(
            "--input-ids gives `input_ids`, which `{}` does not take (its inputs: {}); give them with --inputs",
            fe.graph.name,
            ids.join(", ")
        );
    }
    Ok(HashMap::from([("input_ids".to_string(), parse_ids(text)?)]))
}

/// `1,2,3;4,5,6` -> an i64 tensor `[2, 3]`.
pub fn parse_ids(text: &str) -> Result<Tensor> {
    let mut rows: Vec<Vec<i64>> = Vec::new();
    for (r, row) in text.split(';').enumerate() {
        if row.trim().is_empty() {
            bail!("--input-ids: sequence {} is empty", r + 1);
        }
        let ids = row
            .split(',')
            .map(|t| {
                t.trim()
                    .parse::<i64>()
                    .map_err(|_| anyhow!("--input-ids: `{}` (sequence {}) is not a token id", t.trim(), r + 1))
            })
            .collect::<Result<Vec<i64>>>()?;
        if let Some(first) = rows.first()
            && first.len() != ids.len()
        {
            bail!(
                "--input-ids: sequence {} has {}, the first has {}: the sequences of a batch have one length (for padding, give a mask with --inputs)",
                r + 1,
                crate::report::count(ids.len(), "id"),
                first.len()
            );
        }
        rows.push(ids);
    }
    let (batch, seq) = (rows.len(), rows[0].len());
    Ok(Tensor::i64(vec![batch, seq], rows.concat()))
}

/// Refuses sequences longer than the spec's `max_positions`, whatever its positional scheme (a
/// learned table would refuse them too, but RoPE, ALiBi and the others would run on).
pub fn check_positions(spec: &Resolved, given: &HashMap<String, Tensor>) -> Result<()> {
    let max = spec.spec.model.max_positions;
    for name in ["input_ids", "src_ids", "tgt_ids"] {
        if let Some(t) = given.get(name)
            && let Some(&seq) = t.shape.get(1)
            && seq as u64 > max
        {
            bail!(
                "input `{name}` has {} per sequence, more than the model's `max_positions` = {max}",
                crate::report::count(seq, "token")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_as_a_batch() {
        let t = parse_ids("1,2,3; 4, 5,6").unwrap();
        assert_eq!(t.shape, [2, 3]);
        assert_eq!(t.as_i64().unwrap(), [1, 2, 3, 4, 5, 6]);
        assert!(parse_ids("1,2;3").unwrap_err().to_string().contains("sequence 2 has 1 id, the first has 2"));
        assert!(parse_ids("1,x").unwrap_err().to_string().contains("`x` (sequence 1) is not a token id"));
        assert!(parse_ids("1;").unwrap_err().to_string().contains("sequence 2 is empty"));
    }
}
