//! `hiber coordinate --participants N [--listen ADDR] [--timeout SECS]`: one consistent cut
//! across several hibers (one per host, or several on one host): each `hiber checkpoint` or
//! `hiber restore` given `--coordinator ADDR` waits here after each phase until all have
//! reached it, and all abort if one fails. The protocol is in hiber_core::coordinator::net.

use std::net::TcpListener;
use std::time::Duration;

use hiber_core::coordinator::net::{serve, session_token, Outcome, MIN_TOKEN_CHARS};

use crate::cli_error::{CliError, FAILED};

#[derive(clap::Args)]
pub struct Args {
    /// How many hibers take part.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    participants: u16,
    /// Where to listen. Only loopback by default: naming another address opens the session
    /// to other hosts, which then need the session token.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// How long a participant may take to reach the next phase, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

/// The environment variable that carries a session's token to its participants (kept out
/// of command lines, which every user of a host can read).
pub const SESSION_ENV: &str = "HIBER_SESSION";

pub fn run(args: Args) -> Result<(), CliError> {
    let session = match std::env::var(SESSION_ENV) {
        Ok(s) if s.chars().count() < MIN_TOKEN_CHARS => {
            return Err(CliError::new(FAILED, format!("${SESSION_ENV} is too short to keep a session private (at least {MIN_TOKEN_CHARS} characters)"))
                .hint(format!("unset {SESSION_ENV} and the coordinator draws a token of its own")))
        }
        Ok(s) => s,
        _ => {
            let t = session_token().map_err(|e| CliError::new(FAILED, format!("cannot draw a session token: {e}")))?;
            println!("session token (give it to each participant as {SESSION_ENV}): {t}");
            t
        }
    };
    let listener = TcpListener::bind(&args.listen)
        .map_err(|e| CliError::new(FAILED, format!("cannot listen on {}: {e}", args.listen)).hint("choose another --listen address or port"))?;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or(args.listen.clone());
    println!("coordinating {} participants on {addr}", args.participants);
    match serve(&listener, args.participants.into(), &session, Duration::from_secs(args.timeout)) {
        Ok(Outcome::Done(phase)) => {
            println!("every participant passed {phase:?}");
            Ok(())
        }
        Ok(Outcome::Aborted(why)) => {
            Err(CliError::new(FAILED, format!("aborted everywhere: {why}")).hint("each participant undid its own steps; see its own message for the cause"))
        }
        Err(e) => Err(CliError::new(FAILED, format!("coordinator: {e}"))),
    }
}
