//! `kiln chat`: an interactive conversation with a decoder, read a line at a time from standard
//! input. Each turn renders the whole history with the chat template (the tokenizer's, or
//! `--chat-template`'s), runs only what the key/value cache does not already hold (the model is
//! loaded once, by `generate`'s [`Generator`]), and streams the answer. Commands: `/reset`,
//! `/system TEXT`, `/help`, `/exit` (end of input ends the session too). Ctrl-C stops the answer
//! being generated — what it said so far stays in the history — but not the session; Ctrl-C at
//! the prompt, or twice before an answer stops, ends it with exit code 130.

use crate::cli::generate::{Generator, Model, ModelArgs, Output, Wants, stream, throughput};
use crate::progress::Reporter;
use crate::report::count;
use anyhow::{Context, Result};
use kiln_runtime::Message;
use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Arguments of `kiln chat`.
#[derive(clap::Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The system prompt the conversation starts with (`/system` changes it).
    #[arg(long)]
    system: Option<String>,
}

impl ChatArgs {
    /// The model file.
    pub fn spec(&self) -> &Path {
        self.model.spec()
    }

    /// Whether `--print-spec` was given.
    pub fn print_spec(&self) -> bool {
        self.model.print_spec()
    }
}

/// What `/help` prints.
const HELP: &str = "\
commands:
  /reset        forget the conversation (the system prompt stays)
  /system TEXT  set the system prompt (`/system` alone removes it)
  /help         this list
  /exit         end the session (so does Ctrl-D)
a line starting with `//` is sent with one `/` dropped; Ctrl-C stops an answer, and at the prompt ends the session";

/// A conversation: the system prompt and the turns after it.
#[derive(Default)]
struct Conversation {
    system: Option<String>,
    turns: Vec<Message>,
}

impl Conversation {
    /// Every message, the system prompt first.
    fn messages(&self) -> Vec<Message> {
        let system = self.system.iter().map(|s| Message::new("system", s.as_str()));
        system.chain(self.turns.iter().cloned()).collect()
    }
}

