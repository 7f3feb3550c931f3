//! `kiln inspect`'s drawings and report: the DOT structure (blocks as clusters, fused ops marked,
//! runs of blocks collapsed by `--layers`), Graphviz output and the fallback without it, the
//! HTML report, and `GpuModel::profile`.
//!
//! Graphviz is required like the GPU is: CI installs it (`scripts/test`); without `dot` on the
//! PATH the tests that draw fail, unless `KILN_SKIP_GRAPHVIZ=1` says to skip them.

use crate::common;

use common::{kiln, ok, root, scratch, stderr, stdout};
use kiln_compiler::graph::print::{self, DotOptions, block_of};
use kiln_compiler::graph::{Graph, Op};
use kiln_compiler::{interp, lower, optimize};
use std::process::{Command, Output};

/// Runs kiln with a `PATH` holding nothing, so Graphviz's `dot` cannot be found.
fn kiln_without_graphviz(args: &[&str]) -> Output {
    let empty = scratch("empty-path");
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .current_dir(root())
        .env("PATH", &empty)
        .output()
        .expect("kiln runs")
}

/// Whether Graphviz is installed; without it, a failure unless `KILN_SKIP_GRAPHVIZ=1`.
fn graphviz() -> bool {
    if Command::new("dot").arg("-V").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    if std::env::var("KILN_SKIP_GRAPHVIZ").is_ok_and(|v| v == "1") {
        eprintln!("skipping a Graphviz test (KILN_SKIP_GRAPHVIZ=1): `dot` is not on the PATH");
        return false;
    }
    panic!("this test needs Graphviz's `dot`: `apt-get install -y graphviz` (or KILN_SKIP_GRAPHVIZ=1)");
}

/// The fill `inspect` gives fused ops.
const FUSED: &str = "fillcolor=\"#fde3c8\"";

/// Compute nodes (not parameters or inputs) of `stack` blocks `range`.
fn ops_in_blocks(g: &Graph, stack: &str, range: std::ops::Range<usize>) -> usize {
    g.g.node_indices()
        .filter(|&n| !matches!(g.g[n].op, Op::Param { .. } | Op::Input { .. }))
        .filter(|&n| block_of(&g.g[n].scope).is_some_and(|(s, i, _)| s == stack && range.contains(&i)))
        .count()
}

#[test]
fn block_of_reads_the_block_from_a_scope() {
    assert_eq!(block_of("layers.3.attn"), Some(("layers", 3, "attn")));
    assert_eq!(block_of("layers.12"), Some(("layers", 12, "")));
    assert_eq!(block_of("layers.0.moe.experts.5"), Some(("layers", 0, "moe.experts.5")));
    assert_eq!(block_of("decoder.layers.1.cross"), Some(("decoder.layers", 1, "cross")));
    assert_eq!(block_of("embed"), None);
    assert_eq!(block_of("layers"), None);
    assert_eq!(block_of("layers.x.attn"), None);
    assert_eq!(block_of(""), None);
}

#[test]
fn blocks_are_clusters_with_their_parts_inside() {
    let dot = ok(&["inspect", "models/llama.toml", "--format", "dot"]);
    for label in ["layers.0", "layers.1", "attn", "ffn", "embed", "head"] {
        assert!(dot.contains(&format!("label=\"{label}\"")), "no cluster `{label}`:\n{dot}");
    }
    // `attn` is a sub-cluster: its cluster opens before `layers.0`'s closes.
    let block = dot.find("label=\"layers.0\"").unwrap();
    let attn = dot[block..].find("label=\"attn\"").unwrap() + block;
    let next_block = dot.find("label=\"layers.1\"").unwrap();
    assert!(attn < next_block, "`attn` of layers.0 is not inside its block:\n{dot}");
    assert_eq!(dot.matches('{').count(), dot.matches('}').count());

    let dot = ok(&["inspect", "models/vaswani.toml", "--format", "dot"]);
    for label in ["encoder.layers.0", "decoder.layers.0", "cross"] {
        assert!(dot.contains(&format!("label=\"{label}\"")), "no cluster `{label}`");
    }
}

