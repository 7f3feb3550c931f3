//! What `kiln inspect` shows, both as text and on its `--html` page: the optimizer's statistics
//! ([`Stats`]), every fused op with the rules that produced it ([`explanations`]), and the graph as
//! DOT ([`dot`]), drawn by Graphviz ([`graphviz`]). `inspect.rs` and `html.rs` both read them from
//! here, and this module depends on neither.

use anyhow::{Context, Result, bail};
use kiln_compiler::graph::print::{self, DotOptions};
use kiln_compiler::graph::{Graph, Sym};
use kiln_compiler::memory::human;
use kiln_compiler::{lower, optimize};
use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::process::{Command, Stdio};

/// The DOT `inspect` draws: fused ops marked, a legend, the blocks `layers` keeps.
pub fn dot(graph: &Graph, layers: &Option<Range<usize>>) -> String {
    print::dot_with(graph, &DotOptions { fused: true, layers: layers.clone(), legend: true })
}

/// Draws DOT text with Graphviz (`format`: `svg`, `png`, ...). `None` when `dot` is not on the
/// `PATH`; an error when it fails.
pub fn graphviz(dot: &str, format: &str) -> Result<Option<Vec<u8>>> {
    let child = Command::new("dot")
        .arg(format!("-T{format}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("cannot start Graphviz `dot`"),
    };
    // Written from another thread: `dot` may fill its output pipe before it has read all its input.
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let text = dot.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().context("Graphviz `dot` failed")?;
    let written = writer.join().map_err(|_| anyhow::anyhow!("writing to Graphviz `dot` panicked"))?;
    if !out.status.success() {
        bail!("Graphviz `dot -T{format}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    written.context("cannot write to Graphviz `dot`")?;
    Ok(Some(out.stdout))
}

/// Optimizer statistics (`--stats`).
pub struct Stats {
    /// The model's graph name.
    pub model: String,
    /// Blocks in the spec.
    pub blocks: u64,
    /// The optimized graph.
    pub optimized: Graph,
    /// What the optimizer did.
    pub report: optimize::Report,
    /// The sequence length the bytes are counted at.
    pub seq: usize,
    /// Intermediate bytes placed (unoptimized, optimized) at batch 1, `seq` tokens.
    pub intermediate_bytes: (u64, u64),
    /// Most bytes live at once (unoptimized, optimized) at batch 1, `seq` tokens.
    pub live_peak_bytes: (u64, u64),
}

/// The sequence length `inspect --stats` counts bytes at.
pub const STATS_SEQ: usize = 128;

impl Stats {
    /// Optimizes `graph` for `target` and measures both graphs' plans at batch 1, `seq` tokens.
    pub fn of(graph: &Graph, blocks: u64, target: &kiln_compiler::target::Target, seq: usize) -> Result<Stats> {
        let (optimized, report) = optimize::optimize_for(graph, target)?;
        let syms =
            HashMap::from([(Sym::Batch, 1), (Sym::Seq, seq), (Sym::SrcSeq, seq), (Sym::Past, 0), (Sym::Ctx, seq)]);
        let (before, after) = (lower::lower(graph), lower::lower(&optimized));
        Ok(Stats {
            model: graph.name.clone(),
            blocks,
            seq,
            intermediate_bytes: (before.memory(&syms).0, after.memory(&syms).0),
            live_peak_bytes: (before.peak_live(&syms), after.peak_live(&syms)),
            optimized,
            report,
        })
    }

    /// As `--stats --json` prints them.
    pub fn json(&self) -> serde_json::Value {
        let r = &self.report;
        serde_json::json!({
            "model": self.model,
            "blocks": self.blocks,
            "dispatches": { "unoptimized": r.dispatches.0, "optimized": r.dispatches.1 },
            "intermediate_bytes": { "unoptimized": self.intermediate_bytes.0, "optimized": self.intermediate_bytes.1, "at": format!("batch 1, seq {}", self.seq) },
            "live_peak_bytes": { "unoptimized": self.live_peak_bytes.0, "optimized": self.live_peak_bytes.1 },
            "egraph_nodes": r.egraph_nodes,
            "egraph_classes": r.egraph_classes,
            "optimize_ms": r.optimize_ms,
            "rules_applied": r.applied,
        })
    }

    /// As `--stats` prints them.
    pub fn text(&self) -> String {
        let r = &self.report;
        let mut s = format!("{}: {}\n", self.model, crate::report::count(self.blocks as usize, "block"));
        s += &format!("  dispatches    {} -> {}\n", r.dispatches.0, r.dispatches.1);
        s += &format!(
            "  intermediates {} -> {} (batch 1, seq {}; live peak {} -> {})\n",
            human(self.intermediate_bytes.0),
            human(self.intermediate_bytes.1),
            self.seq,
            human(self.live_peak_bytes.0),
            human(self.live_peak_bytes.1)
        );
        s += &format!("  e-graph       {} nodes, {} classes\n", r.egraph_nodes, r.egraph_classes);
        s += &format!("  optimize      {:.1} ms\n", r.optimize_ms);
        for (phase, iterations, why) in &r.phases {
            s += &format!("  phase {phase:<10} {} ({why})\n", crate::report::count(*iterations, "iteration"));
        }
        for (rule, n) in &r.applied {
            s += &format!("  rule {rule:<22} fired {n}x\n");
        }
        s
    }
}

/// Every fused op of `graph` with the rules that produced it: (op, scope, rules), in order.
pub fn explanations(graph: &Graph) -> Vec<(String, String, Vec<&'static str>)> {
    graph
        .order()
        .into_iter()
        .filter_map(|n| {
            let rules = optimize::explain(graph, n);
            (!rules.is_empty()).then(|| (graph.g[n].op.name(), graph.g[n].scope.clone(), rules))
        })
        .collect()
}
