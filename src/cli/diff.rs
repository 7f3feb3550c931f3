//! `kiln diff A B`: what changed between two variants of a model (specs or `.kiln` artifacts), as
//! text or as an HTML page drawing both graphs side by side.
//!
//! Nodes are matched by **stable names** ([`names`]): a parameter or an input by its own name,
//! any other op by its scope, its op name and its ordinal among the ops of that name in that scope
//! (`layers.2.attn/rope#1`, in topological order). An op added or removed in one scope renames
//! nothing in another, nor any op of another name in its own, so a one-knob change reads as the
//! few ops it touches. A node present in both graphs is *changed* when its op and attributes, its
//! type or its operands (by their stable names) differ.
//!
//! Changes are listed per block (`layers.N`, by their part: `attn/rope#0`), and runs of blocks of
//! one stack whose changes are the same are listed once (`layers.0..4`); an operand in another
//! block of the same stack is written relative to it (`layers[-1].ffn/add#1`), so the blocks of a
//! stack compare equal. Above the changes, both graphs' totals: parameters, matmul FLOPs per token,
//! kernel dispatches and intermediate bytes (in binary units; raw counts in `--json`).

use anyhow::{Context, Result};
use clap::ValueEnum;
use kiln_compiler::FrontEnd;
use kiln_compiler::artifact::Artifact;
use kiln_compiler::graph::print::{self, block_of};
use kiln_compiler::graph::{Graph, Op, Sym, fmt_shape};
use kiln_compiler::memory::human;
use kiln_compiler::{lower, optimize};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::html::escape;
use crate::view::{dot, graphviz};

/// `kiln diff`'s arguments.
#[derive(clap::Args)]
pub struct DiffArgs {
    /// The first variant: a spec (TOML) or a compiled artifact (`.kiln`).
    a: PathBuf,
    /// The second variant, likewise.
    b: PathBuf,
    /// Which graphs to compare: as built from the specs, or after the optimizer (for the default
    /// target).
    #[arg(long, value_enum, default_value_t = Stage::Graph)]
    stage: Stage,
    /// Sequence length (batch 1) at which FLOPs per token and intermediate bytes are counted.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Instead: write one self-contained HTML page to this file, the changes above both graphs
    /// drawn side by side (changed ops outlined).
    #[arg(long)]
    html: Option<PathBuf>,
    #[command(flatten)]
    force: crate::output::Force,
    /// Print one JSON document on stdout instead of text (the totals of both, and the changes
    /// per block or scope).
    #[arg(long, conflicts_with = "html")]
    json: bool,
    /// With `--html`: draw only these blocks (`0..2`, half-open, or `3` for one).
    #[arg(long, requires = "html", value_parser = crate::cli::inspect::parse_layers)]
    layers: Option<Range<usize>>,
}

/// The graphs `diff` compares.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Stage {
    /// The graphs as built from the specs.
    Graph,
    /// The graphs after the e-graph optimizer.
    Optimized,
}

