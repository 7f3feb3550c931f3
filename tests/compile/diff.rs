//! `kiln diff`: a one-knob change reads as the few ops it touches (stable node names), identical
//! variants as none, artifacts compare like their specs, and the HTML page draws both sides.

use crate::common;

use common::{kiln, ok, root, scratch};
use std::path::PathBuf;

/// `models/llama.toml` with ALiBi instead of RoPE, written to a scratch file.
fn llama_alibi(dir: &str) -> PathBuf {
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    let alibi = source.replace("kind = \"rope\"\ntheta = 10000.0\n", "kind = \"alibi\"\n");
    assert_ne!(source, alibi, "models/llama.toml no longer says `kind = \"rope\"` with its theta");
    let path = scratch(dir).join("llama-alibi.toml");
    std::fs::write(&path, alibi).unwrap();
    path
}

fn snapshot(name: &str, text: &str) {
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path(concat!(env!("CARGO_MANIFEST_DIR"), "/snapshots"));
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| insta::assert_snapshot!(name, text));
}

#[test]
fn rope_to_alibi_reads_as_the_ops_it_touches() {
    let b = llama_alibi("alibi");
    let b = b.to_str().unwrap();
    let text = ok(&["diff", "models/llama.toml", b]).replace(b, "llama-alibi.toml");
    // Every block's attention loses its two rotations and gains ALiBi; nothing else moves.
    assert!(text.contains("layers.0..2 (each of 2 blocks: 1 added, 2 removed, 3 changed)"), "{text}");
    let changes = text.lines().filter(|l| l.starts_with("  - ") || l.starts_with("  + ") || l.starts_with("  ~ "));
    assert!(changes.count() <= 8, "a one-knob change reads as a few lines:\n{text}");
    snapshot("diff_llama_rope_to_alibi", &text);

    let optimized = ok(&["diff", "models/llama.toml", b, "--stage", "optimized"]).replace(b, "llama-alibi.toml");
    assert!(optimized.contains("~ attn/packed_attention#0"), "{optimized}");
    snapshot("diff_llama_rope_to_alibi_optimized", &optimized);
}

#[test]
fn json_holds_the_totals_and_the_changes() {
    let b = llama_alibi("json");
    let text = ok(&["diff", "models/llama.toml", b.to_str().unwrap(), "--json"]);
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["a"]["totals"]["dispatches"], 55, "{doc}");
    assert_eq!(doc["b"]["totals"]["dispatches"], 53, "{doc}");
    assert_eq!(doc["ops"]["added"], 2, "{doc}");
    let group = &doc["groups"][0];
    assert_eq!(group["title"], "layers.0..2");
    assert_eq!(group["blocks"], 2);
    assert!(group["changes"].as_array().unwrap().iter().any(|c| c["kind"] == "added" && c["name"] == "attn/alibi#0"));
}

#[test]
fn identical_variants_have_no_changes() {
    let text = ok(&["diff", "models/gpt2.toml", "models/gpt2.toml", "--stage", "optimized"]);
    assert!(text.contains("ops: 0 added, 0 removed, 0 changed"), "{text}");
    assert!(text.contains("the graphs are the same"), "{text}");
}

#[test]
fn changes_in_one_block_stay_in_that_block() {
    // One more block: the new block's ops are added, the head reads it, no other block changes.
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    let deeper = source.replace("layers = 2\n", "layers = 3\n");
    assert_ne!(source, deeper, "models/llama.toml no longer has 2 layers");
    let path = scratch("deeper").join("llama-3.toml");
    std::fs::write(&path, deeper).unwrap();
    let text = ok(&["diff", "models/llama.toml", path.to_str().unwrap()]);
    assert!(!text.contains("\nlayers.0") && !text.contains("\nlayers.1"), "{text}");
    assert!(text.contains("\nlayers.2 (") && text.contains("+ attn/"), "{text}");
}

#[test]
fn an_artifact_compares_like_its_spec() {
    let dir = scratch("artifact");
    let artifact = dir.join("gpt2.kiln");
    ok(&["compile", "models/gpt2.toml", "-o", artifact.to_str().unwrap()]);
    let text = ok(&["diff", artifact.to_str().unwrap(), "models/gpt2.toml"]);
    assert!(text.contains("the graphs are the same"), "{text}");
}

#[test]
fn html_draws_both_variants_side_by_side() {
    let b = llama_alibi("html");
    let page = scratch("diff-html").join("diff.html");
    let o =
        kiln(&["diff", "models/llama.toml", b.to_str().unwrap(), "--html", page.to_str().unwrap(), "--layers", "0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert_eq!(html.matches("<div class=\"side\">").count(), 2, "two drawings side by side");
    assert!(html.contains("attn/alibi#0"), "the changes are listed");
    // The changed ops are outlined in the drawings (SVG from Graphviz, or the DOT text without it).
    assert!(html.contains("#b42318"), "changed ops are outlined");
}

