//! Diagnostics: errors located in a spec's TOML source.
//!
//! Every user-facing error of the front end is a [`Diagnostic`]: a message, the rule that was broken,
//! optionally the dotted key it concerns and a byte span in the source, and an optional help line.
//! [`Diagnostic::render`] prints it with `file:line:column`, the source line and a caret, so the
//! person sees exactly what to change.

use std::fmt;
use std::ops::Range;

/// One error, located in a spec's source text.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    /// What is wrong, in one sentence.
    pub message: String,
    /// The rule that was broken (a short, stable phrase; tests and docs refer to it).
    pub rule: &'static str,
    /// The dotted key path the error concerns (`attention.kv_heads`), when there is one.
    pub key: Option<String>,
    /// Byte range in the source, when known.
    pub span: Option<Range<usize>>,
    /// A suggestion (`did you mean ...`), when there is one.
    pub help: Option<String>,
}

impl Diagnostic {
    /// A diagnostic with a message and rule, not yet located.
    pub fn new(rule: &'static str, message: impl Into<String>) -> Self {
        Diagnostic { message: message.into(), rule, key: None, span: None, help: None }
    }

    /// Attaches the key path the error concerns.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Attaches a byte span.
    pub fn with_span(mut self, span: Range<usize>) -> Self {
        self.span = Some(span);
        self
    }

    /// Attaches a help line.
    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// Renders the diagnostic against `source` (the text of `file`):
    ///
    /// ```text
    /// error: `attention.kv_heads` = 3 does not divide `attention.heads` = 4
    ///  --> spec.toml:9:12
    ///   |
    /// 9 | kv_heads = 3
    ///   |            ^
    ///   = key: attention.kv_heads
    ///   = rule: kv_heads divides heads
    /// ```
    pub fn render(&self, file: &str, source: &str) -> String {
        let mut out = format!("error: {}\n", self.message);
        // The notes below line up with the gutter's `|`, as wide as the line number.
        let mut pad = " ".to_string();
        match &self.span {
            Some(span) => {
                let (line, col) = line_col(source, span.start);
                let text = source.lines().nth(line - 1).unwrap_or("");
                pad = " ".repeat(line.to_string().len());
                // The caret covers the span on its first line (at least one column).
                let end_on_line = (span.end.max(span.start + 1)).min(line_start(source, line) + text.len());
                let width = source.get(span.start..end_on_line).map(|s| s.chars().count()).unwrap_or(1).max(1);
                out += &format!("{pad}--> {file}:{line}:{col}\n");
                out += &format!("{pad} |\n");
                let (shown, col, width) = window(&visible(text), col, width);
                out += &format!("{line} | {shown}\n");
                out += &format!("{pad} | {}{}\n", " ".repeat(col - 1), "^".repeat(width));
            }
            None => out += &format!(" --> {file}\n"),
        }
        if let Some(key) = &self.key {
            out += &format!("{pad} = key: {key}\n");
        }
        out += &format!("{pad} = rule: {}\n", self.rule);
        if let Some(help) = &self.help {
            out += &format!("{pad} = help: {help}\n");
        }
        out
    }

    /// `line:column` (1-based, columns in characters) of the span's start, if located.
    pub fn location(&self, source: &str) -> Option<(usize, usize)> {
        self.span.as_ref().map(|s| line_col(source, s.start))
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (rule: {})", self.message, self.rule)
    }
}

impl std::error::Error for Diagnostic {}

/// All diagnostics of one spec, with the source they refer to, ready to render.
#[derive(Clone, Debug)]
pub struct SpecError {
    /// The file name used when rendering.
    pub file: String,
    /// The spec's source text.
    pub source: String,
    /// The errors found, in source order where located.
    pub diagnostics: Vec<Diagnostic>,
}

impl SpecError {
    /// Renders every diagnostic, separated by blank lines.
    pub fn render(&self) -> String {
        self.diagnostics.iter().map(|d| d.render(&self.file, &self.source)).collect::<Vec<_>>().join("\n")
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.render().trim_end())
    }
}

impl std::error::Error for SpecError {}

/// A source line as printed under an error: one character per character, so the caret stays
/// aligned, with tabs as spaces and other control characters (NUL, ...) as their visible symbols.
fn visible(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '\t' => ' ',
            '\u{7f}' => '\u{2421}',
            c if (c as u32) < 0x20 => char::from_u32(0x2400 + c as u32).unwrap_or('?'),
            c => c,
        })
        .collect()
}

/// The most characters of a source line shown under an error: a longer line (a text file that
/// is no spec, minified TOML) is cut to this many around the caret, an ellipsis marking each cut.
pub const SHOWN_LINE: usize = 160;

/// `text` (a line, as [`visible`] prints it) cut to [`SHOWN_LINE`] characters around the caret
/// at 1-based `col` of `width` characters, and the caret's column and width in what is shown.
fn window(text: &str, col: usize, width: usize) -> (String, usize, usize) {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= SHOWN_LINE {
        return (text.to_string(), col, width);
    }
    let start = (col - 1).saturating_sub(SHOWN_LINE / 2).min(chars.len() - SHOWN_LINE);
    let end = start + SHOWN_LINE;
    let mut shown: String = chars.get(start..end).unwrap_or_default().iter().collect();
    let lead = usize::from(start > 0);
    if start > 0 {
        shown.insert(0, '…');
    }
    if end < chars.len() {
        shown.push('…');
    }
    let col = col - start + lead;
    (shown, col, width.min(lead + SHOWN_LINE + 1 - col).max(1))
}

/// 1-based line and character column of byte `offset` in `source`.
pub fn line_col(source: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(source.len());
    let before = source.get(..offset).unwrap_or(source);
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    (line, col)
}

fn line_start(source: &str, line: usize) -> usize {
    source.split_inclusive('\n').take(line - 1).map(str::len).sum()
}

/// The closest candidate to `word` by edit distance, if it is close enough to be a likely typo.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (strsim::damerau_levenshtein(word, c), c))
        .filter(|(d, c)| *d <= 2.max(c.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_col_counts_from_one() {
        let s = "a = 1\nbb = 2\n";
        assert_eq!(line_col(s, 0), (1, 1));
        assert_eq!(line_col(s, 6), (2, 1));
        assert_eq!(line_col(s, 11), (2, 6));
    }

    #[test]
    fn suggestions_are_close_words_only() {
        assert_eq!(did_you_mean("hedas", ["heads", "kv_heads"]), Some("heads"));
        assert_eq!(did_you_mean("zzzzzz", ["heads", "kv_heads"]), None);
    }
}
