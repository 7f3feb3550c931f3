//! Loss curves as SVG: the training logs `kiln train --log` writes (a JSON line per step with
//! `step` and `loss`, and lines with `eval_loss` at evaluations), drawn on shared axes, one colour
//! per run — training loss as a line (optionally smoothed by a moving average), evaluation loss
//! as dots on the same colour. Written by hand: a chart is a few dozen SVG elements, and the
//! format is text a test can read back.

use anyhow::{Context, Result, bail};
use std::fmt::Write;
use std::path::Path;

/// One run's curves.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    /// The name in the legend.
    pub name: String,
    /// `(step, loss)` of each training step.
    pub train: Vec<(f64, f64)>,
    /// `(step, loss)` of each evaluation (the final one at the step after the last).
    pub eval: Vec<(f64, f64)>,
}

impl Run {
    /// The run logged in `path`, named after the file.
    pub fn read(path: &Path) -> Result<Run> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("cannot read the log `{}`", path.display()))?;
        let name = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        let mut run = Run { name, ..Run::default() };
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value = match serde_json::from_str(line) {
                Ok(v) => v,
                // The last line of a log being written, cut short.
                Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
                Err(e) => bail!("`{}` line {}: not a JSON line ({e})", path.display(), i + 1),
            };
            let num = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
            match (num("step"), num("loss"), num("eval_loss")) {
                (Some(step), Some(loss), _) => run.train.push((step, loss)),
                (Some(step), None, Some(eval)) => run.eval.push((step, eval)),
                (None, _, Some(eval)) => {
                    let last = run.train.last().map_or(0.0, |p| p.0 + 1.0);
                    run.eval.push((last, eval));
                }
                _ => {}
            }
        }
        if run.train.is_empty() && run.eval.is_empty() {
            bail!("`{}` holds no `loss` or `eval_loss` line (is it a `kiln train --log` file?)", path.display());
        }
        Ok(run)
    }
}

/// Moving average over `window` points (1: the points as they are).
fn smooth(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let w = window.max(1);
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, _))| {
            let from = (i + 1).saturating_sub(w);
            let slice = points.get(from..=i).unwrap_or_default();
            (x, slice.iter().map(|p| p.1).sum::<f64>() / slice.len().max(1) as f64)
        })
        .collect()
}

/// About `n` round tick values covering `[lo, hi]`.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| span / s <= n as f64).unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    (0..=n * 2).map(|i| first + i as f64 * step).take_while(|t| *t <= hi + step * 1e-9).collect()
}

/// Colours of the runs, in order (a qualitative palette readable on white).
const COLOURS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

/// The SVG of `runs`' curves, titled `title`, training losses smoothed over `window` steps.
pub fn svg(runs: &[Run], title: &str, window: usize) -> String {
    // The legend's width from its longest entry (about 7 px a character at 12 px).
    let longest = runs.iter().map(|r| r.name.chars().count() + r.eval.last().map_or(0, |_| 8)).max().unwrap_or(0);
    let right = 60.0 + 7.0 * longest as f64;
    let (w, h) = (540.0 + right, 440.0);
    let (left, top, bottom) = (64.0, 56.0, 48.0);
    let all = runs.iter().flat_map(|r| r.train.iter().chain(&r.eval)).filter(|p| p.0.is_finite() && p.1.is_finite());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-9 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(1e-6);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let px = |x: f64| left + (x - x0) / (x1 - x0) * (w - left - right);
    let py = |y: f64| top + (y1 - y) / (y1 - y0) * (h - top - bottom);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
        (left + w - right) / 2.0,
        escape(title)
    );
    for t in ticks(x0, x1, 6) {
        let x = px(t);
        let _ = writeln!(s, r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/>"##, h - bottom);
        let _ =
            writeln!(s, r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, h - bottom + 16.0, fmt_tick(t));
    }
    for t in ticks(y0, y1, 6) {
        let y = py(t);
        let _ = writeln!(s, r##"<line x1="{left}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/>"##, w - right);
        let _ =
            writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, left - 6.0, y + 4.0, fmt_tick(t));
    }
    let _ = writeln!(
        s,
        r##"<rect x="{left}" y="{top}" width="{:.1}" height="{:.1}" fill="none" stroke="#888"/>"##,
        w - left - right,
        h - top - bottom
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#,
        (left + w - right) / 2.0,
        h - 12.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">loss (nats per token)</text>"#,
        (top + h - bottom) / 2.0,
        (top + h - bottom) / 2.0
    );
    for (i, run) in runs.iter().enumerate() {
        let colour = COLOURS.get(i % COLOURS.len()).copied().unwrap_or("black");
        let line: Vec<String> = smooth(&run.train, window)
            .iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if !line.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
                line.join(" ")
            );
        }
        for &(x, y) in run.eval.iter().filter(|p| p.1.is_finite()) {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="white" stroke="{colour}" stroke-width="1.5"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = top + 14.0 + 20.0 * i as f64;
        let lx = w - right + 12.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="2"/>"#,
            lx + 20.0
        );
        let last = run.eval.last().map_or(String::new(), |e| format!(" ({:.3})", e.1));
        let _ = writeln!(s, r#"<text x="{}" y="{}">{}{}</text>"#, lx + 26.0, ly + 4.0, escape(&run.name), last);
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="40" text-anchor="middle" fill="#555">lines: training loss{}; dots: evaluation loss</text>"##,
        (left + w - right) / 2.0,
        if window > 1 { format!(" (mean of {window} steps)") } else { String::new() }
    );
    s.push_str("</svg>\n");
    s
}

fn fmt_tick(t: f64) -> String {
    if t.abs() >= 1000.0 || t.fract() == 0.0 { format!("{t:.0}") } else { format!("{}", (t * 1000.0).round() / 1000.0) }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 600.0, 6), vec![0.0, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0]);
        let t = ticks(1.87, 5.6, 6);
        assert!(t.first().unwrap() >= &1.87 && t.last().unwrap() <= &5.6 && t.len() >= 3, "{t:?}");
    }

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let p = [(0.0, 4.0), (1.0, 2.0), (2.0, 0.0)];
        assert_eq!(smooth(&p, 2), vec![(0.0, 4.0), (1.0, 3.0), (2.0, 1.0)]);
        assert_eq!(smooth(&p, 1), p.to_vec());
    }
}