#[test]
fn fused_ops_are_filled_and_name_their_rules() {
    let optimized = ok(&["inspect", "models/llama.toml", "--stage", "optimized", "--format", "dot"]);
    let fused: Vec<&str> = optimized.lines().filter(|l| l.contains(FUSED) && !l.contains("legend")).collect();
    assert!(!fused.is_empty(), "no fused op is filled:\n{optimized}");
    for line in &fused {
        assert!(line.contains("<- "), "a fused op without its rules: {line}");
    }
    assert!(optimized.contains("packed_attention") && optimized.contains("masked-softmax, attention"));
    assert!(optimized.contains("legend_fused"), "the legend explains the fill");
    // As many filled ops as `--explain` lists.
    let explained = ok(&["inspect", "models/llama.toml", "--stage", "optimized", "--explain"]);
    assert_eq!(fused.len(), explained.lines().count());

    let built = ok(&["inspect", "models/llama.toml", "--stage", "graph", "--format", "dot"]);
    assert!(!built.contains(FUSED) && !built.contains("<- "), "the graph as built has no fused ops:\n{built}");
}

#[test]
fn layers_collapses_the_other_blocks_into_summaries() {
    let fe = common::spec("smollm2-135m");
    let dot = ok(&["inspect", "models/smollm2-135m.toml", "--format", "dot", "--layers", "0..2"]);
    assert!(dot.contains("label=\"layers.0\"") && dot.contains("label=\"layers.1\""));
    assert!(!dot.contains("label=\"layers.2\"") && !dot.contains("layers.29.attn"), "hidden blocks are drawn");
    let ops = ops_in_blocks(&fe.graph, "layers", 2..30);
    assert!(dot.contains(&format!("label=\"layers 2..30: 28 blocks, {ops} ops\"")), "{dot}");
    // Edges go through the summary: in from block 1, out to the final norm.
    let into = dot.lines().filter(|l| l.ends_with("-> hidden_0;")).count();
    let out_of = dot.lines().filter(|l| l.trim_start().starts_with("hidden_0 ->")).count();
    assert!(into >= 1 && out_of >= 1, "no edges through the summary:\n{dot}");
    assert!(dot.contains("legend_hidden"));

    // One block in the middle: a summary on either side.
    let dot = ok(&["inspect", "models/smollm2-135m.toml", "--format", "dot", "--layers", "3"]);
    let before = ops_in_blocks(&fe.graph, "layers", 0..3);
    let after = ops_in_blocks(&fe.graph, "layers", 4..30);
    assert!(dot.contains(&format!("layers 0..3: 3 blocks, {before} ops")), "{dot}");
    assert!(dot.contains(&format!("layers 4..30: 26 blocks, {after} ops")), "{dot}");
    assert!(dot.contains("label=\"layers.3\""));
    assert!(dot.lines().any(|l| l.trim_start().starts_with("hidden_0 -> n")), "summary 0 feeds block 3");

    // Both stacks of an encoder-decoder.
    let dot = ok(&["inspect", "models/vaswani.toml", "--format", "dot", "--layers", "0"]);
    assert!(dot.contains("label=\"encoder.layers.0\"") && dot.contains("label=\"decoder.layers.0\""));
    assert!(dot.contains("encoder.layers 1..") && dot.contains("decoder.layers 1.."), "{dot}");
}

#[test]
fn layers_out_of_range_or_malformed_is_an_error() {
    common::failure(
        &["inspect", "models/llama.toml", "--format", "dot", "--layers", "0..40"],
        &["--layers 0..40 is out of range", "has 2 blocks (0..2)"],
    );
    common::failure(&["inspect", "models/llama.toml", "--format", "dot", "--layers", "2"], &["out of range"]);
    common::failure(&["inspect", "models/llama.toml", "--format", "dot", "--layers", "1..1"], &["selects no blocks"]);
    common::failure(&["inspect", "models/llama.toml", "--format", "dot", "--layers", "a..2"], &["`a` is not a number"]);
    common::failure(&["inspect", "models/llama.toml", "--format", "dot", "--layers=-1"], &["is not a number"]);
    common::failure(&["inspect", "models/llama.toml", "--layers", "0"], &["--layers applies to drawings"]);
}

#[test]
fn svg_and_png_are_drawn_by_graphviz() {
    if !graphviz() {
        return;
    }
    let svg = ok(&["inspect", "models/llama.toml", "--stage", "optimized", "--format", "svg", "--layers", "0"]);
    assert!(svg.contains("<svg") && svg.trim_end().ends_with("</svg>"), "not an SVG document:\n{svg}");
    assert!(svg.contains("layers 1..2: 1 block"), "the summary node is drawn");

    let out = scratch("png").join("graph.png");
    ok(&["inspect", "models/llama.toml", "--format", "png", "-o", out.to_str().unwrap()]);
    let png = std::fs::read(&out).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG file");
}

