//! The commands, one module each: its `clap` arguments and its `run`. `main` parses the command
//! line, calls the command's `run` and renders its error; what commands share lives beside this
//! folder (`exec`: backend flags and the device; `model_file`: the files a command reads;
//! `progress` and `report`: what it says).

pub mod bench;
pub mod chat;
pub mod check;
pub mod compile;
pub mod diff;
pub mod embed;
pub mod eval;
pub mod fetch;
pub mod generate;
pub mod import;
pub mod init;
pub mod inspect;
pub mod list;
pub mod new;
pub mod plot;
pub mod run;
pub mod serve;
pub mod tokenize;
pub mod train;