#[test]
fn bad_arguments_are_errors() {
    let o = kiln(&["diff", "models/llama.toml", "models/nonexistent.toml"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nonexistent.toml"));
    let o = kiln(&["diff", "models/llama.toml", "models/gpt2.toml", "--layers", "0"]);
    assert_eq!(o.status.code(), Some(2), "--layers applies to --html only");
    let o = kiln(&["diff", "models/llama.toml", "models/gpt2.toml", "--json", "--html", "x.html"]);
    assert_eq!(o.status.code(), Some(2), "--json and --html conflict");
    let o = kiln(&["diff", "models/llama.toml", "models/gpt2.toml", "--seq", "0"]);
    assert_eq!(o.status.code(), Some(1));
}

/// `models/llama.toml` with four blocks, and `edit` applied to it, written to a scratch directory.
fn llama_4_and(dir: &str, edit: impl Fn(&str) -> String) -> (PathBuf, PathBuf) {
    let source = std::fs::read_to_string(root().join("models/llama.toml")).unwrap();
    // No weight map: an edit may add parameters the `llama` preset does not name.
    let four = source.replace("layers = 2\n", "layers = 4\n").replace("[weights]\npreset = \"llama\"\n", "");
    let edited = edit(&four);
    assert_ne!(four, edited, "the edit no longer applies to models/llama.toml");
    let dir = scratch(dir);
    let (a, b) = (dir.join("llama-4.toml"), dir.join("llama-4-edited.toml"));
    std::fs::write(&a, four).unwrap();
    std::fs::write(&b, edited).unwrap();
    (a, b)
}

/// The titles of the groups a text diff lists, in order.
fn titles(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.ends_with(" changed)")).filter_map(|l| l.split(" (").next()).collect()
}

#[test]
fn optimized_blocks_are_listed_ascending_and_grouped() {
    // Post-norm: the optimized graph computes its blocks' nodes last block first; the diff still
    // lists them in the order data flows through them, the identical middle blocks once.
    let (a, b) =
        llama_4_and("post", |s| s.replace("kind = \"rmsnorm\"\n", "kind = \"rmsnorm\"\nplacement = \"post\"\n"));
    let text = ok(&["diff", a.to_str().unwrap(), b.to_str().unwrap(), "--stage", "optimized"]);
    assert_eq!(titles(&text), ["layers.0", "layers.1..3", "layers.3", "final_norm", "head"], "{text}");

    // A block's own new parameter (a bias, named with its block) reads the same in every block.
    let (a, b) = llama_4_and("layernorm", |s| s.replace("kind = \"rmsnorm\"", "kind = \"layernorm\""));
    let text = ok(&["diff", a.to_str().unwrap(), b.to_str().unwrap(), "--stage", "optimized"]);
    assert_eq!(titles(&text), ["layers.0", "layers.1..4", "final_norm", "head"], "{text}");
    assert!(text.contains("+ attn_norm.bias") && text.contains("param \"attn_norm.bias\""), "{text}");
}

#[test]
fn flops_agree_with_check_before_and_after_fusion() {
    // One FLOP count (the matmuls of a forward pass): `check`'s, and `diff`'s of the graph as
    // built and as optimized, at the same sequence length. `kiln new decoder` once read 79.17M
    // in `check` and 79.27M in `diff`, which counted every elementwise op too.
    let spec = scratch("flops").join("decoder.toml");
    std::fs::write(&spec, ok(&["new", "decoder"])).unwrap();
    let spec = spec.to_str().unwrap();
    let check: serde_json::Value = serde_json::from_str(&ok(&["check", spec, "--seq", "128", "--json"])).unwrap();
    let want = check["flops_per_token"].as_f64().unwrap();
    for stage in ["graph", "optimized"] {
        let doc: serde_json::Value =
            serde_json::from_str(&ok(&["diff", spec, spec, "--stage", stage, "--seq", "128", "--json"])).unwrap();
        let got = doc["a"]["totals"]["flops_per_token"].as_f64().unwrap();
        assert!((got - want).abs() <= 1e-9 * want, "{stage}: diff counts {got} FLOPs/token, check {want}");
    }
    let text = ok(&["check", spec, "--seq", "128"]);
    assert!(text.contains("FLOPs/token  79.17M (matmuls, forward at seq 128)"), "{text}");
    let text = ok(&["diff", spec, spec, "--stage", "optimized", "--seq", "128"]);
    let flops = text.lines().find(|l| l.starts_with("FLOPs/token (matmuls, seq 128)")).unwrap_or_default();
    assert_eq!(flops.split_whitespace().skip(4).collect::<Vec<_>>(), ["79.17M", "79.17M", "0"], "{text}");
    // Bytes in binary units, as `inspect` writes them; `--json` keeps the raw count.
    assert!(text.contains(" MiB ") && !text.contains(" MB"), "{text}");
    let doc: serde_json::Value = serde_json::from_str(&ok(&["diff", spec, spec, "--json"])).unwrap();
    assert!(doc["a"]["totals"]["intermediate_bytes"].is_u64(), "{doc}");
}
