//! `kiln plot`: training runs' loss curves (`kiln train --log` files) drawn together, as SVG, or
//! as PNG rasterized from the SVG by librsvg's `rsvg-convert` (as `inspect` has Graphviz draw).

use crate::curves::{Run, svg};
use anyhow::{Context, Result, anyhow, bail};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Arguments of `kiln plot`.
#[derive(clap::Args)]
pub struct PlotArgs {
    /// Training logs (`kiln train --log`), one curve each, named after the file.
    #[arg(required = true)]
    logs: Vec<PathBuf>,
    /// Where to write the picture: `*.svg`, or `*.png` (needs `rsvg-convert`, from Debian's
    /// `librsvg2-bin`).
    #[arg(short, long)]
    output: PathBuf,
    #[command(flatten)]
    force: crate::output::Force,
    /// The chart's title.
    #[arg(long, default_value = "training loss")]
    title: String,
    /// Draw each training curve as the mean of this many steps.
    #[arg(long, default_value_t = 1)]
    smooth: usize,
}

/// Runs `kiln plot`.
pub fn run(args: PlotArgs) -> Result<()> {
    let ext = args.output.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
    let png = match ext.as_deref() {
        Some("svg") => false,
        Some("png") => true,
        _ => bail!("`{}`: kiln plot writes SVG or PNG (name the file `*.svg` or `*.png`)", args.output.display()),
    };
    let runs = args.logs.iter().map(|p| Run::read(p)).collect::<Result<Vec<_>>>()?;
    let logs: Vec<(&str, &Path)> = args.logs.iter().map(|p| ("a log", p.as_path())).collect();
    crate::output::check("--output", &args.output, &logs, args.force.force)?;
    let picture = svg(&runs, &args.title, args.smooth).into_bytes();
    let bytes = if png { rasterize(&picture)? } else { picture };
    kiln_compiler::file::write_atomic(&args.output, &bytes)
        .with_context(|| format!("cannot write `{}`", args.output.display()))?;
    Ok(())
}

/// The PNG of an SVG, by `rsvg-convert` (SVG on its standard input, PNG on its output).
fn rasterize(svg: &[u8]) -> Result<Vec<u8>> {
    let spawned = Command::new("rsvg-convert")
        .args(["--format", "png", "--zoom", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "PNG needs librsvg's `rsvg-convert` (`apt-get install librsvg2-bin`), which is not on the PATH; \
             or write `*.svg`"
        ),
        Err(e) => return Err(e).context("cannot run `rsvg-convert`"),
    };
    // Written from a thread, so that a full output pipe cannot stall the input.
    let mut stdin = child.stdin.take().context("rsvg-convert's input")?;
    let input = svg.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().context("running `rsvg-convert`")?;
    writer.join().map_err(|_| anyhow!("writing to `rsvg-convert` panicked"))?.context("writing to `rsvg-convert`")?;
    if !out.status.success() || !out.stdout.starts_with(b"\x89PNG") {
        bail!("`rsvg-convert` failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(out.stdout)
}
