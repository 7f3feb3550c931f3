//! `kiln plot`: training runs' loss curves (`kiln train --log` files) drawn together as SVG.

use crate::curves::{Run, svg};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// Arguments of `kiln plot`.
#[derive(clap::Args)]
pub struct PlotArgs {
    /// Training logs (`kiln train --log`), one curve each, named after the file.
    #[arg(required = true)]
    logs: Vec<PathBuf>,
    /// Where to write the SVG.
    #[arg(short, long)]
    output: PathBuf,
    /// The chart's title.
    #[arg(long, default_value = "training loss")]
    title: String,
    /// Draw each training curve as the mean of this many steps.
    #[arg(long, default_value_t = 1)]
    smooth: usize,
}

/// Runs `kiln plot`.
pub fn run(args: PlotArgs) -> Result<()> {
    if args.output.extension().is_none_or(|e| !e.eq_ignore_ascii_case("svg")) {
        bail!("`{}`: kiln plot writes SVG (name the file `*.svg`)", args.output.display());
    }
    let runs = args.logs.iter().map(|p| Run::read(p)).collect::<Result<Vec<_>>>()?;
    kiln_compiler::file::write_atomic(&args.output, svg(&runs, &args.title, args.smooth).as_bytes())
        .with_context(|| format!("cannot write `{}`", args.output.display()))?;
    Ok(())
}
