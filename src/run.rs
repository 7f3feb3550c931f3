//! `kiln run`: a spec (compiled in memory) or an artifact run once on inputs from a safetensors
//! file or given inline (`--input-ids`), with a checkpoint's weights or random ones
//! (`--random-weights`), its outputs written to a safetensors file. What `embed` shares with it:
//! running a model file on a backend ([`execute`]), and refusing the execution flags that would
//! have no effect ([`check_exec`]).

use crate::progress::Reporter;
use crate::{Backend, Exec, load_f32, plan_params, run_compiled, storage};
use anyhow::{Context, Result, anyhow, bail};
use kiln_compiler::artifact::Artifact;
use kiln_compiler::spec::{PackDims, Resolved};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{FrontEnd, interp, optimize};
use kiln_runtime::Checkpoint;
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
    #[arg(long, required_unless_present = "input_ids", conflicts_with = "input_ids")]
    inputs: Option<PathBuf>,
    /// Instead of `--inputs`: the token ids, comma-separated, a batch's sequences separated by
    /// `;` (`1,2,3;4,5,6`), all of one length; the mask and token types are defaulted (all
    /// tokens, type 0).
    #[arg(long, allow_hyphen_values = true)]
    input_ids: Option<String>,
    /// Where to write the outputs (`logits`, `last_hidden_state`, `sentence_embedding`).
    #[arg(long)]
    output: PathBuf,
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

/// A model file as `run` and `embed` read it: its spec's front end (an artifact's from the spec it
/// stores) and, for an artifact, the artifact, whose plan is what runs.
pub struct ModelFile {
    /// The spec, checked, and its unoptimized graph.
    pub fe: FrontEnd,
    /// The artifact, when the file is one.
    pub artifact: Option<Artifact>,
}

impl ModelFile {
    /// Reads a spec or an artifact (told apart by the artifact's magic).
    pub fn read(path: &Path) -> Result<ModelFile> {
        if Artifact::sniff(path) {
            let artifact = Artifact::read(path)?;
            let fe = kiln_compiler::front_end(&artifact.spec_file, &artifact.spec_source)?;
            return Ok(ModelFile { fe, artifact: Some(artifact) });
        }
        Ok(ModelFile { fe: crate::load_spec(path)?, artifact: None })
    }
}