/// Without Graphviz there is no SVG or PNG: the command fails (nothing written, not DOT text in a
/// `.svg`) and says how to get the DOT text instead.
#[test]
fn without_graphviz_svg_is_refused() {
    let out = scratch("no-dot").join("g.svg");
    for args in [&["--format", "svg"][..], &["--format", "png", "-o", out.to_str().unwrap()]] {
        let o = kiln_without_graphviz(&[&["inspect", "models/llama.toml"][..], args].concat());
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(stdout(&o).is_empty(), "{}", stdout(&o));
        assert!(stderr(&o).contains("Graphviz `dot` is not on the PATH"), "{}", stderr(&o));
        assert!(stderr(&o).contains("--format dot"), "{}", stderr(&o));
    }
    assert!(!out.exists(), "nothing is written");
}

#[test]
fn output_goes_to_a_file() {
    let out = scratch("output").join("graph.dot");
    let printed = ok(&["inspect", "models/llama.toml", "--format", "dot"]);
    let quiet = ok(&["inspect", "models/llama.toml", "--format", "dot", "--output", out.to_str().unwrap()]);
    assert!(quiet.is_empty());
    assert_eq!(std::fs::read_to_string(&out).unwrap(), printed);
}

/// The HTML escaping the report applies.
fn escaped(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;").replace('\'', "&#39;")
}

/// Asserts the page loads nothing from elsewhere.
fn self_contained(html: &str) {
    for attr in ["src=", "href="] {
        for quote in ["\"", "'"] {
            for scheme in ["http:", "https:", "//"] {
                let needle = format!("{attr}{quote}{scheme}");
                assert!(!html.contains(&needle), "the report links `{needle}`");
            }
        }
    }
    assert!(!html.contains("url(http") && !html.contains("@import"), "the style loads something");
}