/// Runs `kiln diff`.
pub fn run(args: DiffArgs) -> Result<()> {
    if args.seq == 0 {
        anyhow::bail!("--seq must be at least 1");
    }
    if let Some(path) = &args.html {
        crate::output::check("--html", path, &[("A", &args.a), ("B", &args.b)], args.force.force)?;
    }
    let a = variant(&args.a, args.stage)?;
    let b = variant(&args.b, args.stage)?;
    let diff = Diff::new(&a, &b, args.seq);
    match &args.html {
        Some(path) => {
            let page = html(&args, &a, &b, &diff)?;
            kiln_compiler::file::write_atomic(path, page.as_bytes())
                .with_context(|| format!("cannot write `{}`", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None if args.json => {
            let doc = diff.json(&args.a.display().to_string(), &args.b.display().to_string());
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        None => print!("{}", diff.text(&args.a.display().to_string(), &args.b.display().to_string())),
    }
    Ok(())
}

/// The graph of a spec or an artifact (rebuilt from the spec it stores) at `stage`.
fn variant(path: &Path, stage: Stage) -> Result<Graph> {
    let graph = load(path)?.graph;
    Ok(match stage {
        Stage::Graph => graph,
        Stage::Optimized => optimize::optimize(&graph)?.0,
    })
}

/// The front end of a spec file (or a built-in name, or a checkpoint's imported spec) or of the
/// spec an artifact stores.
fn load(path: &Path) -> Result<FrontEnd> {
    let (file, source) = if Artifact::sniff(path) {
        let artifact = Artifact::read(path)?;
        (format!("{} (in {})", artifact.spec_file, path.display()), artifact.spec_source)
    } else {
        let (source, label) = crate::model_file::spec_text(path)?;
        (label, source)
    };
    Ok(kiln_compiler::front_end(&file, &source)?)
}

/// Every node's stable name (see the module documentation), by node index.
pub fn names(g: &Graph) -> HashMap<usize, String> {
    let mut count: HashMap<(&str, String), usize> = HashMap::new();
    let mut names = HashMap::new();
    for n in g.order() {
        let node = &g.g[n];
        let name = match &node.op {
            Op::Param { name } => name.clone(),
            Op::Input { name, .. } => format!("input:{name}"),
            op => {
                let k = count.entry((node.scope.as_str(), op.name())).or_default();
                *k += 1;
                format!("{}/{}#{}", node.scope, op.name(), *k - 1)
            }
        };
        names.insert(n.index(), name);
    }
    names
}

/// Totals of one graph.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Totals {
    /// Parameter elements.
    parameters: u64,
    /// Matrix-multiply FLOPs per token at batch 1 ([`print::matmul_flops`], the count `check`
    /// prints), the same before and after fusion.
    flops_per_token: f64,
    /// Kernel dispatches.
    dispatches: usize,
    /// Intermediate bytes the lowered plan places, at batch 1.
    intermediate_bytes: u64,
}

impl Totals {
    fn of(g: &Graph, seq: usize) -> Totals {
        let summary = print::summary(g, seq);
        let syms =
            HashMap::from([(Sym::Batch, 1), (Sym::Seq, seq), (Sym::SrcSeq, seq), (Sym::Past, 0), (Sym::Ctx, seq)]);
        Totals {
            parameters: summary.parameters,
            flops_per_token: summary.flops_per_token,
            dispatches: optimize::dispatches(g),
            intermediate_bytes: lower::lower(g).memory(&syms).0,
        }
    }
}

/// What happened to a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Removed,
    Added,
    Changed,
}

impl Kind {
    fn sign(self) -> char {
        match self {
            Kind::Removed => '-',
            Kind::Added => '+',
            Kind::Changed => '~',
        }
    }
}

/// One changed node, named relative to its group.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Change {
    kind: Kind,
    /// Its stable name, relative to the block for a node of a block.
    name: String,
    /// The node (added, removed) or what changed in it.
    detail: String,
}

/// The changes of one scope outside blocks, or of a run of blocks with the same changes.
#[derive(Clone, Debug, PartialEq)]
struct Group {
    /// `embed`, `layers.0..4`, ...
    title: String,
    /// The blocks of the run (1 outside blocks).
    blocks: usize,
    changes: Vec<Change>,
}

/// The difference of two graphs.
struct Diff {
    seq: usize,
    totals: (Totals, Totals),
    groups: Vec<Group>,
    /// Outputs added, removed or read from another node.
    outputs: Vec<Change>,
    /// The nodes of each graph that changed (removed or changed in A, added or changed in B).
    marked: (Vec<usize>, Vec<usize>),
}

/// Where a node is listed: a scope outside blocks, or a block of a stack.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Place {
    Scope(String),
    Block(String, usize),
}

/// A node as the diff compares it: op with attributes, type, operands by stable name.
struct Seen<'a> {
    /// The node's index.
    n: usize,
    scope: &'a str,
    op: String,
    ty: String,
    operands: Vec<&'a str>,
}

fn seen<'a>(g: &'a Graph, names: &'a HashMap<usize, String>) -> BTreeMap<&'a str, Seen<'a>> {
    g.order()
        .into_iter()
        .map(|n| {
            let node = &g.g[n];
            let attrs = node.op.attrs();
            let op = if attrs.is_empty() { node.op.name() } else { format!("{} {attrs}", node.op.name()) };
            let operands = g.operands(n).iter().map(|o| names[&o.index()].as_str()).collect();
            let ty = format!("{}{}", node.dtype, fmt_shape(&node.shape));
            let seen = Seen { n: n.index(), scope: &node.scope, op, ty, operands };
            (names[&n.index()].as_str(), seen)
        })
        .collect()
}