/// What a line of input asks.
#[derive(Debug, PartialEq, Eq)]
enum Line<'a> {
    /// A message to the model.
    Say(&'a str),
    /// Nothing (a blank line).
    Nothing,
    Reset,
    System(Option<&'a str>),
    Help,
    Exit,
    /// An unknown command.
    Unknown(&'a str),
}

/// Reads one line of input as a message or a command.
fn parse(line: &str) -> Line<'_> {
    let line = line.trim_end_matches(['\n', '\r']);
    if line.trim().is_empty() {
        return Line::Nothing;
    }
    if let Some(escaped) = line.strip_prefix("//") {
        return Line::Say(line.get(1..).filter(|_| !escaped.is_empty()).unwrap_or(line));
    }
    let Some(command) = line.strip_prefix('/') else {
        return Line::Say(line);
    };
    let (name, rest) = command.split_once(char::is_whitespace).unwrap_or((command, ""));
    let rest = Some(rest.trim()).filter(|r| !r.is_empty());
    match name {
        "reset" | "clear" => Line::Reset,
        "system" => Line::System(rest),
        "help" | "?" => Line::Help,
        "exit" | "quit" | "bye" => Line::Exit,
        _ => Line::Unknown(name),
    }
}

/// Ctrl-C's flags: `stop` asks the answer being generated to end; `exit`, when set, makes the
/// next Ctrl-C end the process with 130 (at the prompt, or a second one during an answer).
struct Interrupts {
    stop: Arc<AtomicBool>,
    exit: Arc<AtomicBool>,
}

impl Interrupts {
    /// Registers the handlers: a Ctrl-C ends the process if `exit` is set, else sets `stop` and
    /// `exit` (so a second one ends it).
    fn install() -> Result<Interrupts> {
        let stop = Arc::new(AtomicBool::new(false));
        let exit = Arc::new(AtomicBool::new(true));
        #[cfg(unix)]
        {
            use signal_hook::consts::SIGINT;
            signal_hook::flag::register_conditional_shutdown(SIGINT, 130, exit.clone())
                .context("cannot catch Ctrl-C")?;
            signal_hook::flag::register(SIGINT, exit.clone()).context("cannot catch Ctrl-C")?;
            signal_hook::flag::register(SIGINT, stop.clone()).context("cannot catch Ctrl-C")?;
        }
        Ok(Interrupts { stop, exit })
    }

    /// An answer starts: one Ctrl-C stops it.
    fn answering(&self) {
        self.stop.store(false, Ordering::SeqCst);
        self.exit.store(false, Ordering::SeqCst);
    }

    /// The prompt is shown: Ctrl-C ends the session. Returns whether the answer was stopped.
    fn prompting(&self) -> bool {
        self.exit.store(true, Ordering::SeqCst);
        self.stop.swap(false, Ordering::SeqCst)
    }
}

/// Runs `kiln chat`.
pub fn run(args: ChatArgs, reporter: &Reporter) -> Result<()> {
    let ChatArgs { model, system } = args;
    let wants = Wants { chat: true, text: true, ids_only: false, json: false, max_new: 512 };
    let model = Model::open(model, wants, reporter)?;
    let mut conversation = Conversation { system, turns: Vec::new() };
    // A template that cannot render a conversation is said now, not after the first question.
    let probe = [conversation.messages(), vec![Message::new("user", "Hello")]].concat();
    model.render(&probe)?;
    if model.fe.spec.spec.model.kind == kiln_compiler::spec::BlockKind::EncoderDecoder {
        anyhow::bail!("a chat needs a decoder; `{}` is an encoder-decoder", model.fe.graph.name);
    }
    let interrupts = Interrupts::install()?;
    reporter.info(format_args!("{}", model.sampling.line));
    let mut generator = Generator::load(&model, reporter)?;
    reporter.info(format_args!(
        "{}; chat with `{}`: /help lists the commands, Ctrl-D or /exit ends",
        crate::cli::generate::load_line(&generator.timings),
        model.fe.graph.name
    ));
    let terminal = std::io::stdin().is_terminal();
    let mut input = std::io::stdin().lock();
    let mut out = std::io::stdout();
    let mut line = String::new();
    loop {
        if terminal {
            eprint!("> ");
        }
        line.clear();
        let read = input.read_line(&mut line).context("cannot read standard input")?;
        if read == 0 {
            if terminal {
                eprintln!();
            }
            return Ok(());
        }
        let text = match parse(&line) {
            Line::Say(text) => text,
            Line::Nothing => continue,
            Line::Exit => return Ok(()),
            Line::Help => {
                eprintln!("{HELP}");
                continue;
            }
            Line::Reset => {
                conversation.turns.clear();
                generator.reset();
                reporter.info(format_args!("conversation cleared"));
                continue;
            }
            Line::System(text) => {
                conversation.system = text.map(str::to_string);
                match text {
                    Some(_) => reporter.info(format_args!("system prompt set")),
                    None => reporter.info(format_args!("system prompt removed")),
                }
                continue;
            }
            Line::Unknown(name) => {
                eprintln!("unknown command `/{name}`: /help lists the commands (`//` starts a message with `/`)");
                continue;
            }
        };
        conversation.turns.push(Message::new("user", text));
        let ids = match model.render(&conversation.messages()) {
            Ok(ids) if ids.len() >= generator.max_positions() => Err(anyhow::anyhow!(
                "the conversation is {} long, and the model's context holds {}: /reset starts a new one",
                count(ids.len(), "token"),
                generator.max_positions()
            )),
            rendered => rendered,
        };
        let ids = match ids {
            Ok(ids) => ids,
            Err(e) => {
                conversation.turns.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        };
        interrupts.answering();
        let stop = || interrupts.stop.load(Ordering::SeqCst);
        let answered =
            stream(model.tokenizer.as_ref(), Output::Text, &stop, |on_token| generator.continue_with(&ids, on_token));
        let _ = writeln!(out);
        let stopped = interrupts.prompting();
        let (answer, stats, cached) = match answered {
            Ok(answered) => answered,
            Err(e) => {
                conversation.turns.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        };
        let tok = model.tokenizer.as_ref().context("a chat needs a tokenizer")?;
        let ids32: Vec<u32> = answer.iter().filter_map(|&id| u32::try_from(id).ok()).collect();
        let said = tok.decode(&ids32, true).context("cannot decode the answer")?;
        conversation.turns.push(Message::new("assistant", said));
        if stopped {
            reporter.info(format_args!("interrupted: stopped after {}", count(stats.new_tokens, "token")));
        }
        reporter.info(format_args!(
            "conversation: {} ({cached} cached); {}",
            count(ids.len(), "token"),
            throughput(&stats)
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_as_messages_and_commands() {
        assert_eq!(parse("hello\n"), Line::Say("hello"));
        assert_eq!(parse("  \n"), Line::Nothing);
        assert_eq!(parse("/reset\n"), Line::Reset);
        assert_eq!(parse("/system be brief\r\n"), Line::System(Some("be brief")));
        assert_eq!(parse("/system"), Line::System(None));
        assert_eq!(parse("/exit"), Line::Exit);
        assert_eq!(parse("/frob x"), Line::Unknown("frob"));
        assert_eq!(parse("//etc/hosts"), Line::Say("/etc/hosts"));
    }
}
