//! The files a command writes (`--output`, `-o`, `--html`): refused before any work when one is
//! a file the same command reads (compared as canonical paths, so `./a.toml` and `a.toml` are one
//! file), or exists already and `--force` was not given, as cargo and llama.cpp refuse. Writing
//! itself is atomic (`kiln_compiler::file::write_atomic`): a failed write leaves the previous
//! file whole.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};

/// `--force`: replace an output file that exists.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Force {
    /// Replace the output file if it exists (without this, an existing file is refused).
    #[arg(long)]
    pub force: bool,
}

/// Refuses to write `output` (given as `flag`, e.g. `--output`) when it is one of `inputs` (each
/// named as the command line names it: `the model`, `--weights`), or when it exists as a regular
/// file and `force` is false; then checks that it can be written. A device (`/dev/null`) is
/// never refused for existing.
pub fn check(flag: &str, output: &Path, inputs: &[(&str, &Path)], force: bool) -> Result<()> {
    let target = canonical(output);
    for (what, input) in inputs {
        if canonical(input) == target {
            bail!(
                "{flag} `{}` is {what} `{}` that this command reads: writing it would destroy an input; \
                 choose another path",
                output.display(),
                input.display()
            );
        }
    }
    if !force && std::fs::metadata(output).is_ok_and(|m| m.is_file()) {
        bail!("{flag} `{}` exists; pass --force to replace it", output.display());
    }
    kiln_compiler::file::check_writable(output).with_context(|| format!("cannot write `{}`", output.display()))
}

/// `path` as an absolute path with links resolved; one that does not exist (yet) by its parent's
/// canonical path, so that an output to be created compares with the inputs.
fn canonical(path: &Path) -> PathBuf {
    if let Ok(path) = std::fs::canonicalize(path) {
        return path;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match (std::fs::canonicalize(parent), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_and_existing_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("kiln-output-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let spec = dir.join("a.toml");
        kiln_compiler::file::write_atomic(&spec, b"x").unwrap();
        let dotted = dir.join(".").join("a.toml");
        let err = check("--output", &dotted, &[("the model", &spec)], true).unwrap_err().to_string();
        assert!(err.contains("is the model") && err.contains("a.toml"), "{err}");
        let err = check("-o", &spec, &[], false).unwrap_err().to_string();
        assert!(err.ends_with("exists; pass --force to replace it"), "{err}");
        check("-o", &spec, &[], true).unwrap();
        check("-o", &dir.join("new.toml"), &[("the model", &spec)], false).unwrap();
        check("-o", Path::new("/dev/null"), &[], false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