impl Diff {
    fn new(a: &Graph, b: &Graph, seq: usize) -> Diff {
        let (names_a, names_b) = (names(a), names(b));
        let (seen_a, seen_b) = (seen(a, &names_a), seen(b, &names_b));
        let mut by_place: BTreeMap<Place, Vec<Change>> = BTreeMap::new();
        let mut marked = (Vec::new(), Vec::new());
        let mut note = |scope: &str, kind: Kind, name: &str, detail: String| {
            by_place.entry(place(scope)).or_default().push(Change { kind, name: name.to_string(), detail });
        };
        for (name, x) in &seen_a {
            match seen_b.get(name) {
                None => {
                    note(x.scope, Kind::Removed, name, describe(x));
                    marked.0.push(x.n);
                }
                Some(y) => {
                    let mut what = Vec::new();
                    if x.op != y.op {
                        what.push(format!("{} -> {}", x.op, y.op));
                    }
                    if x.ty != y.ty {
                        what.push(format!("{} -> {}", x.ty, y.ty));
                    }
                    if x.operands != y.operands {
                        what.push(format!("reads ({}) -> ({})", x.operands.join(", "), y.operands.join(", ")));
                    }
                    if !what.is_empty() {
                        note(y.scope, Kind::Changed, name, what.join("; "));
                        marked.0.push(x.n);
                        marked.1.push(y.n);
                    }
                }
            }
        }
        for (name, y) in &seen_b {
            if !seen_a.contains_key(name) {
                note(y.scope, Kind::Added, name, describe(y));
                marked.1.push(y.n);
            }
        }

        // Places in the order data flows through them (see `place_ranks`), each place's changes
        // as text relative to it, then runs of equal blocks merged.
        let rank = place_ranks(a, b);
        let mut by_place: Vec<(Place, Vec<Change>)> = by_place.into_iter().collect();
        by_place.sort_by_key(|(p, _)| (rank.get(p).copied().unwrap_or((usize::MAX, usize::MAX)), p.clone()));
        let mut groups: Vec<(Place, Group)> = Vec::new();
        for (place, changes) in by_place {
            let mut changes: Vec<Change> = changes
                .into_iter()
                .map(|c| Change {
                    kind: c.kind,
                    name: relative(&place, &c.name),
                    detail: relative_refs(&place, &c.detail),
                })
                .collect();
            changes.sort();
            let next = match (&place, groups.last_mut()) {
                (Place::Block(stack, i), Some((Place::Block(last_stack, last), group)))
                    if stack == last_stack && *i == *last + 1 && group.changes == changes =>
                {
                    group.blocks += 1;
                    group.title = format!("{stack}.{}..{}", *i + 1 - group.blocks, *i + 1);
                    *last = *i;
                    None
                }
                (Place::Block(stack, i), _) => Some(Group { title: format!("{stack}.{i}"), blocks: 1, changes }),
                (Place::Scope(scope), _) => {
                    let title = if scope.is_empty() { "(top level)".to_string() } else { scope.clone() };
                    Some(Group { title, blocks: 1, changes })
                }
            };
            if let Some(group) = next {
                groups.push((place, group));
            }
        }

        let output_names = |g: &Graph, names: &HashMap<usize, String>| -> BTreeMap<String, String> {
            g.outputs.iter().map(|(o, n)| (o.clone(), names[&n.index()].clone())).collect()
        };
        let (outs_a, outs_b) = (output_names(a, &names_a), output_names(b, &names_b));
        let mut outputs = Vec::new();
        for (o, x) in &outs_a {
            match outs_b.get(o) {
                None => outputs.push(Change { kind: Kind::Removed, name: o.to_string(), detail: format!("= {x}") }),
                Some(y) if x != y => {
                    outputs.push(Change { kind: Kind::Changed, name: o.to_string(), detail: format!("= {x} -> {y}") })
                }
                Some(_) => {}
            }
        }
        for (o, y) in &outs_b {
            if !outs_a.contains_key(o) {
                outputs.push(Change { kind: Kind::Added, name: o.to_string(), detail: format!("= {y}") });
            }
        }

        Diff {
            seq,
            totals: (Totals::of(a, seq), Totals::of(b, seq)),
            groups: groups.into_iter().map(|(_, g)| g).collect(),
            outputs,
            marked,
        }
    }

