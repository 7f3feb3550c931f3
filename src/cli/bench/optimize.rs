//! `kiln bench optimize`: the optimizer's time on a spec and on copies of it at other depths.

use super::SpecArgs;
use anyhow::{Context, Result, bail};
use kiln_compiler::optimize;
use std::time::Instant;

/// Arguments of `kiln bench optimize`.
#[derive(clap::Args)]
pub struct OptimizeArgs {
    #[command(flatten)]
    spec: SpecArgs,
    /// The depths (`--layers 30,96`): copies of the spec with only `layers` changed.
    #[arg(long, value_delimiter = ',', required = true)]
    layers: Vec<u32>,
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `kiln bench optimize`.
pub fn run(args: OptimizeArgs) -> Result<()> {
    let (name, source) = args.spec.source()?;
    optimize_time(&source, &name, &args.layers, args.json)
}

/// Optimize time of a spec and of copies of it `layers` deep (the rest of the spec unchanged).
fn optimize_time(spec_source: &str, path: &str, depths: &[u32], json: bool) -> Result<()> {
    let mut rows = Vec::new();
    for &layers in depths {
        let mut doc: toml::Table = toml::from_str(spec_source).context("the spec is not TOML")?;
        let Some(toml::Value::Table(model)) = doc.get_mut("model") else { bail!("the spec has no [model] table") };
        model.insert("layers".into(), toml::Value::Integer(layers.into()));
        let text = toml::to_string(&doc)?;
        let fe = kiln_compiler::front_end(path, &text)?;
        let t = Instant::now();
        let (_, report) = optimize::optimize(&fe.graph)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        rows.push((layers, ms, report.egraph_nodes, report.dispatches));
    }
    if json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|(l, ms, n, d)| serde_json::json!({"layers": l, "optimize_ms": ms, "egraph_nodes": n, "dispatches": {"unoptimized": d.0, "optimized": d.1}}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("  {:>6} {:>12} {:>12} {:>22}", "layers", "optimize ms", "e-nodes", "dispatches");
        for (l, ms, n, d) in rows {
            println!("  {l:>6} {ms:>12.1} {n:>12} {:>22}", format!("{} -> {}", d.0, d.1));
        }
    }
    Ok(())
}