/// Runs `kiln run`.
pub fn run(args: RunArgs, reporter: &Reporter) -> Result<()> {
    // An output that cannot be written is refused before any work.
    kiln_compiler::file::check_writable(&args.output)
        .with_context(|| format!("cannot write the outputs to `{}`", args.output.display()))?;
    let model = ModelFile::read(&args.model)?;
    let given = match (&args.inputs, &args.input_ids) {
        (Some(path), _) => kiln_runtime::read_tensors(path)?,
        (None, Some(ids)) => inline_inputs(&model.fe, ids)?,
        (None, None) => bail!("give the inputs: --inputs FILE or --input-ids 1,2,3"),
    };
    check_positions(&model.fe.spec, &given)?;
    let backend = args.exec.backend.resolve(args.exec.adapter.as_deref(), args.exec.threads()?, reporter, args.json);
    let weights = match (args.weights.clone(), args.random_weights) {
        (None, true) => None,
        (None, false) if !kiln_runtime::import::is_checkpoint(&args.model) => bail!(
            "give the weights: --weights CHECKPOINT, or --random-weights (a checkpoint directory or GGUF file \
             given as the model brings its own)"
        ),
        (weights, _) => Some(crate::import::weights_for(weights, &args.model)?),
    };
    let ckpt = weights.as_deref().map(Checkpoint::open).transpose()?;
    let params = match &ckpt {
        Some(ckpt) => Params::Checkpoint(ckpt),
        None => Params::Random(args.seed),
    };
    let outputs = execute(model, &params, &given, &args.exec, backend, reporter)?;
    if outputs.is_empty() {
        bail!("the model has no outputs");
    }
    kiln_runtime::write_tensors(&args.output, &outputs)?;
    crate::report::run(&args.output, &outputs, backend.name(), args.json)
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
        storage::check_blocks(exec.weights, &what)?;
    }
    // Random parameters are drawn for the graph as built, so that they are the same whatever the
    // optimizer makes of it (and for an artifact, the same as for its spec).
    let random = match params {
        Params::Random(seed) => Some(interp::random_params(&model.fe.graph, *seed)?),
        Params::Checkpoint(_) => None,
    };
    let Some(art) = model.artifact else {
        let FrontEnd { spec, mut graph } = model.fe;
        if !exec.no_optimize {
            let target = backend.optimizer_target(exec.adapter.as_deref(), reporter)?;
            graph = reporter.stage("optimizing", || optimize::optimize_for(&graph, &target))?.0;
        }
        return Ok(match (backend, params, random) {
            (Backend::Interp, _, Some(random)) => interp::run(&graph, &random, given).context("run failed")?,
            (Backend::Interp, Params::Checkpoint(ckpt), _) => {
                let names = kiln_runtime::weights::graph_params(&graph);
                let params = load_f32(&spec.weights, &PackDims::of(&spec), &names, ckpt, reporter)?;
                interp::run(&graph, &params, given).context("run failed")?
            }
            (_, Params::Checkpoint(ckpt), _) => run_compiled(&spec, &graph, ckpt, given, exec, backend, reporter)?,
            (_, _, random) => {
                let target = storage::Target::new(backend, exec.adapter.as_deref(), exec.threads()?)?;
                let random = random.unwrap_or_default();
                target.model(&graph, &random, &HashMap::new(), exec.weights, reporter)?.run(given)?
            }
        });
    };
    if exec.no_optimize {
        bail!(
            "--no-optimize has no effect on an artifact: its plan was compiled by `kiln compile` (give --no-optimize there, or run the spec)"
        );
    }
    if exec.weights.precision != storage::Precision::F32 {
        bail!(
            "an artifact's plan stores its weights as f32; run the spec to use --precision {}",
            exec.weights.precision.name()
        );
    }
    let names = plan_params(&art.plan);
    let params = match (params, random) {
        (Params::Checkpoint(ckpt), _) => load_f32(&art.weights, &art.pack_dims, &names, ckpt, reporter)?,
        (_, random) => random.unwrap_or_default(),
    };
    Ok(match backend {
        Backend::Wgpu => crate::run_plan_wgpu(art.plan, &params, given, exec.adapter.as_deref(), reporter)?,
        Backend::Cpu | Backend::Auto => {
            kiln_runtime::CpuModel::new(art.plan, &params, &HashMap::new(), exec.threads()?, reporter)?.run(given)?
        }
        // The artifact's own plan, each step by the interpreter's definition.
        Backend::Interp => kiln_runtime::CpuModel::reference(art.plan, params, reporter)?.run(given)?,
    })
}

/// Refuses the execution flags that would have no effect on `backend` (resolved), naming why.
pub fn check_exec(exec: &Exec, backend: Backend) -> Result<()> {
    let on = backend.name();
    if exec.threads.is_some() && backend != Backend::Cpu {
        bail!(
            "--threads sets the CPU backend's threads, but this runs on `{on}`: add --backend cpu, or drop --threads"
        );
    }
    if exec.adapter.is_some() && backend != Backend::Wgpu {
        bail!("--adapter picks wgpu's GPU adapter, but this runs on `{on}`: drop --adapter or --backend");
    }
    if backend == Backend::Interp {
        let w = exec.weights;
        if w.precision != storage::Precision::F32 {
            bail!(
                "--precision {} stores weights for wgpu; the interpreter computes with f32 weights",
                w.precision.name()
            );
        }
        if w.dequantize {
            bail!("--dequantize has no effect on the interpreter, which always reads weights as f32");
        }
        if w.int8_activations {
            bail!("--int8-activations is the CPU backend's; the interpreter computes in f32");
        }
    }
    Ok(())
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