    /// Ops (added, removed, changed) over every block and scope.
    fn counts(&self) -> (usize, usize, usize) {
        let mut counts = (0, 0, 0);
        for group in &self.groups {
            for c in &group.changes {
                let slot = match c.kind {
                    Kind::Added => &mut counts.0,
                    Kind::Removed => &mut counts.1,
                    Kind::Changed => &mut counts.2,
                };
                *slot += group.blocks;
            }
        }
        counts
    }

    /// The totals as a table of lines: name, A, B, change.
    fn total_rows(&self) -> Vec<[String; 4]> {
        let (a, b) = &self.totals;
        let int = |name: &str, x: u64, y: u64| {
            [
                name.to_string(),
                x.to_string(),
                y.to_string(),
                signed(y as f64 - x as f64, x as f64, |d| format!("{d:+}")),
            ]
        };
        // Bytes in binary units, as every command writes them (`--json` keeps the raw count).
        let bytes = |name: &str, x: u64, y: u64| {
            [
                name.to_string(),
                human(x),
                human(y),
                signed(y as f64 - x as f64, x as f64, |d| {
                    format!("{}{}", if d < 0.0 { '-' } else { '+' }, human(d.abs() as u64))
                }),
            ]
        };
        vec![
            int("parameters", a.parameters, b.parameters),
            [
                format!("FLOPs/token (matmuls, seq {})", self.seq),
                crate::report::human(a.flops_per_token),
                crate::report::human(b.flops_per_token),
                signed(b.flops_per_token - a.flops_per_token, a.flops_per_token, |d| {
                    format!("{}{}", if d < 0.0 { '-' } else { '+' }, crate::report::human(d.abs()))
                }),
            ],
            int("dispatches", a.dispatches as u64, b.dispatches as u64),
            bytes(&format!("intermediates (seq {})", self.seq), a.intermediate_bytes, b.intermediate_bytes),
        ]
    }

    /// The diff as one JSON document (`--json`).
    fn json(&self, a: &str, b: &str) -> serde_json::Value {
        let totals = |t: &Totals| {
            serde_json::json!({
                "parameters": t.parameters,
                "flops_per_token": t.flops_per_token,
                "dispatches": t.dispatches,
                "intermediate_bytes": t.intermediate_bytes,
            })
        };
        let changes = |changes: &[Change]| -> Vec<serde_json::Value> {
            changes
                .iter()
                .map(|c| {
                    let kind = match c.kind {
                        Kind::Added => "added",
                        Kind::Removed => "removed",
                        Kind::Changed => "changed",
                    };
                    serde_json::json!({ "kind": kind, "name": c.name, "detail": c.detail })
                })
                .collect()
        };
        let (added, removed, changed) = self.counts();
        serde_json::json!({
            "a": { "path": a, "totals": totals(&self.totals.0) },
            "b": { "path": b, "totals": totals(&self.totals.1) },
            "at": format!("batch 1, seq {}", self.seq),
            "ops": { "added": added, "removed": removed, "changed": changed },
            "groups": self.groups.iter().map(|g| serde_json::json!({
                "title": g.title,
                "blocks": g.blocks,
                "changes": changes(&g.changes),
            })).collect::<Vec<_>>(),
            "outputs": changes(&self.outputs),
        })
    }

    /// The diff as text.
    fn text(&self, a: &str, b: &str) -> String {
        let mut s = format!("--- {a}\n+++ {b}\n\n");
        let rows = self.total_rows();
        let width = |i: usize| rows.iter().map(|r| r[i].len()).max().unwrap_or(0).max(1);
        let (w0, w1, w2) = (width(0), width(1).max(1), width(2).max(1));
        let _ = writeln!(s, "{:<w0$}  {:>w1$}  {:>w2$}  change", "", "A", "B");
        for [name, x, y, d] in &rows {
            let _ = writeln!(s, "{name:<w0$}  {x:>w1$}  {y:>w2$}  {d}");
        }
        let (added, removed, changed) = self.counts();
        let _ = writeln!(s, "\nops: {added} added, {removed} removed, {changed} changed");
        if self.groups.is_empty() && self.outputs.is_empty() {
            s += "\nthe graphs are the same\n";
            return s;
        }
        for group in &self.groups {
            let count = |kind: Kind| group.changes.iter().filter(|c| c.kind == kind).count();
            let counts = format!(
                "{} added, {} removed, {} changed",
                count(Kind::Added),
                count(Kind::Removed),
                count(Kind::Changed)
            );
            let each = if group.blocks > 1 { format!("each of {} blocks: ", group.blocks) } else { String::new() };
            let _ = writeln!(s, "\n{} ({each}{counts})", group.title);
            push_changes(&mut s, &group.changes);
        }
        if !self.outputs.is_empty() {
            s += "\noutputs\n";
            push_changes(&mut s, &self.outputs);
        }
        s
    }
}

