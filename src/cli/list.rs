//! `kiln list`: the specs built into kiln, addressable by name from any directory, and for the
//! real models whether their weights are fetched.

use crate::models;
use anyhow::Result;

/// Arguments of `kiln list`.
#[derive(clap::Args)]
pub struct ListArgs {
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// Runs `kiln list`: a line per built-in spec, its name, kind and first comment line; a real
/// model's line says where its weights are, or how to fetch them.
pub fn run(args: ListArgs) -> Result<()> {
    let fetchable = models::fetchable()?;
    let data = models::data_dir().ok();
    let mut rows = Vec::new();
    for (name, source) in models::SPECS {
        let about = source.lines().next().and_then(|l| l.strip_prefix("# ")).unwrap_or("").to_string();
        let kind = kiln_compiler::spec::parse_spec(source)
            .ok()
            .and_then(|(s, _)| serde_json::to_value(s.model.kind).ok()?.as_str().map(str::to_string))
            .unwrap_or_default();
        let weights = fetchable.get(*name).map(|f| {
            let path = data.as_ref().map(|d| d.join(name).join(&f.weights));
            (path.as_ref().is_some_and(|p| p.is_file()), path)
        });
        rows.push((name, kind, about, weights));
    }
    if args.json {
        let items: Vec<serde_json::Value> = rows
            .iter()
            .map(|(name, kind, about, weights)| {
                serde_json::json!({
                    "name": name,
                    "kind": kind,
                    "about": about,
                    "fetchable": weights.is_some(),
                    "fetched": weights.as_ref().is_some_and(|(fetched, _)| *fetched),
                    "weights": weights.as_ref().and_then(|(_, p)| p.as_ref().map(|p| p.display().to_string())),
                })
            })
            .collect();
        return crate::report::print_json(&serde_json::json!({ "specs": items }));
    }
    let width = rows.iter().map(|(n, ..)| n.len()).max().unwrap_or(0);
    for (name, kind, about, weights) in &rows {
        println!("{name:<width$}  {kind:<15}  {about}");
        match weights {
            Some((true, Some(path))) => println!("{:<width$}  weights: {}", "", path.display()),
            Some(_) => println!("{:<width$}  weights: not fetched (`kiln fetch {name}`)", ""),
            None => {}
        }
    }
    Ok(())
}
