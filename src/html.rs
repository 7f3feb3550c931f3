//! `kiln inspect --html`: one self-contained HTML page about a model compiled for the engine that
//! runs it ([`Engine`]: the CPU back end or wgpu, as `kiln run` picks it) — the spec, the graph
//! before and after the optimizer (inline SVG drawn by Graphviz, or the DOT text where `dot` is
//! not installed; a model of several blocks drawn with its first block and the rest collapsed
//! unless `--layers` says otherwise), the plan's steps with the bytes they touch, their estimated
//! FLOPs and their time measured on that engine, wgpu's WGSL, the fusions (one row per fused op
//! and the blocks it appears in) and the optimizer's statistics, all at one sequence length. The
//! page loads nothing: its style and its one small script are inline, and every piece of text in
//! it is HTML-escaped.

use crate::view::{Stats, explanations, graphviz};
use anyhow::Result;
use kiln_compiler::back::wgsl::Program;
use kiln_compiler::graph::print::block_of;
use kiln_compiler::graph::{Graph, Op, Sym, resolve};
use kiln_compiler::lower::{Plan, Storage};
use kiln_compiler::optimize::CostModel;
use kiln_runtime::{Clock, Profile};
use std::collections::HashMap;
use std::fmt::Write;
use std::ops::Range;

/// What the report is made of.
pub struct Report<'a> {
    /// Path of the spec, as given.
    pub spec_path: &'a str,
    /// The spec's text.
    pub source: &'a str,
    /// The graph as built.
    pub graph: &'a Graph,
    /// The optimizer's statistics and the optimized graph.
    pub stats: &'a Stats,
    /// The engine the report is about, with the optimized graph's plan as it runs there (the one
    /// profiled, with `--profile`).
    pub engine: &'a Engine,
    /// Tokens every figure of the report is for: the kernels' bytes, FLOPs and times, and the
    /// optimizer's intermediate bytes ([`Stats::seq`]).
    pub seq: usize,
    /// The blocks the drawings keep (`None`: the first, for a model of several).
    pub layers: &'a Option<Range<usize>>,
    /// The time of every step on the engine, with `--profile`.
    pub profile: Option<&'a Profile>,
    /// Training runs of the model (`kiln train --log` files, with `--training`), drawn as loss
    /// curves in a section of their own.
    pub training: &'a [crate::curves::Run],
}

/// The engine a report is about, with the plan it runs.
pub enum Engine {
    /// The native CPU back end, on `threads` threads.
    Cpu {
        /// The optimized graph's plan, as the CPU runs it.
        plan: Plan,
        /// Threads.
        threads: usize,
    },
    /// wgpu's generated kernels.
    Wgpu {
        /// The optimized graph's plan compiled for wgpu (boxed: it is most of the variant's size).
        program: Box<Program>,
        /// The adapter profiled on (with `--profile`).
        adapter: Option<String>,
    },
}

impl Engine {
    /// The plan whose steps the report lists.
    fn plan(&self) -> &Plan {
        match self {
            Engine::Cpu { plan, .. } => plan,
            Engine::Wgpu { program, .. } => &program.plan,
        }
    }

    /// What runs the model, for the page's header.
    fn describe(&self) -> String {
        match self {
            Engine::Cpu { threads, .. } => format!("the CPU back end ({})", crate::report::count(*threads, "thread")),
            Engine::Wgpu { adapter: Some(a), .. } => format!("wgpu (adapter {a})"),
            Engine::Wgpu { adapter: None, .. } => "wgpu".to_string(),
        }
    }

    /// The heading of the time column, naming the engine and the clock: `CPU time (2 threads)`,
    /// `GPU time (adapter …)`, or `wall time (adapter …)` where the adapter has no timestamps.
    fn time_heading(&self, clock: Clock) -> String {
        match (self, clock) {
            (Engine::Cpu { threads, .. }, _) => format!("CPU time ({})", crate::report::count(*threads, "thread")),
            (Engine::Wgpu { adapter, .. }, clock) => {
                let what = if clock == Clock::Device { "GPU time" } else { "wall time" };
                match adapter {
                    Some(a) => format!("{what} (adapter {a})"),
                    None => what.to_string(),
                }
            }
        }
    }
}