/// A change `d` relative to `base`: `+3 (+1.5%)`, or `0` when nothing changed.
fn signed(d: f64, base: f64, fmt: impl Fn(f64) -> String) -> String {
    if d == 0.0 {
        return "0".into();
    }
    match base {
        0.0 => fmt(d),
        _ => format!("{} ({:+.1}%)", fmt(d), 100.0 * d / base),
    }
}

fn push_changes(s: &mut String, changes: &[Change]) {
    let width = changes.iter().map(|c| c.name.len()).max().unwrap_or(0);
    for c in changes {
        let _ = writeln!(s, "  {} {:<width$}  {}", c.kind.sign(), c.name, c.detail);
    }
}

/// A node added or removed: its op, type and operands.
fn describe(x: &Seen) -> String {
    let reads = if x.operands.is_empty() { String::new() } else { format!(" ({})", x.operands.join(", ")) };
    format!("{}{reads} : {}", x.op, x.ty)
}

/// Where each place is listed: by how deep in the data flow its deepest node lies (the longest
/// path to it from a parameter or input; a parameter's, just before its first reader's) in
/// either graph — so embeddings come
/// before blocks and the head after them whatever order an optimized graph's nodes are in — and
/// the blocks of a stack together, in ascending order, at the rank of the stack's first-listed
/// block. A rank is (depth, block index).
fn place_ranks(a: &Graph, b: &Graph) -> HashMap<Place, (usize, usize)> {
    let mut deepest: HashMap<Place, usize> = HashMap::new();
    for g in [a, b] {
        let order = g.order();
        let mut depth: HashMap<usize, usize> = HashMap::new();
        // A node without operands (a parameter, an input) sits just before its first reader.
        let mut first_read: HashMap<usize, usize> = HashMap::new();
        for &n in &order {
            let operands = g.operands(n);
            let d = operands.iter().map(|o| depth.get(&o.index()).map_or(0, |d| d + 1)).max().unwrap_or(0);
            depth.insert(n.index(), d);
            for o in operands {
                let first = first_read.entry(o.index()).or_insert(d);
                *first = (*first).min(d);
            }
        }
        let mut here: HashMap<Place, usize> = HashMap::new();
        for &n in &order {
            let d = match g.operands(n).is_empty() {
                true => first_read.get(&n.index()).map_or(0, |d| d.saturating_sub(1)),
                false => depth.get(&n.index()).copied().unwrap_or(0),
            };
            let max = here.entry(place(&g.g[n].scope)).or_default();
            *max = (*max).max(d);
        }
        for (p, d) in here {
            let max = deepest.entry(p).or_default();
            *max = (*max).max(d);
        }
    }
    let mut stacks: HashMap<String, usize> = HashMap::new();
    for (p, d) in &deepest {
        if let Place::Block(stack, _) = p {
            let min = stacks.entry(stack.clone()).or_insert(*d);
            *min = (*min).min(*d);
        }
    }
    deepest
        .iter()
        .map(|(p, d)| {
            let rank = match p {
                Place::Block(stack, i) => (stacks.get(stack).copied().unwrap_or(*d), *i),
                Place::Scope(_) => (*d, 0),
            };
            (p.clone(), rank)
        })
        .collect()
}

fn place(scope: &str) -> Place {
    match block_of(scope) {
        Some((stack, i, _)) => Place::Block(stack.to_string(), i),
        None => Place::Scope(scope.to_string()),
    }
}

/// A stable name written relative to `place`: inside the same block, without its prefix
/// (`attn/rope#0`); in another block of the same stack, `stack[±k].rest`; otherwise as it is.
fn relative(place: &Place, name: &str) -> String {
    let Place::Block(stack, i) = place else { return name.to_string() };
    let scope = name.split('/').next().unwrap_or("");
    match block_of(scope) {
        Some((s, j, _)) if s == stack => {
            let rest = name.strip_prefix(&format!("{stack}.{j}")).unwrap_or(name).trim_start_matches('.');
            if j == *i { rest.to_string() } else { format!("{stack}[{:+}].{rest}", j as i64 - *i as i64) }
        }
        _ => name.to_string(),
    }
}