#[test]
fn html_report_holds_spec_graphs_kernels_wgsl_and_explanations() {
    let draws = graphviz();
    let out = scratch("html").join("report.html");
    // wgpu's report (its kernels and their WGSL), as `--backend auto` gives it on a GPU.
    let o = kiln(&["inspect", "models/llama.toml", "--html", out.to_str().unwrap(), "--backend", "wgpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
    self_contained(&html);

    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    assert!(html.contains(&escaped(&source)), "the spec text is missing");
    let fe = common::spec("llama");
    let (optimized, report) = optimize::optimize(&fe.graph).unwrap();
    let program = kiln_compiler::back::wgsl::compile(&lower::lower(&optimized), &Default::default()).unwrap();
    let plan = &program.plan;
    for (k, kernel) in program.kernels.iter().enumerate() {
        assert!(html.contains(&format!("kernel {k}: {}", kernel.name)), "kernel {k} is missing");
        assert!(html.contains(&escaped(&kernel.wgsl)), "the WGSL of `{}` is missing", kernel.name);
    }
    for i in 0..plan.steps.len() {
        let name = &program.kernel_of(i).unwrap().name;
        assert!(html.contains(&format!("<td class=\"mono\">{}</td>", escaped(name))));
    }
    assert_eq!(html.matches("<tr><td class=\"num\">").count(), plan.steps.len(), "one row per dispatch");
    for n in optimized.order() {
        for rule in optimize::explain(&optimized, n) {
            assert!(html.contains(&format!("<span class=\"rule\">{rule}</span>")), "rule `{rule}` is missing");
        }
    }
    for rule in report.applied.keys() {
        assert!(html.contains(&format!("<td class=\"mono\">{rule}</td>")), "the statistics lack `{rule}`");
    }
    assert!(html.contains(&format!("{} → {}", report.dispatches.0, report.dispatches.1)));
    if draws {
        assert_eq!(html.matches("<svg").count(), 2, "both graphs are drawn inline");
        assert!(!html.contains("<?xml"), "the SVG's XML prolog is left in the page");
    }
}

#[test]
fn html_report_without_graphviz_holds_the_dot_text() {
    let out = scratch("html-no-dot").join("report.html");
    let o = kiln_without_graphviz(&["inspect", "models/llama.toml", "--html", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(!html.contains("<svg"));
    assert_eq!(html.matches("<pre>digraph &quot;llama&quot; {").count(), 2, "both graphs as DOT text");
    assert!(html.contains("Graphviz <code>dot</code> is not installed"));
    self_contained(&html);
}

#[test]
fn html_report_escapes_the_spec() {
    let dir = scratch("escape");
    let spec = dir.join("odd.toml");
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    std::fs::write(&spec, format!("# </pre><script>alert('x')</script> & \"more\"\n{source}")).unwrap();
    let out = dir.join("report.html");
    let o = kiln(&["inspect", spec.to_str().unwrap(), "--html", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(!html.contains("<script>alert"), "spec text reached the page unescaped");
    assert!(html.contains("# &lt;/pre&gt;&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;more&quot;"));
}

#[test]
fn html_report_options_are_checked() {
    common::failure(
        &["inspect", "models/llama.toml", "--html", "/tmp/x.html", "--seq", "0"],
        &["--seq must be at least 1"],
    );
    common::failure(
        &["inspect", "models/llama.toml", "--html", "/tmp/x.html", "--seq", "100000"],
        &["exceeds the model's"],
    );
    common::failure(&["inspect", "models/llama.toml", "--profile"], &["--html"]);
    common::failure(&["inspect", "models/llama.toml", "--html", "/tmp/x.html", "--stats"], &["cannot be used with"]);
}

#[test]
fn profile_times_every_step_on_both_clocks() {
    let Some(gpu) = common::gpu() else { return };
    let fe = common::spec("llama");
    let optimized = optimize::optimize(&fe.graph).unwrap().0;
    let params = interp::random_params(&optimized, 3).unwrap();
    let inputs = interp::sample_inputs(&fe.graph, 128, 1, 16).unwrap();
    let mut host = kiln_runtime::Gpu::new(None).unwrap();
    host.use_host_clock();
    for gpu in [gpu, std::sync::Arc::new(host)] {
        let model = kiln_runtime::GpuModel::new(gpu.clone(), lower::lower(&optimized), &params).unwrap();
        let profile = model.profile(&inputs).unwrap();
        let expected = if gpu.supports_timestamps() { kiln_runtime::Clock::Device } else { kiln_runtime::Clock::Host };
        assert_eq!(profile.clock, expected);
        assert_eq!(profile.seconds.len(), model.plan().steps.len());
        for (i, t) in profile.seconds.iter().enumerate() {
            assert!(t.is_some_and(|t| t > 0.0 && t < 10.0), "{:?}: step {i} took {t:?}", profile.clock);
        }
        // The profile leaves the model as it was: a run still gives the interpreter's logits.
        let logits = &model.run(&inputs).unwrap()[0].1;
        let want = &interp::run(&optimized, &params, &inputs).unwrap()[0].1;
        let (a, b) = (logits.as_f32().unwrap(), want.as_f32().unwrap());
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-3, "logits differ by {worst} after profiling");
    }
}

#[test]
fn html_report_with_profile_has_a_time_for_every_dispatch() {
    if common::gpu().is_none() {
        return;
    }
    let out = scratch("profile").join("report.html");
    let o = kiln(&[
        "inspect",
        "models/llama.toml",
        "--html",
        out.to_str().unwrap(),
        "--backend",
        "wgpu",
        "--profile",
        "--seq",
        "8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();
    let steps = lower::lower(&optimize::optimize(&common::spec("llama").graph).unwrap().0).steps.len();
    assert!(
        html.contains("<th class=\"num\">GPU time (adapter ") || html.contains("<th class=\"num\">wall time (adapter "),
        "no time column naming the adapter"
    );
    let times: Vec<&str> =
        html.split("<td class=\"num time\">").skip(1).map(|c| &c[..c.find("</td>").unwrap()]).collect();
    assert_eq!(times.len(), steps, "a time per dispatch");
    for t in times {
        let (value, unit) = t.split_once(' ').unwrap_or_else(|| panic!("not a time: {t}"));
        assert!(unit == "µs" || unit == "ms", "not a time: {t}");
        assert!(value.parse::<f64>().is_ok_and(|v| v > 0.0), "not a positive time: {t}");
    }
    assert!(html.contains("profiled on wgpu (adapter "));
}

/// Issue 32: the report is about the engine that runs the model. On the CPU (what `auto` is
/// without a GPU), it lists the plan optimized for the CPU and profiles it there, naming the
/// engine in the time column; it has no WGSL.
#[test]
fn html_report_profiles_the_cpu_back_end() {
    let out = scratch("profile-cpu").join("report.html");
    let args = ["inspect", "models/llama.toml", "--html", out.to_str().unwrap(), "--backend", "cpu"];
    let o = kiln(&[&args[..], &["--profile", "--threads", "2", "--seq", "8"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();
    let optimized =
        optimize::optimize_for(&common::spec("llama").graph, &kiln_compiler::target::Target::cpu()).unwrap().0;
    let steps = lower::lower(&optimized).steps.len();
    assert!(html.contains("<th class=\"num\">CPU time (2 threads)</th>"), "no CPU time column");
    assert!(!html.contains("GPU time") && !html.contains("id=\"wgsl\""), "a CPU report with wgpu's figures");
    assert!(html.contains("profiled on the CPU back end (2 threads)"));
    let times: Vec<&str> =
        html.split("<td class=\"num time\">").skip(1).map(|c| &c[..c.find("</td>").unwrap()]).collect();
    assert_eq!(times.len(), steps, "a time per step");
    for t in times {
        let (value, unit) = t.split_once(' ').unwrap_or_else(|| panic!("not a time: {t}"));
        assert!(unit == "µs" || unit == "ms", "not a time: {t}");
        assert!(value.parse::<f64>().is_ok_and(|v| v >= 0.0), "not a time: {t}");
    }
    let interp = ["inspect", "models/llama.toml", "--html", out.to_str().unwrap(), "--force", "--backend", "interp"];
    common::failure(&interp, &["the interpreter has no kernels"]);
}

/// Issue 32: a whole model reads at its default size (its first block drawn, the others one
/// summary node), a fusion every block repeats is one row naming the blocks, a gather touches the
/// rows it reads (not its whole table), and every figure is at the one `--seq`, stated.
#[test]
fn html_report_groups_blocks_and_counts_what_kernels_touch() {
    let dir = scratch("html-grouped");
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    let spec = dir.join("llama-4.toml");
    std::fs::write(&spec, source.replace("layers = 2\n", "layers = 4\n")).unwrap();
    let out = dir.join("report.html");
    let o = kiln_without_graphviz(&[
        "inspect",
        spec.to_str().unwrap(),
        "--html",
        out.to_str().unwrap(),
        "--backend",
        "cpu",
        "--seq",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let html = std::fs::read_to_string(&out).unwrap();

    assert!(html.contains("Block 0 is drawn and blocks 1..4 are one summary node"), "no default block range");
    let graphs = &html[html.find("id=\"graphs\"").unwrap()..html.find("id=\"fusions\"").unwrap()];
    assert!(graphs.contains("layers.0.attn") && !graphs.contains("layers.3.attn"), "a collapsed block drawn in full");

    let fusions = &html[html.find("id=\"fusions\"").unwrap()..html.find("id=\"optimizer\"").unwrap()];
    assert!(fusions.contains("<td class=\"mono\">layers.0..4.attn</td><td class=\"num\">4 blocks</td>"), "{fusions}");
    assert!(!fusions.contains("layers.1.attn"), "a fusion listed once per block: {fusions}");

    // embed.tokens is [128, 64] f32 (32 KiB); 16 tokens read 16 rows: 4 KiB, written again as
    // 4 KiB, and 16 ids.
    let gather = html.split("<tr>").find(|r| r.contains(">gather<")).unwrap();
    assert!(gather.contains("<td class=\"num\">8.1 KiB</td>"), "{gather}");

    assert!(html.contains("every figure at batch 1, 16 tokens"));
    assert!(html.contains("intermediate bytes (batch 1, seq 16)"), "the optimizer's bytes at another length");
    assert!(!html.contains("seq 128") && !html.contains("seq 32"), "a figure at another length");
}

#[test]
fn dot_of_one_optimized_block() {
    let fe = common::spec("llama");
    let optimized = optimize::optimize(&fe.graph).unwrap().0;
    let options = DotOptions { fused: true, layers: Some(0..1), legend: true };
    let dot = print::dot_with(&optimized, &options);
    assert_eq!(dot, print::dot_with(&optimized, &options), "the drawing is not deterministic");
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"));
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| insta::assert_snapshot!("dot_llama_optimized_layers_0", dot));
}
