//! `hiber recover`: undo checkpoints that a killed hiber left half-done (every other verb
//! also does this first, when the journal has such entries), and settle restores that a
//! killed hiber left unfinished: adopt the job, or stop and remove it (only here: that
//! decides about a running tree, which `hiber ls` shows until then).

use hiber_core::jobs::Registry;
use hiber_core::journal;
use hiber_core::restore::interrupted::{self, Removal, Settled};
use hiber_core::state::StateDir;
use hiber_core::sys::ExitStatus;

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

fn report_restores(items: &[interrupted::Recovered]) {
    for r in items {
        let name = &r.name;
        match &r.outcome {
            Ok(Settled::Adopted { pid }) => {
                eprintln!("hiber: adopted job {name} (pid {pid}), whose restore was interrupted: its tree runs and needed nothing more")
            }
            Ok(Settled::Removed(Removal::NeverStarted)) => {
                eprintln!("hiber: removed job {name}: its restore was interrupted before CRIU restored its tree")
            }
            Ok(Settled::Removed(Removal::Ended(status))) => {
                let how = match status {
                    Some(ExitStatus::Code(c)) => format!(" (exited with status {c})"),
                    Some(ExitStatus::Signal(s)) => format!(" (killed by signal {s})"),
                    None => String::new(),
                };
                eprintln!("hiber: removed job {name}: its restore was interrupted, and its tree had ended{how}")
            }
            Ok(Settled::Removed(Removal::Stopped(why))) => {
                eprintln!("hiber: stopped and removed job {name}: its restore was interrupted and cannot be completed: {why}")
            }
            Ok(Settled::StillRestoring) => {
                eprintln!("hiber: job {name}: CRIU is still restoring it, whose hiber is gone; run `hiber recover` again later")
            }
            Err(e) => eprintln!("hiber: job {name}: could not settle its interrupted restore: {e}"),
        }
    }
}

pub fn recover_stale_quietly() {
    let state = StateDir::from_env();
    hiber_core::checkpoint::stage::sweep(&state);
    // Private copies of untrusted images that a killed restore left (they hold memory).
    hiber_core::image::trust::sweep_copies(&state);
    if journal::stale_entries(&state).is_empty() {
        return;
    }
    report(&journal::recover(&state, &hiber_core::engine::available()));
}

pub fn run() -> Result<(), CliError> {
    let state = StateDir::from_env();
    let swept = hiber_core::checkpoint::stage::sweep(&state);
    let incoming = hiber_core::migrate::serve::sweep(&state);
    let (_, unreadable_entries) = journal::entries(&state);
    let (_, unreadable_jobs) = Registry::new(&state).list_and_unreadable();
    for (path, why) in unreadable_entries.iter().chain(&unreadable_jobs) {
        eprintln!("hiber: skipped {}: {why}", path.display());
    }
    let done = journal::recover(&state, &hiber_core::engine::available());
    let restores = interrupted::recover(&Registry::new(&state));
    if swept > 0 {
        eprintln!("hiber: removed {swept} staging area(s) of CRIU's files left by a hiber that was killed");
    }
    if incoming > 0 {
        eprintln!("hiber: removed {incoming} image(s) that migrations into this host left when their `hiber serve` was killed");
    }
    if done.is_empty() && restores.is_empty() && swept == 0 && incoming == 0 && unreadable_entries.is_empty() && unreadable_jobs.is_empty() {
        println!("nothing to recover");
    }
    report(&done);
    report_restores(&restores);
    Ok(())
}