/// [`relative`] applied to every stable name in a piece of text (names are separated by spaces,
/// commas, parentheses and quotes, so a block's parameter, `param "layers.3.attn_norm.bias"`,
/// reads the same in every block).
fn relative_refs(place: &Place, text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if matches!(c, ' ' | ',' | '(' | ')' | '"') {
            if !word.is_empty() {
                out += &relative(place, &word);
                word.clear();
            }
            out.push(c);
        } else {
            word.push(c);
        }
    }
    out.pop();
    out
}

/// Outline of a changed op in the drawings.
const CHANGED_LINE: &str = "#b42318";

/// The page `--html` writes: totals, changes, both graphs drawn side by side.
fn html(args: &DiffArgs, a: &Graph, b: &Graph, diff: &Diff) -> Result<String> {
    let (pa, pb) = (args.a.display().to_string(), args.b.display().to_string());
    let mut h = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>kiln diff: {} vs {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(&pa),
        escape(&pb)
    );
    let _ = writeln!(
        h,
        "<h1>kiln diff</h1>\n<p><span class=\"a\">A</span> <code>{}</code> · <span class=\"b\">B</span> <code>{}</code></p>",
        escape(&pa),
        escape(&pb)
    );
    h += "<table>\n<tr><th></th><th>A</th><th>B</th><th>change</th></tr>\n";
    for row in diff.total_rows() {
        let _ = writeln!(h, "<tr>{}</tr>", row.iter().map(|c| format!("<td>{}</td>", escape(c))).collect::<String>());
    }
    h += "</table>\n";
    let _ = writeln!(h, "<h2>Changes</h2>\n<pre>{}</pre>", escape(&diff.text(&pa, &pb)));
    h += "<h2>Graphs</h2>\n<p class=\"note\">Ops removed or changed are outlined in A, ops added or changed in B.</p>\n<div class=\"sides\">\n";
    for (label, path, graph, marked) in [("A", &pa, a, &diff.marked.0), ("B", &pb, b, &diff.marked.1)] {
        crate::cli::inspect::check_layers(graph, &args.layers)?;
        let text = outlined(&dot(graph, &args.layers), graph, marked, &args.layers);
        let drawing = match graphviz(&text, "svg")? {
            Some(svg) => String::from_utf8_lossy(&svg).into_owned(),
            None => format!("<pre>{}</pre>", escape(&text)),
        };
        let _ = writeln!(h, "<div class=\"side\"><h3>{label}: <code>{}</code></h3>{drawing}</div>", escape(path));
    }
    h += "</div>\n</body>\n</html>\n";
    Ok(h)
}

/// `dot` with the `marked` nodes outlined, those `layers` draws.
fn outlined(dot: &str, g: &Graph, marked: &[usize], layers: &Option<Range<usize>>) -> String {
    let scopes: HashMap<usize, &str> = g.order().into_iter().map(|n| (n.index(), g.g[n].scope.as_str())).collect();
    let drawn = |n: &usize| match (layers, scopes.get(n).and_then(|s| block_of(s))) {
        (Some(range), Some((_, i, _))) => range.contains(&i),
        _ => true,
    };
    let mut lines = String::new();
    for n in marked.iter().filter(|n| drawn(n)) {
        let _ = writeln!(lines, "  n{n} [color=\"{CHANGED_LINE}\", penwidth=3];");
    }
    match dot.rfind('}') {
        Some(end) => format!("{}{lines}}}\n", &dot[..end]),
        None => dot.to_string(),
    }
}

const STYLE: &str = r#"
body { margin: 1.5em; font: 14px/1.5 system-ui, sans-serif; color: #1f2933; }
code, pre { font-family: ui-monospace, monospace; font-size: 12px; }
pre { background: #f5f7fa; padding: 1em; overflow-x: auto; }
table { border-collapse: collapse; } td, th { padding: 2px 12px; border-bottom: 1px solid #d9e2ec; text-align: right; }
td:first-child { text-align: left; }
.a, .b { font-weight: bold; } .note { color: #616e7c; }
.sides { display: flex; gap: 1em; align-items: flex-start; }
.side { flex: 1 1 0; min-width: 0; overflow: auto; border: 1px solid #d9e2ec; padding: 0.5em; }
.side svg { max-width: 100%; height: auto; }
"#;
