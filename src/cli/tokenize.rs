//! `kiln tokenize`: how a model's tokenizer splits a text — each token's id and the text it
//! stands for, the ids alone (for `generate --prompt-ids`), or JSON — and with `--decode`, the
//! text of given ids. The tokenizer is found as `generate` finds it: `--tokenizer`, the model's
//! directory or GGUF file, or the GGUF weights.

use crate::report::count;
use anyhow::{Context, Result, bail};
use kiln_runtime::Tokenizer;
use std::path::{Path, PathBuf};

/// Arguments of `kiln tokenize`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").args(["text", "file", "decode"]).required(true)))]
pub struct TokenizeArgs {
    /// The model whose tokenizer to use: a checkpoint (a Hugging Face model directory with its
    /// `tokenizer.json`, or a GGUF file), a `tokenizer.json`, or a spec with `--tokenizer` or
    /// GGUF `--weights`.
    model: PathBuf,
    /// The text to tokenize (`-`: standard input, one final newline dropped).
    #[arg(allow_hyphen_values = true, conflicts_with_all = ["file", "decode"])]
    text: Option<String>,
    /// Instead of TEXT: read it from this file (`-`: standard input); one final newline is dropped.
    #[arg(short, long, conflicts_with = "decode")]
    file: Option<PathBuf>,
    /// Instead: print the text of these token ids (comma-separated), special tokens included.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    decode: Vec<i64>,
    /// The tokenizer: a `tokenizer.json` or a GGUF file (`bytes`: one id per byte).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// With a spec: the weights, whose tokenizer is used when they are a GGUF file.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Leave out the special tokens the tokenizer adds (a beginning-of-sequence token, say).
    #[arg(long)]
    no_special_tokens: bool,
    /// Print only the ids, comma-separated (as `generate --prompt-ids` takes them).
    #[arg(long, conflicts_with_all = ["json", "decode"])]
    ids_only: bool,
    /// Print one JSON document: the ids, and each token's id, vocabulary entry and text.
    #[arg(long)]
    json: bool,
}

/// The tokenizer of `model` as `args` name it, and its path.
fn tokenizer(model: &Path, named: Option<PathBuf>, weights: Option<PathBuf>) -> Result<(Tokenizer, PathBuf)> {
    let is_json = model.extension().is_some_and(|e| e == "json") && model.is_file();
    let path = match (named, weights) {
        (Some(path), _) => path,
        (None, _) if is_json => model.to_path_buf(),
        (None, weights) => match crate::model_file::tokenizer_for(None, model) {
            Some(path) => path,
            None => match weights {
                Some(w) if crate::model_file::is_gguf(&w)? => w,
                _ => bail!(
                    "`{}` brings no tokenizer: give --tokenizer (a tokenizer.json or GGUF file), or --weights with \
                     a GGUF file",
                    model.display()
                ),
            },
        },
    };
    Ok((crate::cli::generate::open_tokenizer(&path, None)?, path))
}

/// Runs `kiln tokenize`.
pub fn run(args: TokenizeArgs) -> Result<()> {
    let (tok, path) = tokenizer(&args.model, args.tokenizer, args.weights)?;
    if !args.decode.is_empty() {
        let ids = args
            .decode
            .iter()
            .map(|&id| u32::try_from(id).map_err(|_| anyhow::anyhow!("--decode: {id} is not a token id")))
            .collect::<Result<Vec<u32>>>()?;
        let text = tok.decode(&ids, false).context("--decode")?;
        match args.json {
            true => crate::report::print_json(&serde_json::json!({"ids": ids, "text": text}))?,
            false => println!("{text}"),
        }
        return Ok(());
    }
    let text = crate::cli::generate::prompt_text(args.text, args.file)?.unwrap_or_default();
    let ids = tok.encode(&text, !args.no_special_tokens)?;
    if args.ids_only {
        let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("{}", ids.join(","));
        return Ok(());
    }
    let pieces = ids
        .iter()
        .map(|&id| Ok((id, tok.id_to_token(id).unwrap_or_default(), tok.decode(&[id], false)?)))
        .collect::<Result<Vec<_>>>()?;
    if args.json {
        let tokens: Vec<serde_json::Value> = pieces
            .iter()
            .map(|(id, token, text)| serde_json::json!({"id": id, "token": token, "text": text}))
            .collect();
        return crate::report::print_json(&serde_json::json!({
            "tokenizer": path.display().to_string(), "ids": ids, "tokens": tokens,
        }));
    }
    for (id, token, text) in &pieces {
        // A byte of a character split over tokens decodes to nothing readable: its entry says it.
        match text.contains(char::REPLACEMENT_CHARACTER) && !token.is_empty() {
            true => println!("{id:>7}  {token}"),
            false => println!("{id:>7}  {text:?}"),
        }
    }
    eprintln!("{}", count(ids.len(), "token"));
    Ok(())
}
