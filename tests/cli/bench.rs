//! `kiln bench`'s figures as a user reads them: the spread of the timed runs beside the median,
//! counts of zero refused, and what a calibration off wgpu does with its figures.

use crate::common::{fails_with, kiln, ok, stderr, stdout};

/// Parses stdout as one JSON document.
fn json(args: &[&str]) -> serde_json::Value {
    let out = ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("kiln {args:?}: not one JSON document ({e}):\n{out}"))
}

/// A timed figure's fastest, median and slowest runs are all given, in order.
fn spread(v: &serde_json::Value, key: &str) {
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("no `{k}` in {v}"));
    let (min, median, max) = (f(&format!("{key}_min")), f(key), f(&format!("{key}_max")));
    assert!(min <= median && median <= max, "{key}: {min} {median} {max}");
}

/// `bench forward` and `bench decode` give the fastest and slowest runs beside the median (one
/// noisy run is then seen as noise), in text and JSON, keeping the JSON fields other tools read.
#[test]
fn bench_prints_the_spread_of_its_runs() {
    let small = ["models/llama.toml", "--backend", "cpu", "--runs", "3", "-q"];
    let v = json(&[&["bench", "forward"][..], &small, &["--seq", "4", "--json"]].concat());
    for variant in v["variants"].as_array().unwrap() {
        spread(variant, "forward_ms");
    }
    let text = ok(&[&["bench", "forward"][..], &small, &["--seq", "4"]].concat());
    assert!(text.contains("median of 3 runs, and its fastest..slowest") && text.contains("min..max ms"), "{text}");
    let v = json(&[&["bench", "decode"][..], &small, &["--seq", "4", "--steps", "2", "--json"]].concat());
    spread(&v, "prefill_tok_s");
    spread(&v, "decode_tok_s");
    let text = ok(&[&["bench", "decode"][..], &small, &["--seq", "4", "--steps", "2"]].concat());
    assert!(text.contains("decode 2 steps:") && text.contains(".."), "{text}");
    assert!(v["host_us_per_step"].is_null(), "the CPU back end's time is all the host's: {v}");
}

/// An encoder-decoder's `bench decode`: its source encoded, then decoded from the start token, on
/// every engine (it once failed for want of the encoder's memory); `--batch` refused by name.
#[test]
fn bench_decode_runs_an_encoder_decoder() {
    let backends: &[&str] = if crate::common::gpu().is_some() { &["cpu", "wgpu"] } else { &["cpu"] };
    for backend in backends {
        let args = ["bench", "decode", "models/t5.toml", "--runs", "1", "--seq", "6", "--steps", "3", "--json", "-q"];
        let v = json(&[&args[..], &["--backend", backend]].concat());
        assert_eq!((v["prompt_tokens"].as_u64(), v["decode_steps"].as_u64()), (Some(6), Some(3)), "{v}");
        assert!(v["prefill_tok_s"].as_f64().unwrap() > 0.0 && v["decode_tok_s"].as_f64().unwrap() > 0.0, "{v}");
    }
    fails_with(
        &["bench", "decode", "models/t5.toml", "--seq", "6", "--steps", "3", "--batch", "2"],
        &["--batch", "`t5` is an encoder-decoder"],
    );
}

/// Issue 34: `bench decode --batch N` decodes N sequences together, on the CPU back end and on
/// wgpu, and says so.
#[test]
fn bench_decode_batches_sequences() {
    let args = ["bench", "decode", "models/llama.toml", "--runs", "2", "--seq", "4", "--steps", "3", "--batch", "3"];
    let backends: &[&str] = if crate::common::gpu().is_some() { &["cpu", "wgpu"] } else { &["cpu"] };
    for backend in backends {
        let v = json(&[&args[..], &["--backend", backend, "--json", "-q"]].concat());
        assert_eq!(v["batch"], 3, "{v}");
        spread(&v, "decode_tok_s");
        // On a device, the host's share of a batched step too (and none on the CPU).
        match *backend {
            "wgpu" => {
                spread(&v, "host_us_per_step");
                let host = v["host_us_per_step"].as_f64().unwrap();
                assert!(host > 0.0 && host < 3.0 * 1e6 / v["decode_tok_s_min"].as_f64().unwrap(), "{v}");
            }
            _ => assert!(v["host_us_per_step"].is_null(), "{v}"),
        }
    }
    let text = ok(&[&args[..], &["--backend", "cpu", "-q"]].concat());
    assert!(text.contains("3 sequences decoded together"), "{text}");
}

