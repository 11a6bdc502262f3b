//! `hiber recover`: undo checkpoints that a killed hiber left half-done. Every other verb
//! also does this first, when the journal has such entries.

use hiber_core::journal;
use hiber_core::state::StateDir;

use crate::cli_error::CliError;

fn report(items: &[journal::Recovered]) {
    for r in items {
        let outcome = match (&r.image_complete, r.root_running) {
            (Some(img), _) => format!("the checkpoint had completed: image {}", img.display()),
            (None, true) => "the application is running again; the partial image was removed".into(),
            (None, false) => "the partial image was removed; the application is not running".into(),
        };
        eprintln!("hiber: recovered an interrupted checkpoint of pid {}: {outcome}", r.root_pid);
        for p in &r.problems {
            eprintln!("hiber:   problem: {p}");
        }
        for n in &r.notes {
            eprintln!("hiber:   note: {n}");
        }
    }
}

pub fn recover_stale_quietly() {
    let state = StateDir::from_env();
    hiber_core::checkpoint::stage::sweep(&state);
    if journal::stale_entries(&state).is_empty() {
        return;
    }
    report(&journal::recover(&state, &hiber_core::engine::available()));
}

pub fn run() -> Result<(), CliError> {
    let state = StateDir::from_env();
    let swept = hiber_core::checkpoint::stage::sweep(&state);
    let done = journal::recover(&state, &hiber_core::engine::available());
    if swept > 0 {
        eprintln!("hiber: removed {swept} staging area(s) of CRIU's files left by a hiber that was killed");
    }
    if done.is_empty() && swept == 0 {
        println!("nothing to recover");
    }
    report(&done);
    Ok(())
}
