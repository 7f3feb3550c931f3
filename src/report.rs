//! How the commands word what they print: counts with their nouns, large numbers with a unit, and
//! JSON documents (what each command prints is its own module's, in `cli/`).

use anyhow::Result;

/// Prints one JSON document on stdout.
pub fn print_json(value: &serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// `1 token`, `3 tokens`, `2 dispatches`: a count with its noun, plural unless one (English's
/// regular plural: `-es` after a sibilant).
pub fn count(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ if ["s", "x", "ch", "sh"].iter().any(|end| noun.ends_with(end)) => format!("{n} {noun}es"),
        _ => format!("{n} {noun}s"),
    }
}

/// `1234567` -> `1.23M`.
pub fn human(x: f64) -> String {
    let (v, unit) = match x {
        x if x >= 1e12 => (x / 1e12, "T"),
        x if x >= 1e9 => (x / 1e9, "G"),
        x if x >= 1e6 => (x / 1e6, "M"),
        x if x >= 1e3 => (x / 1e3, "k"),
        x => (x, ""),
    };
    format!("{v:.2}{unit}")
}

/// `text` cut to its first `max` characters, an ellipsis marking the cut: a sentence or a line
/// quoted in a message or a table, where the whole would drown it.
pub fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", text[..end].trim_end()),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_plural_unless_one() {
        assert_eq!(count(1, "token"), "1 token");
        assert_eq!(count(0, "token"), "0 tokens");
        assert_eq!(count(2, "dispatch"), "2 dispatches");
    }
}