/// Issue 35: `bench decode --profile` says where the CPU's decode steps spend their time, by op:
/// summed over the timed decode steps only (never the prompt's run), each op's steps and the
/// weights they read adding up to the plan's; alone and batched; refused on wgpu by name.
#[test]
fn bench_decode_profiles_the_cpu_steps_by_op() {
    let args =
        ["bench", "decode", "models/llama.toml", "--backend", "cpu", "--runs", "2", "--seq", "4", "--steps", "3"];
    // Two generations of 3 decode steps; batched, the first step of each is not timed.
    for (batch, steps) in [("1", 6), ("3", 4)] {
        let v = json(&[&args[..], &["--batch", batch, "--profile", "--json", "-q"]].concat());
        let p = &v["profile"];
        assert_eq!(p["decode_steps"], steps, "--batch {batch}: {p}");
        let ops = p["ops"].as_array().unwrap();
        let total: f64 = ops.iter().map(|o| o["ms_per_step"].as_f64().unwrap()).sum();
        assert!((total - p["ms_in_steps"].as_f64().unwrap()).abs() < 1e-9 && total > 0.0, "{p}");
        // Below one decode step's whole time (sampling and the host's work are outside steps).
        assert!(total < 1e3 / v["decode_tok_s_min"].as_f64().unwrap() * 3.0, "{v}");
        let steps: u64 = ops.iter().map(|o| o["steps"].as_u64().unwrap()).sum();
        assert_eq!(steps, v["dispatches_per_step"].as_u64().unwrap(), "{p}");
        // Every weight once, but the one row of the token table a step gathers.
        let read: u64 = ops.iter().map(|o| o["weight_bytes_per_step"].as_u64().unwrap()).sum();
        let whole = v["weight_bytes_per_step"].as_u64().unwrap();
        assert!(read < whole && read >= whole - 4 * 1024, "{read} of {whole}");
        assert!(ops.iter().any(|o| o["op"].as_str().unwrap().contains("linear")), "{p}");
    }
    let text = ok(&[&args[..], &["--profile", "-q"]].concat());
    assert!(
        text.contains("profile of a decode step (6 decode steps summed") && text.contains("slowest steps:"),
        "{text}"
    );
    assert!(!ok(&args).contains("profile of"), "only with --profile");
    if crate::common::gpu().is_some() {
        let wgpu = ["bench", "decode", "models/llama.toml", "--backend", "wgpu", "--steps", "2", "--profile"];
        fails_with(&wgpu, &["--profile times the CPU back end's steps"]);
    }
}

/// Issue 33: on wgpu, `bench decode` gives the host's time per decode step (binding, encoding,
/// submitting) apart from the device's.
#[test]
fn bench_decode_reports_the_hosts_time_per_step_on_a_device() {
    if crate::common::gpu().is_none() {
        return;
    }
    let args =
        ["bench", "decode", "models/llama.toml", "--backend", "wgpu", "--runs", "2", "--seq", "4", "--steps", "3"];
    let v = json(&[&args[..], &["--json", "-q"]].concat());
    spread(&v, "host_us_per_step");
    let host = v["host_us_per_step"].as_f64().unwrap();
    // Above zero, and below the whole step's time.
    assert!(host > 0.0 && host < 1e6 / v["decode_tok_s_min"].as_f64().unwrap(), "{v}");
    let text = ok(&args);
    assert!(text.contains("host per decode step:") && text.contains("µs"), "{text}");
}

/// A count of zero measures nothing: refused by name before anything runs, never a "median of 0"
/// or 0.00 tok/s.
#[test]
fn bench_refuses_counts_of_zero() {
    let cases: &[(&[&str], &str)] = &[
        (&["forward", "models/llama.toml", "--runs", "0"], "--runs 0 measures nothing"),
        (&["profile", "models/llama.toml", "--batch", "0"], "--batch 0 measures nothing"),
        (&["decode", "models/llama.toml", "--steps", "0"], "--steps 0 measures nothing"),
        (&["decode", "models/llama.toml", "--steps", "2", "--runs", "0"], "--runs 0"),
        (&["decode", "models/llama.toml", "--steps", "2", "--seq", "0"], "--seq 0"),
        (&["decode", "models/llama.toml", "--steps", "2", "--batch", "0"], "--batch 0"),
        (&["kernels", "--runs", "0"], "--runs 0"),
        (&["attention", "--runs", "0"], "--runs 0"),
        (&["table", "--runs", "0"], "--runs 0"),
        (&["table", "--seqs", "32,0"], "--seqs 0"),
    ];
    for (args, needle) in cases {
        fails_with(&[&["bench"][..], args, &["--backend", "cpu"]].concat(), &[needle]);
    }
}

/// A CPU calibration measures and prints, and says that it caches nothing: the CPU's cost model
/// is built in.
#[test]
fn cpu_calibration_says_it_caches_nothing() {
    let o = kiln(&["bench", "calibrate", "--backend", "cpu", "-q"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("nothing cached: the `cpu` backend's cost model is built in"), "{}", stdout(&o));
    let v = json(&["bench", "calibrate", "--backend", "cpu", "-q", "--json"]);
    assert!(v["saved"].is_null(), "{v}");
    assert!(v["note"].as_str().is_some_and(|n| n.contains("nothing cached")), "{v}");
}
