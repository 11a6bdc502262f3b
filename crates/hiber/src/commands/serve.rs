//! `hiber serve --listen ADDR --token-file F`: receive jobs that other hosts' hibers move
//! here with `hiber migrate` (see hiber_core::migrate::serve). Runs until stopped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::time::Duration;

use hiber_core::migrate::serve::{serve, ServeOptions};

use super::context;
use crate::cli_error::{CliError, FAILED};

#[derive(clap::Args)]
pub struct Args {
    /// Where to listen, ADDR:PORT (an address of this host that the sources can reach).
    #[arg(long, value_name = "ADDR:PORT")]
    listen: String,
    /// A file (mode 0600) with the secret every source must hold (`hiber migrate
    /// --token-file`), at least 32 characters.
    #[arg(long, value_name = "FILE")]
    token_file: PathBuf,
    /// How long a connection may stay silent, the source's checkpoint included, in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let token = super::token(&args.token_file)?;
    let ctx = context()?;
    let listener = TcpListener::bind(&args.listen)
        .map_err(|e| CliError::new(FAILED, format!("cannot listen on {}: {e}", args.listen)).hint("choose another --listen address or port"))?;
    let addr = listener.local_addr().map(|a| a.to_string()).unwrap_or(args.listen.clone());
    println!("receiving jobs on {addr}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let opts = ServeOptions { token, timeout: Duration::from_secs(args.timeout.max(1)) };
    serve(&ctx, &listener, &opts).map_err(|e| CliError::new(FAILED, format!("accepting on {addr}: {e}")))
}
