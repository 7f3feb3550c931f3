//! Shared test support. GPU requirement lives here, in one place: tests that run kernels call
//! [`gpu`], which opens the adapter once per test binary. Without an adapter those tests fail with
//! the install hint — CI installs Mesa's lavapipe — unless `KILN_SKIP_GPU=1` says to skip them.
#![allow(dead_code)]

use kiln_compiler::{FrontEnd, front_end};
use kiln_runtime::Gpu;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The device for GPU tests, or `None` when `KILN_SKIP_GPU=1` and no adapter is present.
pub fn gpu() -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Result<Arc<Gpu>, String>> = OnceLock::new();
    let gpu = GPU.get_or_init(|| Gpu::new(None).map(Arc::new).map_err(|e| e.to_string()));
    match gpu {
        Ok(g) => Some(g.clone()),
        Err(e) if std::env::var("KILN_SKIP_GPU").is_ok_and(|v| v == "1") => {
            eprintln!("skipping GPU test (KILN_SKIP_GPU=1): {e}");
            None
        }
        Err(e) => panic!("GPU tests need an adapter: {e}"),
    }
}

/// A separate device whose buffers are capped at `bytes`, so tensors above it are split.
pub fn gpu_with_buffer_limit(bytes: u64) -> Option<Arc<Gpu>> {
    gpu()?;
    let mut g = Gpu::new(None).expect("an adapter was found above");
    g.limit_buffer_bytes(bytes);
    Some(Arc::new(g))
}

/// Where `scripts/fetch-models` caches real models.
pub fn data_dir() -> PathBuf {
    kiln_runtime::data_dir().expect("KILN_DATA, XDG_CACHE_HOME or HOME is set")
}

/// Fetches a real model with the project script if it is not cached yet (the one network access
/// of the test suite, documented in the README).
pub fn fetched(model: &str, dir: &str, file: &str) -> PathBuf {
    let path = data_dir().join(dir).join(file);
    if !path.exists() {
        let status = std::process::Command::new("bash")
            .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fetch-models"))
            .arg(model)
            .status()
            .expect("bash runs");
        assert!(status.success(), "scripts/fetch-models {model} failed");
    }
    path
}

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The front end of `models/{name}.toml`.
pub fn spec(name: &str) -> FrontEnd {
    let path = format!("models/{name}.toml");
    let source = std::fs::read_to_string(root().join(&path)).expect("spec exists");
    front_end(&path, &source).unwrap_or_else(|e| panic!("{}", e.render()))
}

/// Projections covering the kernel's forms and epilogues: plain; GELU with bias and residual; a
/// LayerNorm prologue; a gated SiLU with an RMSNorm prologue; a RoPE epilogue.
pub fn projection_ops() -> Vec<kiln_compiler::graph::Op> {
    use kiln_compiler::graph::{Activation, PairStyle};
    use kiln_compiler::graph::{Op, Prologue, RopeCols, Scalar};
    let rms = Some(Prologue { rms: true, eps: Scalar(1e-6), bias: false });
    let layer = Some(Prologue { rms: false, eps: Scalar(1e-5), bias: true });
    let rope = RopeCols {
        theta: Scalar(10000.0),
        rotary_dim: 8,
        style: PairStyle::RotateHalf,
        head_dim: 8,
        start: 4,
        len: 16,
    };
    vec![
        Op::linear(None, false, false),
        Op::linear(Some(Activation::Gelu), true, true),
        Op::Linear { act: None, bias: true, residual: false, norm: layer, glu: false, rope: None },
        Op::Linear { act: Some(Activation::Silu), bias: false, residual: true, norm: rms, glu: true, rope: None },
        Op::Linear { act: None, bias: true, residual: true, norm: rms, glu: false, rope: Some(rope) },
        // Whole `vec4` pairs (the `vec4` forms): a partial rotate-half rotation of heads of 16, and
        // interleaved pairs.
        Op::Linear {
            act: None,
            bias: true,
            residual: false,
            norm: rms,
            glu: false,
            rope: Some(RopeCols { rotary_dim: 8, head_dim: 16, start: 8, len: 16, ..rope }),
        },
        Op::Linear {
            act: None,
            bias: false,
            residual: true,
            norm: None,
            glu: false,
            rope: Some(RopeCols {
                theta: Scalar(500.0),
                rotary_dim: 4,
                style: PairStyle::Interleaved,
                head_dim: 8,
                start: 0,
                len: 24,
            }),
        },
    ]
}

/// Feeds `session` the prompt and then each token of `continuation`, one at a time, and requires
/// the logits of every step within 1e-4 of the interpreter recomputing `graph` on the tokens so
/// far: cached decoding equals recomputation. `what` names the case in the failure.
pub fn check_cached_steps(
    what: &str,
    session: &mut kiln_runtime::generate::Session,
    graph: &kiln_compiler::graph::Graph,
    params: &std::collections::HashMap<String, kiln_compiler::tensor::Tensor>,
    prompt: &[i64],
    continuation: &[i64],
) {
    use kiln_compiler::tensor::Tensor;
    let mut seq = prompt.to_vec();
    let mut cached = session.forward(prompt).unwrap();
    for &next in continuation {
        let inputs =
            std::collections::HashMap::from([("input_ids".to_string(), Tensor::i64(vec![1, seq.len()], seq.clone()))]);
        let full = kiln_compiler::interp::run(graph, params, &inputs).unwrap();
        let logits = &full.iter().find(|(n, _)| n == "logits").unwrap().1;
        let vocab = *logits.shape.last().unwrap();
        let last = &logits.as_f32().unwrap()[(seq.len() - 1) * vocab..];
        let err = last.iter().zip(&cached).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-4, "{what}: cached logits at position {} differ by {err}", seq.len() - 1);
        seq.push(next);
        cached = session.forward(&[next]).unwrap();
    }
}

