//! `hiber doctor`

use hiber_core::doctor;
use hiber_core::state::StateDir;

use crate::cli_error::{CliError, ENVIRONMENT};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<(), CliError> {
    let checks = doctor::run(&StateDir::from_env());
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checks).expect("serializes"));
    } else {
        for c in &checks {
            let mark = if c.ok {
                "ok  "
            } else if c.optional {
                "--  "
            } else {
                "FAIL"
            };
            println!("{mark} {:<14} {}", c.name, c.detail);
        }
    }
    if checks.iter().any(|c| !c.ok && !c.optional) {
        return Err(CliError::new(ENVIRONMENT, "this machine cannot checkpoint yet (see FAIL above)").hint("run scripts/setup.sh as root"));
    }
    Ok(())
}