/// Escapes text for HTML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `1234567` -> `1.23 M`.
fn si(x: f64) -> String {
    match x {
        x if x >= 1e12 => format!("{:.2} T", x / 1e12),
        x if x >= 1e9 => format!("{:.2} G", x / 1e9),
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.2} k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// Bytes in binary units, as every kiln command writes them ([`kiln_compiler::memory::human`]).
fn bytes(x: f64) -> String {
    kiln_compiler::memory::human(x as u64)
}

/// Seconds in µs below a millisecond, else in ms.
fn duration(seconds: f64) -> String {
    match seconds {
        t if t < 1e-3 => format!("{:.1} µs", t * 1e6),
        t => format!("{:.2} ms", t * 1e3),
    }
}

const STYLE: &str = r#"
:root { --ink: #1f2933; --muted: #616e7c; --line: #d9e2ec; --soft: #f5f7fa; --accent: #2f6fb1; --fused: #fde3c8; --fused-line: #c8651b; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.5 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: var(--ink); background: #fff; }
header { padding: 28px 40px 20px; background: linear-gradient(180deg, #f0f4f8, #fff); border-bottom: 1px solid var(--line); }
header h1 { margin: 0 0 4px; font-size: 26px; font-weight: 650; letter-spacing: -0.01em; }
header .sub { color: var(--muted); }
nav { position: sticky; top: 0; z-index: 2; background: rgba(255,255,255,0.96); border-bottom: 1px solid var(--line); padding: 8px 40px; }
nav a { color: var(--accent); text-decoration: none; margin-right: 18px; font-weight: 500; }
nav a:hover { text-decoration: underline; }
main { padding: 8px 40px 48px; max-width: 1400px; }
section { margin-top: 28px; }
h2 { font-size: 18px; margin: 0 0 10px; padding-bottom: 6px; border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 18px 0 8px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 18px; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 16px; min-width: 150px; background: #fff; }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: 0.04em; }
.card .v { font-size: 20px; font-weight: 600; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--soft); font-weight: 600; position: sticky; top: 41px; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:hover td { background: #fafcff; }
tfoot td { font-weight: 600; background: var(--soft); }
code, pre, .mono { font-family: "DejaVu Sans Mono", ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
pre { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 12px 14px; overflow: auto; max-height: 520px; margin: 0; }
.rule { display: inline-block; background: var(--fused); border: 1px solid var(--fused-line); color: #7a3a0c; border-radius: 10px; padding: 0 8px; margin: 1px 2px; font-size: 12px; }
.bar { height: 6px; background: var(--accent); border-radius: 3px; min-width: 1px; }
.note { color: var(--muted); font-size: 13px; margin: 6px 0 10px; }
.graph { border: 1px solid var(--line); border-radius: 8px; overflow: auto; max-height: 85vh; background: #fff; padding: 8px; margin-bottom: 16px; }
.graph.fit { max-height: none; }
.graph.fit svg { width: 100%; height: auto; }
.graph h3 { margin: 2px 4px 8px; }
button { font: inherit; font-size: 12px; border: 1px solid var(--line); background: #fff; border-radius: 6px; padding: 2px 10px; cursor: pointer; }
details { border: 1px solid var(--line); border-radius: 6px; margin: 6px 0; }
details summary { cursor: pointer; padding: 6px 12px; background: var(--soft); border-radius: 6px; }
details[open] summary { border-bottom: 1px solid var(--line); border-radius: 6px 6px 0 0; }
details pre { border: 0; border-radius: 0 0 6px 6px; }
.kv td:first-child { color: var(--muted); width: 300px; }
.narrow { max-width: 820px; }
.shape { white-space: nowrap; }
"#;

/// Toggles a drawing between its natural size and the width of its box.
const SCRIPT: &str = r#"
document.querySelectorAll('button[data-fit]').forEach(function (b) {
  b.addEventListener('click', function () {
    var g = document.getElementById(b.getAttribute('data-fit'));
    g.classList.toggle('fit');
    b.textContent = g.classList.contains('fit') ? 'actual size' : 'fit width';
  });
});
"#;

impl Report<'_> {
    /// The training runs' loss curves and final figures (empty without runs).
    fn training(&self) -> String {
        if self.training.is_empty() {
            return String::new();
        }
        let mut s = String::from("<section id=\"training\"><h2>Training</h2>\n");
        s += "<table class=\"narrow\"><thead><tr><th>run</th><th>steps</th><th>first loss</th><th>last loss</th><th>evaluation loss</th></tr></thead><tbody>\n";
        for run in self.training {
            let cell = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.4}"));
            let _ = writeln!(
                s,
                "<tr><td class=\"mono\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&run.name),
                run.train.len(),
                cell(run.train.first().map(|p| p.1)),
                cell(run.train.last().map(|p| p.1)),
                cell(run.eval.last().map(|p| p.1))
            );
        }
        s += "</tbody></table>\n<div class=\"graph fit\">";
        let steps = self.training.iter().map(|r| r.train.len()).max().unwrap_or(0);
        s += &crate::curves::svg(self.training, "training loss", (steps / 50).max(1));
        s += "</div></section>\n";
        s
    }

    /// The page.
    pub fn render(&self) -> Result<String> {
        let model = &self.graph.name;
        let mut h = String::new();
        let _ = writeln!(
            h,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>kiln report: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>",
            escape(model)
        );
        let engine = escape(&self.engine.describe());
        let profiled = match self.profile {
            Some(_) => format!(", compiled for and profiled on {engine}"),
            None => format!(", compiled for {engine}"),
        };
        let _ = writeln!(
            h,
            "<header><h1>{}</h1><div class=\"sub\"><span class=\"mono\">{}</span> · every figure at batch 1, {} tokens (<code>--seq</code>){profiled}</div>",
            escape(model),
            escape(self.spec_path),
            self.seq
        );
        h += &self.cards();
        let training_link = if self.training.is_empty() { "" } else { "<a href=\"#training\">Training</a>" };
        let wgsl_link = if matches!(self.engine, Engine::Wgpu { .. }) { "<a href=\"#wgsl\">WGSL</a>" } else { "" };
        let _ = write!(
            h,
            "</header>\n<nav>{training_link}<a href=\"#kernels\">Kernels</a><a href=\"#graphs\">Graphs</a><a href=\"#fusions\">Fusions</a><a href=\"#optimizer\">Optimizer</a>{wgsl_link}<a href=\"#spec\">Spec</a></nav>\n<main>\n"
        );
        h += &self.training();
        h += &self.kernels();
        h += &self.graphs()?;
        h += &self.fusions();
        h += &self.optimizer();
        h += &self.wgsl();
        let _ = writeln!(
            h,
            "<section id=\"spec\"><h2>Spec</h2><p class=\"note mono\">{}</p><pre>{}</pre></section>",
            escape(self.spec_path),
            escape(self.source)
        );
        let _ = writeln!(h, "</main>\n<script>{SCRIPT}</script>\n</body>\n</html>");
        Ok(h)
    }

    /// The headline figures.
    fn cards(&self) -> String {
        let r = &self.stats.report;
        let mut cards = vec![
            ("blocks", self.stats.blocks.to_string()),
            ("dispatches", format!("{} → {}", r.dispatches.0, r.dispatches.1)),
            (
                "FLOPs/token (matmuls)",
                crate::report::human(kiln_compiler::graph::print::matmul_flops(self.graph, self.seq) / self.seq as f64),
            ),
            ("fused ops", explanations(&self.stats.optimized).len().to_string()),
            ("optimize", format!("{:.0} ms", r.optimize_ms)),
        ];
        if let Engine::Wgpu { program, .. } = self.engine {
            cards.insert(2, ("unique kernels", program.kernels.len().to_string()));
        }
        if let Some(profile) = self.profile {
            let total: f64 = profile.seconds.iter().flatten().sum();
            cards.push(("step time (sum)", format!("{:.2} ms", total * 1e3)));
        }
        let mut s = String::from("<div class=\"cards\">");
        for (k, v) in cards {
            let _ = write!(
                s,
                "<div class=\"card\"><div class=\"k\">{}</div><div class=\"v\">{}</div></div>",
                escape(k),
                escape(&v)
            );
        }
        s + "</div>\n"
    }

    /// One row per dispatch of the optimized plan.
    fn kernels(&self) -> String {
        let plan = self.engine.plan();
        let program = match self.engine {
            Engine::Wgpu { program, .. } => Some(program),
            Engine::Cpu { .. } => None,
        };
        let cost = CostModel { seq: self.seq, ..CostModel::default() };
        let syms = HashMap::from([
            (Sym::Batch, 1),
            (Sym::Seq, self.seq),
            (Sym::SrcSeq, self.seq),
            (Sym::Past, 0),
            (Sym::Ctx, self.seq),
        ]);
        let mut s = String::from("<section id=\"kernels\"><h2>Kernels</h2>\n");
        let clock = self.profile.map(|p| p.clock);
        let _ = writeln!(
            s,
            "<p class=\"note\">Every step of the optimized plan as {} runs it, in order. Bytes are those the step touches (read + written: a gather's rows, not its whole table) and FLOPs the optimizer's cost-model estimate, at batch 1, {} tokens{}.</p>",
            escape(&self.engine.describe()),
            self.seq,
            match (self.engine, clock) {
                (Engine::Cpu { .. }, Some(_)) => "; times are the host's clock around each step, its threads included",
                (_, Some(Clock::Device)) => "; times are the device's timestamps around each dispatch",
                (_, Some(Clock::Host)) => {
                    "; the adapter has no timestamp queries, so times are host wall-clock per dispatch (submit and wait, overhead included)"
                }
                (_, None) => "; run with --profile for measured times",
            }
        );
        let time_head = match clock {
            Some(clock) => format!("<th class=\"num\">{}</th><th></th>", escape(&self.engine.time_heading(clock))),
            None => String::new(),
        };
        let kernel_head = if program.is_some() { "<th>kernel</th>" } else { "" };
        let _ = writeln!(
            s,
            "<table><thead><tr><th class=\"num\">step</th>{kernel_head}<th>op</th><th>scope</th><th>shapes (operands → output)</th><th class=\"num\">bytes</th><th class=\"num\">FLOPs</th>{time_head}</tr></thead>\n<tbody>"
        );
        let seconds = self.profile.map(|p| &p.seconds);
        let longest = seconds.map_or(0.0, |t| t.iter().flatten().copied().fold(0.0, f64::max));
        let (mut total_bytes, mut total_flops, mut total_time) = (0.0, 0.0, 0.0);
        for (i, step) in plan.steps.iter().enumerate() {
            let shape = |v: usize| {
                let value = &plan.values[v];
                let format = if value.format.is_f32() { String::new() } else { format!(" {}", value.format) };
                let what = match &value.storage {
                    Storage::Param(name) => format!("{name} "),
                    Storage::Input { name, .. } => format!("{name} "),
                    _ => String::new(),
                };
                format!("{what}{}{:?}{format}", value.dtype, resolve(&value.shape, &syms))
            };
            let operands: Vec<String> =
                step.operands.iter().map(|&o| format!("<span class=\"shape\">{}</span>", escape(&shape(o)))).collect();
            let shapes: Vec<&kiln_compiler::graph::Shape> =
                step.operands.iter().map(|&o| &plan.values[o].shape).collect();
            let work = cost.work(&step.op, &shapes, &plan.values[step.output].shape);
            let moved = match step.op {
                // The rows the ids pick (as many bytes as it writes) and the ids, not the table.
                Op::Gather | Op::GatherColumns { .. } => {
                    let ids =
                        step.operands.last().map_or(0, |&o| resolve(&plan.values[o].shape, &syms).iter().product());
                    2.0 * work.bytes_out + 4.0 * ids as f64
                }
                _ => work.bytes_in + work.bytes_out,
            };
            total_bytes += moved;
            total_flops += work.flops;
            let attrs = step.op.attrs();
            let _ = write!(
                s,
                "<tr><td class=\"num\">{i}</td>{}<td class=\"mono\">{}{}</td><td class=\"mono\">{}</td><td class=\"mono\">{} → <span class=\"shape\">{}</span></td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
                match program {
                    Some(p) =>
                        format!("<td class=\"mono\">{}</td>", escape(p.kernel_of(i).map_or("", |k| k.name.as_str()))),
                    None => String::new(),
                },
                escape(&step.op.name()),
                if attrs.is_empty() {
                    String::new()
                } else {
                    format!(" <span class=\"note\">{}</span>", escape(&attrs))
                },
                escape(&step.scope),
                operands.join(", "),
                escape(&shape(step.output)),
                bytes(moved),
                si(work.flops),
            );
            if let Some(seconds) = seconds {
                match seconds.get(i).copied().flatten() {
                    Some(t) => {
                        total_time += t;
                        let width = if longest > 0.0 { 100.0 * t / longest } else { 0.0 };
                        let _ = write!(
                            s,
                            "<td class=\"num time\">{}</td><td style=\"width:120px\"><div class=\"bar\" style=\"width:{width:.1}%\"></div></td>",
                            duration(t)
                        );
                    }
                    None => s += "<td class=\"num time\">not dispatched</td><td></td>",
                }
            }
            s += "</tr>\n";
        }
        let _ = write!(
            s,
            "</tbody><tfoot><tr><td></td><td colspan=\"{}\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
            if program.is_some() { 4 } else { 3 },
            crate::report::count(plan.steps.len(), if program.is_some() { "dispatch" } else { "step" }),
            bytes(total_bytes),
            si(total_flops)
        );
        if seconds.is_some() {
            let _ = write!(s, "<td class=\"num\">{}</td><td></td>", duration(total_time));
        }
        s + "</tr></tfoot></table></section>\n"
    }

    /// Both graphs, drawn.
    fn graphs(&self) -> Result<String> {
        let mut s = String::from("<section id=\"graphs\"><h2>Graphs</h2>\n");
        // A model of several blocks: its first drawn, the rest (the same ops over again) as one
        // summary node, so that the drawing reads at its natural size.
        let blocks = kiln_compiler::graph::print::block_count(self.graph);
        let layers = match self.layers {
            None if blocks > 1 => Some(0..1),
            layers => layers.clone(),
        };
        let shown = match (&layers, self.layers) {
            (Some(_), None) => format!(
                "Block 0 is drawn and blocks 1..{blocks} are one summary node, so that the drawing reads at its size (<code>--layers 0..{blocks}</code> draws every block). "
            ),
            (Some(r), Some(_)) => {
                format!("Blocks {}..{} are drawn; each run of the others is one summary node. ", r.start, r.end)
            }
            (None, _) => String::new(),
        };
        let _ = writeln!(
            s,
            "<p class=\"note\">{shown}Fused ops are filled and list the rewrite rules that produced them; blocks are the shaded clusters.</p>"
        );
        let mut missing = false;
        for (id, title, graph) in
            [("before", "Before optimization", self.graph), ("after", "After optimization", &self.stats.optimized)]
        {
            let dot = crate::view::dot(graph, &layers);
            let _ = writeln!(
                s,
                "<div class=\"graph fit\" id=\"{id}\"><h3>{title} <button data-fit=\"{id}\">actual size</button></h3>"
            );
            match graphviz(&dot, "svg")? {
                Some(svg) => {
                    let svg = String::from_utf8_lossy(&svg);
                    // Drop the XML prolog and doctype; inline SVG starts at its element.
                    s += &svg[svg.find("<svg").unwrap_or(0)..];
                }
                None => {
                    missing = true;
                    let _ = write!(s, "<pre>{}</pre>", escape(&dot));
                }
            }
            s += "</div>\n";
        }
        if missing {
            s += "<p class=\"note\">Graphviz <code>dot</code> is not installed, so the graphs are given as DOT text; install graphviz to draw them.</p>\n";
        }
        Ok(s + "</section>\n")
    }

    /// Every fused op and the rules that made it.
    fn fusions(&self) -> String {
        let mut s = String::from("<section id=\"fusions\"><h2>Fusions</h2>\n");
        let fused = explanations(&self.stats.optimized);
        if fused.is_empty() {
            return s + "<p class=\"note\">The optimizer fused nothing in this graph.</p></section>\n";
        }
        let _ = writeln!(
            s,
            "<p class=\"note\">{} in all; one row per fused op, part of a block and rules, with the blocks it was made in.</p>",
            crate::report::count(fused.len(), "fused op")
        );
        s += "<table><thead><tr><th>fused op</th><th>scope</th><th class=\"num\">count</th><th>rules that produced it</th></tr></thead><tbody>\n";
        for group in group_fusions(&fused) {
            let chips: Vec<String> =
                group.rules.iter().map(|r| format!("<span class=\"rule\">{}</span>", escape(r))).collect();
            let _ = writeln!(
                s,
                "<tr><td class=\"mono\">{}</td><td class=\"mono\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                escape(&group.op),
                escape(&group.scope()),
                group.count(),
                chips.join("")
            );
        }
        s + "</tbody></table></section>\n"
    }

    /// What `kiln inspect --stats` reports.
    fn optimizer(&self) -> String {
        let st = self.stats;
        let r = &st.report;
        let mut s = String::from("<section id=\"optimizer\"><h2>Optimizer</h2>\n<table class=\"kv narrow\"><tbody>\n");
        let rows = [
            ("dispatches".to_string(), format!("{} → {}", r.dispatches.0, r.dispatches.1)),
            (
                format!("intermediate bytes (batch 1, seq {})", st.seq),
                format!("{} → {}", bytes(st.intermediate_bytes.0 as f64), bytes(st.intermediate_bytes.1 as f64)),
            ),
            (
                format!("live peak bytes (batch 1, seq {})", st.seq),
                format!("{} → {}", bytes(st.live_peak_bytes.0 as f64), bytes(st.live_peak_bytes.1 as f64)),
            ),
            ("e-graph".to_string(), format!("{} nodes, {} classes", r.egraph_nodes, r.egraph_classes)),
            ("optimize time".to_string(), format!("{:.1} ms", r.optimize_ms)),
        ];
        for (k, v) in rows {
            let _ = writeln!(s, "<tr><td>{}</td><td>{}</td></tr>", escape(&k), escape(&v));
        }
        s += "</tbody></table>\n<h3>Phases</h3><table class=\"narrow\"><thead><tr><th>phase</th><th class=\"num\">iterations</th><th>stopped because</th></tr></thead><tbody>\n";
        for (phase, iterations, why) in &r.phases {
            let _ = writeln!(
                s,
                "<tr><td class=\"mono\">{}</td><td class=\"num\">{iterations}</td><td>{}</td></tr>",
                escape(phase),
                escape(why)
            );
        }
        s += "</tbody></table>\n<h3>Rules fired</h3><table class=\"narrow\"><thead><tr><th>rule</th><th class=\"num\">times</th></tr></thead><tbody>\n";
        for (rule, n) in &r.applied {
            let _ = writeln!(s, "<tr><td class=\"mono\">{}</td><td class=\"num\">{n}</td></tr>", escape(rule));
        }
        let _ = writeln!(
            s,
            "</tbody></table>\n<details><summary><code>kiln inspect --stats</code></summary><pre>{}</pre></details>\n</section>",
            escape(&st.text())
        );
        s
    }

    /// The WGSL of every kernel, folded.
    fn wgsl(&self) -> String {
        let Engine::Wgpu { program, .. } = self.engine else { return String::new() };
        let mut s = String::from(
            "<section id=\"wgsl\"><h2>WGSL</h2>\n<p class=\"note\">Each unique kernel once, validated by naga when the plan was compiled for wgpu.</p>\n",
        );
        for (k, kernel) in program.kernels.iter().enumerate() {
            let uses = program.step_kernels.iter().filter(|&&used| used == k).count();
            let _ = writeln!(
                s,
                "<details><summary><span class=\"mono\">kernel {k}: {}</span> <span class=\"note\">· {uses} dispatch{} · {} lines</span></summary><pre>{}</pre></details>",
                escape(&kernel.name),
                if uses == 1 { "" } else { "es" },
                kernel.wgsl.lines().count(),
                escape(&kernel.wgsl)
            );
        }
        s + "</section>\n"
    }
}

/// Fused ops of one kind, part of a block and rules, with the blocks they were made in.
#[derive(Debug, PartialEq)]
struct FusionGroup {
    op: String,
    /// The stack (`layers`) with the part of the block (`attn`), or a scope outside blocks.
    stack: Option<(String, String)>,
    /// The scope outside blocks.
    scope: String,
    /// Block indices, ascending (empty outside blocks).
    blocks: Vec<usize>,
    /// Occurrences.
    n: usize,
    rules: Vec<&'static str>,
}

impl FusionGroup {
    /// `layers.0..8.attn`, `layers.0, 2..4`, or the scope outside blocks.
    fn scope(&self) -> String {
        let Some((stack, part)) = &self.stack else { return self.scope.clone() };
        let mut runs: Vec<String> = Vec::new();
        let mut i = 0;
        while let Some(&start) = self.blocks.get(i) {
            let mut end = start + 1;
            while self.blocks.get(i + 1) == Some(&end) {
                end += 1;
                i += 1;
            }
            runs.push(if end == start + 1 { start.to_string() } else { format!("{start}..{end}") });
            i += 1;
        }
        let blocks = runs.join(", ");
        let blocks = if runs.len() > 1 { format!("{{{blocks}}}") } else { blocks };
        if part.is_empty() { format!("{stack}.{blocks}") } else { format!("{stack}.{blocks}.{part}") }
    }

    /// `8 blocks`, or how often the op was made outside blocks.
    fn count(&self) -> String {
        match self.stack {
            Some(_) => crate::report::count(self.blocks.len(), "block"),
            None => self.n.to_string(),
        }
    }
}

/// The fused ops grouped by op, part of a block (or scope outside blocks) and rules, in the order
/// each group first appears: a fusion every block repeats is one row, as `kiln diff` groups
/// blocks.
fn group_fusions(fused: &[(String, String, Vec<&'static str>)]) -> Vec<FusionGroup> {
    let mut groups: Vec<FusionGroup> = Vec::new();
    for (op, scope, rules) in fused {
        let (stack, block) = match block_of(scope) {
            Some((stack, i, part)) => (Some((stack.to_string(), part.to_string())), Some(i)),
            None => (None, None),
        };
        let same = |g: &FusionGroup| {
            g.op == *op && g.stack == stack && g.rules == *rules && (stack.is_some() || g.scope == *scope)
        };
        let at = match groups.iter().position(same) {
            Some(at) => at,
            None => {
                groups.push(FusionGroup {
                    op: op.clone(),
                    stack: stack.clone(),
                    scope: scope.clone(),
                    blocks: Vec::new(),
                    n: 0,
                    rules: rules.clone(),
                });
                groups.len() - 1
            }
        };
        if let Some(group) = groups.get_mut(at) {
            group.n += 1;
            if let Some(i) = block
                && let Err(at) = group.blocks.binary_search(&i)
            {
                group.blocks.insert(at, i);
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fusions_repeated_per_block_are_one_row() {
        let fused: Vec<(String, String, Vec<&'static str>)> = (0..8)
            .flat_map(|i| {
                [
                    ("linear".to_string(), format!("layers.{i}.attn"), vec!["matmul-bias"]),
                    ("add_norm".to_string(), format!("layers.{i}"), vec!["add-norm"]),
                ]
            })
            .chain([("linear".to_string(), "head".to_string(), vec!["matmul-bias"])])
            .filter(|(op, scope, _)| !(op == "add_norm" && scope == "layers.5"))
            .collect();
        let groups = group_fusions(&fused);
        let rows: Vec<(String, String)> = groups.iter().map(|g| (g.scope(), g.count())).collect();
        assert_eq!(
            rows,
            [
                ("layers.0..8.attn".to_string(), "8 blocks".to_string()),
                ("layers.{0..5, 6..8}".to_string(), "7 blocks".to_string()),
                ("head".to_string(), "1".to_string()),
            ]
        );
    }
}