/// Runs the kiln binary from the repository root. The child gets no display session
/// (`XDG_RUNTIME_DIR` unset), as on CI, so a test that wants a quiet stderr also proves that
/// kiln keeps the Vulkan layers' display probing off it.
pub fn kiln(args: &[&str]) -> std::process::Output {
    kiln_command(args).output().expect("kiln runs")
}

/// Runs kiln as [`kiln`] does with `input` on its standard input (what it reads of it: a command
/// that fails before reading closes the pipe, which is not the caller's failure).
pub fn with_stdin(args: &[&str], input: &str) -> std::process::Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = kiln_command(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kiln runs");
    let _ = child.stdin.take().expect("stdin is piped").write_all(input.as_bytes());
    child.wait_with_output().expect("kiln runs")
}

/// The command [`kiln`] runs (from the repository root, no display session), to change its
/// directory or environment before running it.
pub fn kiln_command(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"));
    command.args(args).current_dir(root()).env_remove("XDG_RUNTIME_DIR").env_remove("NODEVICE_SELECT");
    command
}

/// A child's standard output, as text.
pub fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A child's standard error, as text.
pub fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs kiln, requires success, and returns its standard output.
pub fn ok(args: &[&str]) -> String {
    let o = kiln(args);
    assert!(o.status.success(), "kiln {args:?} failed:\n{}", stderr(&o));
    stdout(&o)
}

/// Runs kiln and requires a clean failure — kiln's own (exit 1) or clap's usage error (exit 2),
/// no panic — with every `needle` in its stderr. Returns the exit status.
pub fn failure(args: &[&str], needles: &[&str]) -> i32 {
    let o = kiln(args);
    let err = stderr(&o);
    let code = o.status.code();
    assert!(matches!(code, Some(1 | 2)), "kiln {args:?} should fail cleanly; stderr:\n{err}");
    assert!(!err.contains("panicked"), "kiln {args:?} panicked:\n{err}");
    for needle in needles {
        assert!(err.contains(needle), "kiln {args:?}: stderr lacks {needle:?}:\n{err}");
    }
    code.unwrap_or_default()
}

/// Runs kiln and requires kiln's own clean failure (exit 1) with every `needle` in its stderr.
pub fn fails_with(args: &[&str], needles: &[&str]) {
    assert_eq!(failure(args, needles), 1, "kiln {args:?}: a usage error where kiln's own was expected");
}

/// A scratch directory for one test, `name` unique within its test binary. Every one a test
/// binary made is removed when it exits, unless a test failed (for a look at what it left).
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    scratch_cleanup::register(&dir);
    dir
}

/// Removing the scratch directories at exit: the suite left ~1.6 GB in the temporary directory a
/// run before (a fine-tuned SmolLM2 among them). A test's directory may outlive its `scratch`
/// call's value (helpers return paths inside it) and be shared by tests of one binary, so they
/// go when the binary ends, through the C library's `atexit`, which runs after the harness's last
/// test. A panic anywhere (a failed test) keeps them all.
mod scratch_cleanup {
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    static FAILED: AtomicBool = AtomicBool::new(false);

    pub fn register(dir: &Path) {
        static INSTALL: std::sync::Once = std::sync::Once::new();
        INSTALL.call_once(|| {
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                FAILED.store(true, Ordering::Relaxed);
                report(info);
            }));
            #[cfg(unix)]
            // SAFETY: `remove` is an `extern "C" fn()` that touches only statics and the file
            // system; registering it once is what `atexit` is for.
            unsafe {
                libc::atexit(remove);
            }
        });
        let mut dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
        if !dirs.iter().any(|d| d == dir) {
            dirs.push(dir.to_path_buf());
        }
    }

    #[cfg(unix)]
    extern "C" fn remove() {
        if FAILED.load(Ordering::Relaxed) {
            return;
        }
        let dirs = DIRS.lock().map(|d| d.clone()).unwrap_or_default();
        for dir in dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The Rust sources under each of `dirs` (relative to the repository root), recursively, with
/// their text.
pub fn sources(dirs: &[&str]) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for dir in dirs {
        let mut stack = vec![root().join(dir)];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let p = entry.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    out.push((p, text));
                }
            }
        }
    }
    assert!(!out.is_empty(), "no sources under {dirs:?}");
    out
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF (fetched if need be), its spec's front end, and the
/// reference's prompt ids, greedy continuation and whole reference file
/// (`tests/fixtures/smollm2-135m/reference.safetensors`).
pub struct Smollm2 {
    pub weights: PathBuf,
    pub fe: FrontEnd,
    pub prompt: Vec<i64>,
    pub expected: Vec<i64>,
    pub reference: std::collections::HashMap<String, kiln_compiler::tensor::Tensor>,
}

/// See [`Smollm2`].
pub fn smollm2() -> Smollm2 {
    let weights = fetched("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
    let fe = spec("smollm2-135m");
    let reference =
        kiln_runtime::read_tensors(&root().join("tests/fixtures/smollm2-135m/reference.safetensors")).unwrap();
    let prompt = reference["prompt_ids"].as_i64().unwrap().to_vec();
    let expected = reference["greedy_ids"].as_i64().unwrap().to_vec();
    Smollm2 { weights, fe, prompt, expected, reference }
}
